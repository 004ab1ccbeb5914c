"""MetricsLogger: what lands in metrics.jsonl and the TensorBoard event file."""

import json
import math
import struct

import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from flaxformer_lite.training.logging import MetricsLogger, _format_duration


def _scalars(workdir) -> dict[tuple[str, int], float]:
    """(tag, step) -> value of every scalar in the run's TensorBoard event files
    (TFRecord framing: length, its CRC, the Event proto, its CRC)."""
    out = {}
    for path in (workdir / "tensorboard").glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                out[(value.tag, event.step)] = value.simple_value
    return out


def test_records_go_to_jsonl_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=10)
    logger.write(2, {"loss": 3.5, "accuracy": 0.25, "note": "text", "bad": math.nan})
    logger.write(4, {"loss": 2.0}, prefix="validation")
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["split"], r["loss"]) for r in records] == [
        (2, "train", 3.5),
        (4, "validation", 2.0),
    ]
    assert records[0]["note"] == "text" and math.isnan(records[0]["bad"])
    scalars = _scalars(tmp_path)
    # Numbers only, and only finite ones, become scalars.
    assert scalars == {("train/loss", 2): 3.5, ("train/accuracy", 2): 0.25,
                       ("validation/loss", 4): 2.0}  # fmt: skip


def test_a_resumed_run_appends(tmp_path):
    for step in (1, 2):
        logger = MetricsLogger(tmp_path, total_steps=2)
        logger.write(step, {"loss": float(step)})
        logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]


def test_a_disabled_logger_writes_nothing(tmp_path):
    """Processes other than the first log nothing."""
    logger = MetricsLogger(tmp_path, total_steps=5, enabled=False)
    logger.write(1, {"loss": 1.0})
    logger.close()
    assert list(tmp_path.iterdir()) == []


def test_durations():
    assert _format_duration(59) == "0:59"
    assert _format_duration(61) == "1:01"
    assert _format_duration(3 * 3600 + 5) == "3:00:05"
    assert _format_duration(-4) == "0:00"


def test_throughput_counts_the_tokens_a_model_reads():
    """Target tokens for translation and language models; a classifier's input tokens,
    not its one label per row (labels of class 0 would not even count)."""
    import numpy as np

    from flaxformer_lite.training.loop import Throughput

    inputs = np.array([[5, 6, 7, 0], [8, 9, 0, 0]])
    labels = np.array([[3, 0, 0, 0], [0, 0, 0, 0]])  # classes 3 and 0
    meter = Throughput(1e9, task="classify")
    meter.add({"inputs": inputs, "targets": labels})
    assert meter.tokens == 5 and meter.steps == 1
    meter = Throughput(1e9)
    meter.add({"inputs": inputs, "targets": np.array([[4, 5, 1, 0], [6, 1, 0, 0]])})
    assert meter.tokens == 5
    assert meter.rates()["tokens_per_sec"] > 0


def test_the_progress_line_shows_the_efficiency():
    """TFLOP/s always; the MFU where the device's datasheet peak is known (an H100's
    989 TFLOP/s, not a CPU's); the memory where the device reports it."""
    from types import SimpleNamespace

    from flaxformer_lite.training import flops
    from flaxformer_lite.training.logging import _efficiency
    from flaxformer_lite.training.loop import Throughput

    h100 = SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")
    assert flops.peak_flops([h100, h100]) == 2 * 989e12
    assert flops.device_peak_flops(SimpleNamespace(device_kind="TPU v5 lite")) == 197e12
    assert flops.peak_flops([SimpleNamespace(device_kind="cpu")]) is None
    meter = Throughput(2e12, peak=4e12)
    meter.add({"targets": np.ones((2, 3), np.int32)})
    rates = meter.rates()
    assert rates["mfu"] == pytest.approx(rates["tflops_per_sec"] / 4)
    assert "mfu" not in Throughput(2e12).rates()
    assert _efficiency({"tflops_per_sec": 31.24}) == " 31.2 TFLOP/s"
    line = _efficiency(
        {"tflops_per_sec": 400.0, "mfu": 0.404, "memory_gib": 30.12, "peak_memory_gib": 33.0}
    )
    assert line == " 400 TFLOP/s 40% MFU 30.1/33.0 GiB"


# A fresh interpreter: the logger's writer, then torch itself where it is installed.
WITHOUT_TORCH = """
import sys
from flaxformer_lite.training.logging import summary_writer_class
writer = summary_writer_class()
print("torch" in sys.modules, writer.__name__)
import torch
"""


def test_the_writer_comes_without_pytorch():
    """tensorboardX's writer imports torch (4-5 s) to accept torch tensors; the logger
    takes it with torch hidden, and a later ``import torch`` still works."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: nothing to hide")
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "SummaryWriter"]
