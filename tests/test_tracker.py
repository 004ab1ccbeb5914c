"""train.wandb_project: the metrics the logger writes reach a Weights & Biases run in
W&B's offline mode, the run id stays in the workdir so that a resume continues the same
run, and the run folder W&B writes holds them (read back with W&B's own record format,
wandb.proto); without the wandb package the field is refused with the fix."""

import struct
import time

import pytest

from flaxformer_lite.config.model import ConfigError

wandb = pytest.importorskip("wandb")


def _records(path):
    """The records of a ``run-<id>.wandb`` file: W&B's protobuf records in the
    leveldb-log container it writes (32 KiB blocks; a 7-byte header per chunk)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, part, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:  # the rest of a block is padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(part)
            out.append(record)
    return out


def _settled(folder, runs: int, timeout: float = 60.0) -> None:
    """Wait until ``runs`` run files under ``folder`` each end with their exit record:
    ``run.finish()`` returns before W&B's service has written all of its file (a busy
    machine read a summary missing right after finish, present a moment later)."""
    deadline = time.monotonic() + timeout
    while True:
        paths = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
        try:
            kinds = [[r.WhichOneof("record_type") for r in _records(p)] for p in paths]
        except Exception:  # a record half-written: read again
            kinds = []
        if len(kinds) == runs and all("exit" in k for k in kinds):
            return
        assert time.monotonic() < deadline, f"W&B wrote {len(kinds)} of {runs} whole runs"
        time.sleep(0.2)


def _history(folder):
    """{(step, key): value} of every history record under a workdir's wandb folder."""
    values = {}
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):
        for record in _records(path):
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in record.history.item}
                values.update({(int(items["_step"]), k): float(v) for k, v in items.items()
                               if not k.startswith("_")})  # fmt: skip
    return values


def test_metrics_reach_an_offline_run_and_a_resume_continues_it(tmp_path, monkeypatch):
    from flaxformer_lite.training.logging import MetricsLogger
    from flaxformer_lite.workdir.tracker import RUN_ID_FILE, WandbRun

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    first = MetricsLogger(tmp_path, 10, tracker=WandbRun(tmp_path, "t", {"model": {"d": 8}}))
    for step in (1, 2):
        first.write(step, {"loss": 5.0 - step, "tokens_per_sec": 100.0})
    first.write(2, {"loss": 4.5, "bleu": 1.25}, prefix="val")
    first.close()
    run_id = (tmp_path / RUN_ID_FILE).read_text()
    resumed = MetricsLogger(tmp_path, 10, tracker=WandbRun(tmp_path, "t"))
    resumed.write(3, {"loss": 1.5, "nan_is_left_out": float("nan")})
    resumed.close()
    scores = WandbRun(tmp_path, "t")  # main evaluate's scores, into the run's summary
    scores.summary({"test/bleu": 7.5})
    scores.close()
    assert (tmp_path / RUN_ID_FILE).read_text() == run_id
    _settled(tmp_path, runs=3)
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(run_id in r.name for r in runs)  # one W&B run id
    history = _history(tmp_path)
    assert history[(1, "train/loss")] == 4.0 and history[(2, "train/loss")] == 3.0
    assert history[(2, "val/bleu")] == 1.25 and history[(3, "train/loss")] == 1.5
    assert not any("nan_is_left_out" in k for _, k in history)
    summary = {}
    for path in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"):
        for record in _records(path):
            if record.WhichOneof("record_type") == "summary":
                summary.update({i.key: i.value_json for i in record.summary.update})
    assert float(summary["test/bleu"]) == 7.5


def test_without_wandb_the_field_is_refused(monkeypatch):
    import importlib.util

    from flaxformer_lite.config import rules
    from tests.fixtures import load_config

    config = load_config()
    config.train.wandb_project = "mine"
    real = importlib.util.find_spec
    monkeypatch.setattr(
        rules.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    with pytest.raises(ConfigError, match=r"wandb_project='mine' needs Weights & Biases"):
        rules.check_train(config.train)
