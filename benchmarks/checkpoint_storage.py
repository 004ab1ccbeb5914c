"""Checkpoints in a bucket against local disk: save and restore of paper_base's train
state, and the steps/s of a small training that saves every few steps.

  python benchmarks/checkpoint_storage.py [--rounds 3] [--steps 200] [--every 50]

The bucket is the suite's GCS server on the loopback (tests/gcs_server.py: PyPI's
in-memory emulator behind Python's HTTP server), reached through the same layers a
TPU run uses (etils.epath + gcsfs, tensorstore's gcs driver, orbax's commit file). So
the figures are this machine's cost of that path, not GCS's network; each is a ratio
against local disk measured in the same process, the settings alternating round by
round.

1. ``paper_base`` (63M parameters, 37k shared vocabulary) with its Adam moments: a
   synchronous save (until the step is committed) and a restore, local vs bucket.
2. ``configs/ding_mini.py:debug`` trained in this process on one device with
   ``train.checkpoint_every=EVERY``: local disk (synchronous saves), the bucket with
   asynchronous saves (the default there), and the bucket with synchronous saves (what
   the asynchronous upload saves). Steps/s from the logged times of the steps after the
   first logged one (compilation excluded), saves and logging included.

Writes benchmarks/results/checkpoint_storage.{json,md}.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.config import files  # noqa: E402
from flaxformer_lite.config.experiment import OptimizerConfig  # noqa: E402
from flaxformer_lite.config.model import PRESETS  # noqa: E402
from flaxformer_lite.model.build import build_model  # noqa: E402
from flaxformer_lite.training import parallel, startup  # noqa: E402
from flaxformer_lite.training.state import create_train_state, make_optimizer  # noqa: E402
from flaxformer_lite.training.train import train_and_evaluate  # noqa: E402
from flaxformer_lite.workdir import checkpoints as ckpt_lib  # noqa: E402
from flaxformer_lite.workdir import location, storage  # noqa: E402
from tests import gcs_server  # noqa: E402

BUCKET = "bench"


class _Server:
    """A fresh server for each bucket measurement: the emulator keeps deleted objects
    (soft delete) and lists by scanning all of them, so one server for the whole run
    would slow down round by round (GCS does neither)."""

    def __enter__(self) -> str:
        self.process, url = gcs_server.start([BUCKET])
        os.environ["STORAGE_EMULATOR_HOST"] = url
        return url

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait()


def _state_bytes(state) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


def paper_base_io(local_root: Path, rounds: int) -> dict:
    """Seconds of a synchronous save and of a restore of paper_base's train state."""
    model_config = PRESETS["paper_base"]
    model = build_model(model_config, "translation")
    tx, _ = make_optimizer(OptimizerConfig(), model_config, 100_000)
    state = create_train_state(model, tx, 0, 64)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    times: dict[str, dict[str, list[float]]] = {"local": {}, "bucket": {}}
    for r, where in ((r, w) for r in range(rounds) for w in ("local", "bucket")):
        with _Server() if where == "bucket" else contextlib.nullcontext():
            root = (
                location.path(f"gs://{BUCKET}/base-{r}")
                if where == "bucket"
                else location.path(str(local_root / f"base-{r}"))
            )
            checkpoints = ckpt_lib.Checkpoints(root, asynchronous=False)
            started = time.perf_counter()
            checkpoints.save(1, state)
            saved = time.perf_counter()
            restored, _ = checkpoints.restore(target)
            jax.block_until_ready(restored)
            done = time.perf_counter()
            checkpoints.close()
            times[where].setdefault("save", []).append(saved - started)
            times[where].setdefault("restore", []).append(done - saved)
            print(f"round {r} {where}: save {saved - started:.2f} s, restore {done - saved:.2f} s")
            storage.remove_tree(root)
    return {"state_bytes": _state_bytes(state), "times": times}


def _steps_per_second(workdir, first: int = 10) -> float:
    rows = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train" and r["step"] >= first]
    return (train[-1]["step"] - train[0]["step"]) / (train[-1]["time"] - train[0]["time"])


class _Synchronous:
    """Training's checkpoints saved synchronously wherever they go (while inside)."""

    def __enter__(self):
        self.original = ckpt_lib.Checkpoints.__init__

        def init(checkpoints, *args, **kwargs):
            kwargs["asynchronous"] = False
            self.original(checkpoints, *args, **kwargs)

        ckpt_lib.Checkpoints.__init__ = init

    def __exit__(self, *exc):
        ckpt_lib.Checkpoints.__init__ = self.original


def training(local_root: Path, rounds: int, steps: int, every: int) -> dict:
    one = jax.devices()[:1]
    startup.Parallel = lambda *a, **k: parallel.Parallel(*a, devices=one, **k)
    settings = ("local", "bucket_async", "bucket_sync")
    speeds: dict[str, list[float]] = {s: [] for s in settings}
    for r, setting in ((r, s) for r in range(rounds) for s in settings):
        with _Server() if setting != "local" else contextlib.nullcontext():
            config = files.load_config(str(ROOT / "configs/ding_mini.py"), "debug")
            config.train.num_steps = steps
            config.train.checkpoint_every = every
            config.train.log_every = every
            config.train.eval_every = 10 * steps  # the final evaluation only
            workdir = (
                location.path(f"gs://{BUCKET}/train-{setting}-{r}")
                if setting != "local"
                else location.path(str(local_root / f"train-{r}"))
            )
            if setting == "bucket_sync":
                with _Synchronous():
                    train_and_evaluate(config, workdir)
            else:
                train_and_evaluate(config, workdir)
            speeds[setting].append(_steps_per_second(workdir))
            print(f"round {r} {setting}: {speeds[setting][-1]:.2f} steps/s", flush=True)
            storage.remove_tree(workdir)
    return {"steps": steps, "every": every, "steps_per_second": speeds}


def _median(values: list[float]) -> float:
    return statistics.median(values)


def _range(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def write(result: dict, out: Path) -> None:
    io, train = result["paper_base"], result["training"]
    t = io["times"]
    lines = [
        "# Checkpoints in a bucket against local disk",
        "",
        f"`python benchmarks/checkpoint_storage.py --rounds {result['rounds']} --steps "
        f"{train['steps']} --every {train['every']}` on {result['machine']}; the bucket is "
        "tests/gcs_server.py on the loopback (in-memory, Python's HTTP server), through "
        "gcsfs and tensorstore's gcs driver as on a TPU VM. Medians over the rounds "
        "(range), local and bucket alternating in one process.",
        "",
        f"paper_base's train state ({io['state_bytes'] / 2**20:,.0f} MiB: parameters and "
        "Adam moments):",
        "",
        "| | local disk (s) | bucket (s) | bucket / local |",
        "|---|---|---|---|",
    ]
    for what in ("save", "restore"):
        local, bucket = t["local"][what], t["bucket"][what]
        lines.append(
            f"| {what} | {_median(local):.2f} ({_range(local)}) | {_median(bucket):.2f} "
            f"({_range(bucket)}) | {_median(bucket) / _median(local):.1f}x |"
        )
    s = train["steps_per_second"]
    base = _median(s["local"])
    lines += [
        "",
        f"configs/ding_mini.py:debug on one CPU device, {train['steps']} steps, a checkpoint "
        f"(and a log line) every {train['every']} steps; steps/s from the first logged step "
        "to the last (the compilation before it), saves included:",
        "",
        "| checkpoints | steps/s | vs local |",
        "|---|---|---|",
    ]
    names = {"local": "local disk", "bucket_async": "bucket, asynchronous (default)",
             "bucket_sync": "bucket, synchronous"}  # fmt: skip
    for setting, name in names.items():
        lines.append(
            f"| {name} | {_median(s[setting]):.2f} ({_range(s[setting])}) | "
            f"{_median(s[setting]) / base:.2f} |"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "checkpoint_storage.md").write_text("\n".join(lines) + "\n")
    (out / "checkpoint_storage.json").write_text(json.dumps(result, indent=1))
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--skip_base", action="store_true", help="part 2 only")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="checkpoint-storage-") as tmp:
        result = {
            "rounds": args.rounds,
            "machine": f"{os.cpu_count()} CPU cores ({jax.devices()[0].device_kind})",
            "paper_base": None if args.skip_base else paper_base_io(Path(tmp), args.rounds),
            "training": training(Path(tmp), args.rounds, args.steps, args.every),
        }
    if result["paper_base"] is not None:
        write(result, args.out)
    else:
        print(json.dumps(result["training"], indent=1))


if __name__ == "__main__":
    main()
