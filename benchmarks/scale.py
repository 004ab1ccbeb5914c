"""Per-device memory and step time of paper_base / paper_big across device meshes.

  python benchmarks/scale.py [--meshes 8x1x1,1x8x1,2x2x2,1x1x8] [--rounds 3]

On 8 simulated CPU devices (set here), for each model and mesh (data x fsdp x
model) the train step is compiled from shapes alone (nothing allocated) with the
state laid out by ``partitioning.RULES``; the table gives, per device:

* ``state``: parameters + Adam moments, the bytes of one device's shards;
* ``XLA args / temp / peak``: the compiled program's own memory analysis
  (arguments incl. the batch, temporaries, and their sum with the outputs minus
  the donated state, as XLA reports it);
* ``state / replicated``: the state per device relative to 8x1x1 (FSDP's goal
  for paper_big: at most 1/6);
* ``step / 8x1x1``: paper_base's step time relative to 8x1x1, measured in this
  process in alternating rounds (CPU devices share the host's cores: this is the
  partitioner's overhead, not a speed-up).

Batch: 32 rows x 64 tokens, packed. Writes benchmarks/results/scale.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.config.experiment import OptimizerConfig  # noqa: E402
from flaxformer_lite.config.model import PRESETS  # noqa: E402
from flaxformer_lite.data import pipeline  # noqa: E402
from flaxformer_lite.model import partitioning  # noqa: E402
from flaxformer_lite.model.transformer import Transformer  # noqa: E402
from flaxformer_lite.training.parallel import Parallel  # noqa: E402
from flaxformer_lite.training.state import (  # noqa: E402
    create_train_state,
    make_optimizer,
    state_partitioning,
)
from flaxformer_lite.training.steps import train_step  # noqa: E402

BATCH, LENGTH = 32, 64
MIB = 2**20


def _spec(mesh: str) -> str:
    data, fsdp, model = mesh.split("x")
    return f"data:{data},fsdp:{fsdp},model:{model}"


def _setup(name: str, mesh: str):
    config = PRESETS[name]
    tx, schedule = make_optimizer(OptimizerConfig(), config, 100_000)
    model = Transformer(config)
    par = Parallel("jit", _spec(mesh))
    partitioning.check_model(par.mesh, config, BATCH)
    specs, abstract = state_partitioning(model, tx, LENGTH)
    par.lay_out(specs, abstract)
    step = par.train_step(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1)
    batch = pipeline.synthetic_batch(BATCH, LENGTH, config.vocab_size)
    return config, model, tx, par, step, abstract, batch


def memory(name: str, mesh: str) -> dict:
    """Per-device bytes of one train step on ``mesh``, from shapes alone."""
    _, _, _, par, step, abstract, batch = _setup(name, mesh)
    state_bytes = sum(
        int(np.prod(s.shard_shape(x.shape))) * x.dtype.itemsize
        for x, s in zip(
            jax.tree.leaves(abstract), jax.tree.leaves(par.state_shardings), strict=True
        )
    )
    shaped_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        abstract,
        par.state_shardings,
    )
    shaped_batch = {
        k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=par.batch_sharding)
        for k, v in batch.items()
    }
    start = time.perf_counter()
    with par.tracing():
        compiled = step.compiled.lower(shaped_state, shaped_batch, None).compile()
    seconds = time.perf_counter() - start
    m = compiled.memory_analysis()
    return {
        "model": name,
        "mesh": mesh,
        "params": int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract.params))),
        "state_mib": state_bytes / MIB,
        "args_mib": m.argument_size_in_bytes / MIB,
        "temp_mib": m.temp_size_in_bytes / MIB,
        "peak_mib": (
            m.argument_size_in_bytes
            + m.output_size_in_bytes
            - m.alias_size_in_bytes
            + m.temp_size_in_bytes
        )
        / MIB,
        "compile_s": seconds,
    }


def step_times(name: str, meshes: list[str], rounds: int) -> dict[str, float]:
    """Median seconds per step of ``name`` on each mesh, alternating meshes per round."""
    runs = {}
    for mesh in meshes:
        config, model, tx, par, step, _, batch = _setup(name, mesh)
        state = create_train_state(model, tx, 0, LENGTH, par.state_shardings)
        b = par.put_batch(batch)
        state, metrics = step(state, b)  # compile
        jax.block_until_ready(metrics)
        runs[mesh] = [step, state, b, []]
    for _ in range(rounds):
        for _mesh, run in runs.items():
            step, state, b, times = run
            start = time.perf_counter()
            state, metrics = step(state, b)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            run[1] = state
    return {mesh: statistics.median(run[3]) for mesh, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="8x1x1,1x8x1,2x2x2,1x1x8")
    parser.add_argument("--models", default="paper_base,paper_big")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scale"))
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the measuring, not after it
    meshes = args.meshes.split(",")
    rows = []
    for name in args.models.split(","):
        for mesh in meshes:
            row = memory(name, mesh)
            rows.append(row)
            print(
                f"{name} {mesh}: state {row['state_mib']:.0f} MiB/device, XLA peak "
                f"{row['peak_mib']:.0f} MiB (compiled in {row['compile_s']:.0f} s)",
                flush=True,
            )
    for name in {r["model"] for r in rows}:
        base = next(r for r in rows if r["model"] == name and r["mesh"] == meshes[0])
        for r in rows:
            if r["model"] == name:
                r["state_vs_replicated"] = r["state_mib"] / base["state_mib"]
    times = step_times("paper_base", meshes, args.rounds) if args.rounds else {}
    for r in rows:
        if r["model"] == "paper_base" and times:
            r["step_s"] = times[r["mesh"]]
            r["step_vs_first"] = times[r["mesh"]] / times[meshes[0]]
    Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = [
        "# Per-device memory across meshes (8 simulated CPU devices)",
        "",
        f"`python benchmarks/scale.py` — train step of {BATCH} x {LENGTH} tokens, Adam, "
        "state laid out by `partitioning.RULES`; mesh = data x fsdp x model. "
        "State = parameters + Adam moments on one device; XLA columns from the compiled "
        "step's memory analysis. Step time: paper_base, median of alternating rounds, "
        f"relative to {meshes[0]} in the same process (CPU: partitioning overhead only).",
        "",
        "| model | mesh | parameters | state MiB/device | state / replicated "
        "| XLA args MiB | XLA temp MiB | XLA peak MiB | step / " + meshes[0] + " |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        step = f"{r['step_vs_first']:.2f}" if "step_vs_first" in r else "—"
        lines.append(
            f"| {r['model']} | {r['mesh']} | {r['params'] / 1e6:.1f}M | {r['state_mib']:.0f} "
            f"| {r['state_vs_replicated']:.3f} | {r['args_mib']:.0f} | {r['temp_mib']:.0f} "
            f"| {r['peak_mib']:.0f} | {step} |"
        )
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
