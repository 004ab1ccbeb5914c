"""The accelerator commands (benchmarks/accelerator.py, accelerator_train.py) dry-run on
CPU with tiny sizes: the same code an H200 runs (cuDNN's rows through XLA), so that
device minutes go to measuring, not to import errors. The full dry runs are slow-tier;
the default run checks that the commands refuse what they cannot do."""

import json
import os
import subprocess
import sys

import pytest

from tests.fixtures import ROOT, xla_flags


def _run(args, timeout=600):
    env = dict(os.environ, XLA_FLAGS=xla_flags(None), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


def test_the_benchmark_says_what_it_needs(tmp_path):
    done = _run(["benchmarks/accelerator.py", "--out", str(tmp_path)])
    assert done.returncode != 0
    assert "no GPU here" in done.stderr and "--tiny" in done.stderr
    done = _run(["benchmarks/accelerator.py", "--out", str(tmp_path), "--tiny", "--only", "nope"])
    assert done.returncode != 0 and "--only nope: sections are env, train" in done.stderr
    assert not (tmp_path / "accelerator.json").exists()


@pytest.mark.slow
def test_the_benchmark_dry_runs_on_cpu(tmp_path):
    # --minutes 0: no section allowance. This run checks the code paths, and a row cut by the
    # budget checks nothing: the attention section takes ~2 minutes on an idle 2-core machine
    # and passed 8 on a busy CI one (two workers). One length: each kernel's code is the
    # same at 256 and 512 tokens (a dry run skips no length: xla dense stops above 512).
    args = ["--out", str(tmp_path), "--tiny", "--minutes", "0", "--lengths", "256"]
    done = _run(["benchmarks/accelerator.py", *args], timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "accelerator.json").read_text())
    rows = result["train"] + result["attention"] + result["decode"]
    # cuDNN and XLA dense on packed rows and on one example per row, and the peer
    assert len(result["train"]) == 5 and len(result["decode"]) == 4
    assert sum("one example per row" in r["run"] for r in result["train"]) == 2
    assert {r["kernel"] for r in result["attention"]} >= {"cudnn local (causal)", "blocked bigbird"}
    assert all(r["status"] == "ok" for r in rows), [r for r in rows if r["status"] != "ok"]
    assert "MFU (measured peak)" in (tmp_path / "accelerator.md").read_text()


@pytest.mark.slow
def test_the_training_run_dry_runs_on_cpu(tmp_path, fixture_data):
    _, data_dir = fixture_data
    out = tmp_path / "out"
    done = _run(
        [
            "benchmarks/accelerator_train.py", "--out", str(out), "--tiny", "--cudnn",
            "--workdir", str(tmp_path / "run"), "--set", f"data.data_dir={data_dir}",
            "--set", "model.vocab_size=100",  # what the fixture corpus supports
        ]
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((out / "train_run.json").read_text())["summary"]
    assert summary["steps"] == 6 and summary["median_target_tokens_per_s"] > 0
    assert "bleu" in summary["test"]
    assert "--config.model.attention_impl=cudnn" in (out / "train_logs.txt").read_text()
