"""Averaging the end of a run: what `average` gives at the step counts machines reach.

  .venv/bin/python experiments/translation_recipe/averaging.py train --seeds=0,1,2
  .venv/bin/python experiments/translation_recipe/averaging.py score --seeds=0,1,2
  .venv/bin/python experiments/translation_recipe/averaging.py report

`train` trains the demo's recipe (configs/ende_small.py) at fixed step counts, so that
the machine's speed does not move them: one run per seed, stopped and resumed at each
budget of BUDGETS (noam does not depend on the step count and a resume continues bit
for bit, so the run's first N steps are the N-step run's), each command writing the
final checkpoints (`train.final_checkpoints`) its budget gets, and every checkpoint
kept. `score` translates the test split (beam 4, alpha 1.0, no repeated 3-grams, as
`make demo`) with, per seed and budget:

- `window`: the mean of the last 4 checkpoints of the budget's last quarter (the rule
  of `average`, on the checkpoints the N-step run wrote);
- `old` (600 and 1,560 only): the mean of the last 4 checkpoints the code before the
  rule wrote (every `checkpoint_every`=200 steps and the last), wherever they were;
- `last`: the last checkpoint alone (its moving average);
- `best` (1,560 only): the checkpoint of the lowest validation loss.

Scores go to averaging.json as they come (a rerun scores only what is missing);
`report` prints the tables of the record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "averaging.json"
BUDGETS = (300, 600, 1000, 1560)
OLD_EVERY, NUM = 200, 4
DECODE = {"beam_size": 4, "alpha": 1.0, "no_repeat_ngram": 3}


def workdir(seed: int) -> Path:
    return ROOT / "runs" / "averaging" / f"seed{seed}"


def train(seeds: list[int]) -> None:
    for seed in seeds:
        for budget in BUDGETS:
            cmd = [
                sys.executable, "-m", "flaxformer_lite.main", "--config=configs/ende_small.py",
                f"--workdir={workdir(seed)}", "--config.train.max_minutes=0",
                f"--config.train.num_steps={budget}", f"--config.train.seed={seed}",
                "--config.train.keep_checkpoints=100",
            ]  # fmt: skip
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)


def variants(kept: list[int], budget: int) -> dict[str, list[int] | str]:
    """The checkpoint steps each variant averages at ``budget`` ('best': the best dir)."""
    from flaxformer_lite.inference.average import choose_steps

    upto = [s for s in kept if s <= budget]
    out: dict[str, list[int] | str] = {"window": choose_steps(upto, NUM, 0.25)[0]}
    out["last"] = [budget]
    if budget in (600, 1560):
        out["old"] = [s for s in upto if s % OLD_EVERY == 0 or s == budget][-NUM:]
    if budget == BUDGETS[-1]:
        out["best"] = "best"
    return out


def validation_nll(run, model, params) -> float:
    """The validation nll of ``params``, as the training loop's evaluation computes it."""
    import jax

    from flaxformer_lite.data import pipeline
    from flaxformer_lite.data.sources import load_texts
    from flaxformer_lite.training import losses
    from flaxformer_lite.training.steps import eval_step

    d, t = run.config.data, run.config.train
    pairs = load_texts(d.dataset, d.eval_split, d.features, d.data_dir)
    examples, _ = pipeline.tokenize_pairs(pairs, run.tokenizer, d.max_length, "truncate")
    batches = pipeline.eval_batches(examples, batch_size=t.batch_size, max_length=d.max_length)
    step = jax.jit(
        lambda p, b: eval_step(p, b, model=model, label_smoothing=t.label_smoothing)
    )  # fmt: skip
    total = None
    for batch in batches:
        sums = step(params, batch)
        total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
    return float(losses.summarize(jax.device_get(total))["nll"])


def score(seeds: list[int]) -> None:
    from flaxformer_lite.data.sources import load_texts
    from flaxformer_lite.inference.average import average_params
    from flaxformer_lite.inference.evaluation import corpus_scores
    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.inference.translate import Translator

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = {seed: Run.open(workdir(seed)) for seed in seeds}
    d = runs[seeds[0]].config.data
    pairs = load_texts(d.dataset, "test", (d.source_lang, d.target_lang), d.data_dir)
    # The comparison (600 and 1,560 steps) for every seed first, then the curve's points.
    for budget in sorted(BUDGETS, key=lambda b: b not in (600, 1560)):
        for seed, run in runs.items():
            if budget not in run.steps("last"):
                continue  # not trained that far yet
            for name, steps in variants(run.steps("last"), budget).items():
                key = f"seed{seed}/{budget}/{name}"
                if "val_nll" in results.get(key, {}):
                    continue
                if steps == "best":
                    params, step = run.params("best")
                    if step == budget:  # the last checkpoint, scored already
                        results[key] = {**results[f"seed{seed}/{budget}/last"], "steps": [step]}
                        continue
                    steps = [step]
                else:
                    params = average_params(run, steps)
                model = run.model()  # as `evaluate` decodes: the run's decode section
                if key not in results:  # (scored before the nll was recorded: the nll only)
                    translator = Translator(
                        model, params, run.tokenizer, decode=run.config.decode
                    )  # fmt: skip
                    hyps = translator.translate([p[0] for p in pairs], **DECODE)
                    s = corpus_scores(hyps, [p[1] for p in pairs])
                    results[key] = {"steps": steps, "bleu": s.bleu, "chrf": s.chrf}
                results[key]["val_nll"] = validation_nll(run, model, params)
                print(key, results[key], flush=True)
                RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


def report() -> None:
    results = json.loads(RESULTS.read_text())
    seeds = sorted({k.split("/")[0] for k in results})
    print(f"| steps | variant | {' | '.join(seeds)} | mean ± std |")
    print("|---|---|" + "---:|" * (len(seeds) + 1))
    for budget in BUDGETS:
        for name in ("old", "window", "last", "best"):
            row = [results.get(f"{s}/{budget}/{name}") for s in seeds]
            if not any(row):
                continue
            got = [r["bleu"] for r in row if r]
            cells = [f"{r['bleu']:.2f} ({_span(r['steps'])})" if r else "—" for r in row]
            sd = statistics.stdev(got) if len(got) > 1 else float("nan")
            spread = f"{statistics.fmean(got):.2f} ± {sd:.2f}"
            print(f"| {budget:,} | {name} | {' | '.join(cells)} | {spread} |")


def _span(steps: list[int]) -> str:
    return f"{steps[0]:,}" if len(steps) == 1 else f"{steps[0]:,}–{steps[-1]:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("train", "score", "report"))
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    {"train": train, "score": score, "report": lambda _: report()}[args.phase](seeds)


if __name__ == "__main__":
    main()
