"""A real training run on the accelerator: the demo's recipe, its averaging and decoding.

  python benchmarks/accelerator_train.py --out DIR [--minutes 8]      # on a GPU
  python benchmarks/accelerator_train.py --out DIR --tiny             # dry run on CPU

Runs the three commands of ``make demo`` with ``configs/ende_small.py``:

1. train for ``--minutes`` of training time (``train.max_minutes``; the step count is
   not the limit unless ``--steps`` sets one, as the recipe's 2000), bfloat16 compute
   with float32 parameters, one chain (the CPU's ``concurrent_splits`` off);
   evaluation and checkpoints every ``--every`` steps (``--every 200 --steps 2000`` is
   the recipe as the CPU demo runs it, ~2.5 minutes on an H200); attention by XLA's
   dense kernel, since the recipe keeps dropout on the attention weights (``--cudnn``
   drops it and uses cuDNN's fused kernel instead);
2. average the last four checkpoints;
3. translate the test split with beam 4, alpha 1.0 and no repeated 3-grams, and score
   it with sacrebleu (the demo's decoding).

Writes ``DIR/train_run.{json,md}`` (steps, training minutes, median tokens/s, the last
validation numbers, test BLEU and chrF), the run's ``metrics.jsonl``, the test scores
(``test_scores.json``) and the three commands' output (``train_logs.txt``). The
workdir (checkpoints) stays outside DIR (``--workdir``). The corpus must be prepared
(``make prepare``, or its raw package under data/raw, as the accelerator bundle brings
it: docs/accelerator.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(cmd: list[str], log: Path, env: dict) -> float:
    """Run ``cmd`` from the project root, its output to the console and (appended) ``log``."""
    print("$ " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            sys.stdout.write(line)
            f.write(line)
        if proc.wait():
            raise SystemExit(f"error: {' '.join(cmd[:4])} ... exited {proc.returncode}; see {log}")
    return time.perf_counter() - start


def summarize(workdir: Path) -> dict:
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    train = [r for r in records if r.get("split") == "train"]
    valid = [r for r in records if r.get("split") == "validation"]
    rates = [r["tokens_per_sec"] for r in train[1:] if "tokens_per_sec" in r]
    summary = {
        "steps": train[-1]["step"] if train else 0,
        "train_minutes": (train[-1]["time"] - train[0]["time"]) / 60 if len(train) > 1 else 0.0,
        "median_target_tokens_per_s": statistics.median(rates) if rates else None,
        "median_tflops_per_s": statistics.median(
            [r["tflops_per_sec"] for r in train[1:] if "tflops_per_sec" in r] or [0.0]
        ),
    }
    if valid:
        last = valid[-1]
        summary["validation"] = {k: last.get(k) for k in ("step", "loss", "accuracy", "bleu")}
    scores = workdir / "test_scores.json"
    if scores.exists():
        summary["test"] = json.loads(scores.read_text())
    return summary


def report(result: dict) -> str:
    s = result["summary"]
    test = s.get("test", {})
    valid = s.get("validation", {})
    return "\n".join(
        [
            f"`{result['command']}` on {result['device']}",
            "",
            "| steps | training minutes | target tokens/s (median) | model TFLOP/s (median) "
            "| validation loss | test BLEU | test chrF |",
            "|---|---|---|---|---|---|---|",
            f"| {s['steps']} | {s['train_minutes']:.1f} | "
            f"{s['median_target_tokens_per_s'] or 0:,.0f} | {s['median_tflops_per_s']:.2f} | "
            f"{valid.get('loss', float('nan')):.3f} | {test.get('bleu', float('nan')):.2f} | "
            f"{test.get('chrf', float('nan')):.1f} |",
            "",
            "Commands: " + "; ".join(f"`{c}`" for c in result["commands"]),
            f"Wall time of each: train {result['seconds'][0]:.0f} s, average "
            f"{result['seconds'][1]:.0f} s, evaluate {result['seconds'][2]:.0f} s.",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--minutes", type=float, default=8.0, help="training time")
    parser.add_argument("--every", type=int, default=500, help="steps between evals/checkpoints")
    parser.add_argument(
        "--steps", type=int, default=1_000_000,
        help="step cap (default: none, --minutes ends the run; the recipe's own cap is 2000)",
    )  # fmt: skip
    parser.add_argument("--workdir", default="/tmp/flaxformer_accelerator_run")
    parser.add_argument("--cudnn", action="store_true", help="cuDNN, no attention dropout")
    parser.add_argument("--tiny", action="store_true", help="dry run: the :debug variant")
    parser.add_argument("--set", action="append", default=[], help="--config.X=Y overrides")
    args = parser.parse_args()

    import jax  # after argparse: --help answers at once

    if jax.default_backend() != "gpu" and not args.tiny:
        raise SystemExit("error: no GPU here; run on a GPU, or add --tiny for a CPU dry run")
    out, workdir = Path(args.out), Path(args.workdir)
    out.mkdir(parents=True, exist_ok=True)
    if workdir.exists():
        shutil.rmtree(workdir)  # a fresh run: the numbers are this run's
    (out / "train_logs.txt").unlink(missing_ok=True)
    env = dict(os.environ)
    if args.tiny and jax.default_backend() != "gpu":
        env["FLAXFORMER_FUSED_ON_CPU"] = "1"
    main_cmd = [sys.executable, "-m", "flaxformer_lite.main"]
    config = "--config=configs/ende_small.py" + (":debug" if args.tiny else "")
    overrides = [
        "--config.model.dtype=bfloat16",
        "--config.train.concurrent_splits=1",
    ]
    if not args.tiny:
        overrides += [
            f"--config.train.max_minutes={args.minutes}",
            f"--config.train.num_steps={args.steps}",
            f"--config.train.eval_every={args.every}",
            f"--config.train.checkpoint_every={args.every}",
        ]
    if args.cudnn:
        overrides += ["--config.model.attention_impl=cudnn", "--config.model.attention_dropout=0"]
    overrides += [f"--config.{s}" if not s.startswith("--") else s for s in args.set]
    commands = [
        [*main_cmd, config, f"--workdir={workdir}", *overrides],
        [*main_cmd, "average", f"--workdir={workdir}", "--num=4"],
        [*main_cmd, "evaluate", f"--workdir={workdir}", "--split=test", "--alpha=1.0",
         "--no_repeat_ngram=3"],
    ]  # fmt: skip
    seconds = [run(cmd, out / "train_logs.txt", env) for cmd in commands]
    result = {
        "command": "python benchmarks/accelerator_train.py " + " ".join(sys.argv[1:]),
        "device": jax.devices()[0].device_kind,
        "commands": ["python " + " ".join(c[1:]) for c in commands],
        "seconds": seconds,
        "summary": summarize(workdir),
    }
    for name in ("metrics.jsonl", "test_scores.json"):
        if (workdir / name).exists():
            shutil.copy(workdir / name, out / name)
    (out / "train_run.json").write_text(json.dumps(result, indent=2))
    (out / "train_run.md").write_text(report(result))
    print(report(result))


if __name__ == "__main__":
    main()
