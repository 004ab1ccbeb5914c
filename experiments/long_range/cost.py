"""What a training step of each pattern of the grid costs: time and peak memory.

  .venv/bin/python experiments/long_range/cost.py [--task listops] [--lengths 512,4096]
  .venv/bin/python experiments/long_range/cost.py --task mqar_l64 --lengths 64 \
      --out experiments/long_range/cost_mqar_l64.json
  .venv/bin/python experiments/long_range/cost.py --lengths 512 \
      --patterns 'moba=moba:block=16,k=4;nsa=nsa:block=16,k=3,window=16' --out ...

The grid's model (config.py) for ``--task`` with each pattern of grid.py (scaled to
the task's rows where grid.PATTERNS_OF says), one jitted training step on a synthetic
batch of the config's shape (at the task's length; at longer lengths the same number
of tokens in fewer rows), all compiled in one process
and timed round-robin (each round steps every pattern once, so drift in the machine's
speed falls on all of them alike): the median step time over ``--steps`` rounds, its
ratio to dense, and XLA's peak buffer bytes of the compiled step (arguments + outputs +
temporaries, less what the donated state aliases). Writes cost.json here; report.py
puts it beside the accuracies. Times are of this CPU; the ratios are what carries over.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from grid import PATTERNS, PATTERNS_OF, TASKS  # noqa: E402

from flaxformer_lite.config import files  # noqa: E402
from flaxformer_lite.config.model import model_config_from  # noqa: E402
from flaxformer_lite.model.build import build_model  # noqa: E402
from flaxformer_lite.training import steps  # noqa: E402
from flaxformer_lite.training.state import create_train_state, make_optimizer  # noqa: E402


def compiled_step(config, pattern: str, rows: int, length: int):
    """(compiled step, state, batch, peak bytes) of the config's model with ``pattern``."""
    model_config = model_config_from(config).replace(attention_pattern=pattern, max_len=length)
    task = config.data.task
    model = build_model(model_config, task)
    tx, schedule = make_optimizer(config.optimizer, model_config, 1000)
    state = create_train_state(model, tx, 0, length)
    fn = jax.jit(
        functools.partial(
            steps.train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.0
        ),
        donate_argnums=(0,),
    )
    rng = np.random.default_rng(0)
    tokens = rng.integers(4, model_config.vocab_size, (rows, length))
    batch = {"targets": tokens}
    if task == "classify":
        labels = np.zeros((rows, length), np.int64)
        labels[:, 0] = rng.integers(0, max(model_config.num_classes, 1), rows)
        batch = {"inputs": tokens, "targets": labels}
    batch = {k: jax.device_put(np.asarray(v, np.int32)) for k, v in batch.items()}
    compiled = fn.lower(state, batch).compile()
    m = compiled.memory_analysis()
    peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return compiled, state, batch, int(peak - m.alias_size_in_bytes)


def measure(task: str, length: int, rounds: int, only: dict[str, str] | None = None) -> dict:
    grid = files.load_config(str(HERE / "config.py"), TASKS[task])
    rows = max(1, grid.train.batch_size * grid.data.max_length // length)  # the grid's tokens
    config = files.load_config(
        str(HERE / "config.py"), re.sub(r"\bl\d+", f"l{length}", TASKS[task])
    )
    patterns = PATTERNS_OF.get(task, PATTERNS)
    if only:  # these patterns beside dense, the baseline
        patterns = {"dense": patterns["dense"], **only}
    runs = {}
    for name, spec in patterns.items():
        fn, state, batch, peak = compiled_step(config, spec, rows, length)
        state, metrics = fn(state, batch)  # the first run, out of the timing
        jax.block_until_ready(metrics)
        runs[name] = {"fn": fn, "state": state, "batch": batch, "bytes": peak, "times": []}
        print(f"  compiled {name} at {length}", flush=True)
    for _ in range(rounds):
        for r in runs.values():
            t = time.perf_counter()
            r["state"], metrics = r["fn"](r["state"], r["batch"])
            jax.block_until_ready(metrics)
            r["times"].append(time.perf_counter() - t)
    dense = statistics.median(runs["dense"]["times"])
    return {
        "task": task,
        "length": length,
        "rows": rows,
        "patterns": {
            name: {
                "spec": patterns[name],
                "step_s": statistics.median(r["times"]),
                "vs_dense": statistics.median(r["times"]) / dense,
                "peak_mib": r["bytes"] / 2**20,
                "memory_vs_dense": r["bytes"] / runs["dense"]["bytes"],
            }
            for name, r in runs.items()
        },
    }


def _cpu_name() -> str:
    """The CPU's model name (Linux), else what the platform module says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="listops", choices=sorted(TASKS))
    parser.add_argument("--lengths", default="512,4096")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds")
    parser.add_argument("--out", default=str(HERE / "cost.json"))
    parser.add_argument("--patterns", default="", help="NAME=SPEC;... instead of the grid's "
                        "(dense always): e.g. 'moba=moba:block=16,k=4'")  # fmt: skip
    args = parser.parse_args()
    only = dict(x.split("=", 1) for x in args.patterns.split(";") if x)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    result = {
        "machine": f"{_cpu_name()}, {jax.device_count()} {jax.default_backend()} device(s)",
        "jax": jax.__version__,
        "rounds": args.steps,
        "runs": [measure(args.task, n, args.steps, only) for n in lengths],
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for run in result["runs"]:
        print(f"{run['task']} at {run['length']} tokens ({run['rows']} rows):")
        for name, p in run["patterns"].items():
            print(
                f"  {name:11s} {1e3 * p['step_s']:8.1f} ms  {p['vs_dense']:5.2f}x dense  "
                f"{p['peak_mib']:7.1f} MiB  {p['memory_vs_dense']:5.2f}x"
            )


if __name__ == "__main__":
    main()
