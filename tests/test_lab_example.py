"""The worked example of docs/extending.md (examples/lab), through the command line at
:debug size: a lab folder outside the package registers a feed-forward block, a
score function and a sparse pattern; runs train with them; after the lab folder moves,
the runs translate, evaluate, average, draw their attention, and their export is
refused naming the extension; a resume whose extension changed is refused naming the
file; a sweep against a baseline over 2 seeds writes the significance column and the
figure. (The in-process forms are test_extensions.py and test_significance.py.)"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cases(tmp_path, name, cases):
    """Run ``flaxformer_lite.main`` command lines (tests/cli_cases.py: one process
    imports the modules, a fork per command) from ``tmp_path``."""
    spec, results = tmp_path / f"{name}.json", tmp_path / f"{name}_results.json"
    spec.write_text(json.dumps([{"args": a, "cwd": str(tmp_path)} for a in cases]))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-m", "tests.cli_cases", str(spec), str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(results.read_text())


@pytest.mark.slow  # ~5 minutes of command lines
def test_the_lab_example_from_training_to_the_sweep_report(fixture_data, tmp_path):
    data_dir = fixture_data[1]
    lab = shutil.copytree(ROOT / "examples" / "lab", tmp_path / "lab")
    small = ["--config.model.vocab_size=100", f"--config.data.data_dir={data_dir}"]
    sparse = ["--config.model.ffn=swiglu", "--config.model.attention_block_size=8",
              "--config.model.attention_pattern=lab_band:window=4,stride=8"]  # fmt: skip
    trained = _cases(tmp_path, "train", [
        [f"--config={lab}/config.py:debug", "--workdir=runs/variant", *small, *sparse],
        [f"--config={lab}/config.py:debug", "--workdir=runs/cosine", *small,
         "--config.model.score_fn=lab_cosine"],
    ])  # fmt: skip
    for result in trained:
        assert result["code"] == 0, result["stderr"][-3000:]
    kept = json.loads((tmp_path / "runs/variant/extensions/manifest.json").read_text())
    assert kept[0]["entry"] == str(lab / "my_ext.py")

    moved = tmp_path / "elsewhere"
    shutil.move(lab, moved)  # the runs read their own copies from now on, on the user's word
    w = "--workdir=runs/variant"
    after = _cases(tmp_path, "read", [
        ["translate", w, "Where is the station?"],
        ["translate", w, "--trust_extensions", "Where is the station?"],
        ["translate", w, "Where is the station?"],
        ["evaluate", w, "--limit=8"],
        ["average", w, "--num=2"],
        ["attention", w, "Where is it?"],
        ["translate", "--workdir=runs/cosine", "Good morning."],
        ["evaluate", "--workdir=runs/cosine", "--limit=8"],
        ["attention", "--workdir=runs/cosine", "Good morning."],
        ["export", "--workdir=runs/cosine"],
        ["export", w],
    ])  # fmt: skip
    stranger, after = after[0], after[1:]
    assert stranger["code"] == 1 and len(stranger["stderr"].strip().splitlines()) == 1
    assert "extensions/my_ext.py (SHA-256 " in stranger["stderr"]
    assert "registers feed-forward block 'swiglu'" in stranger["stderr"]
    assert "--trust_extensions" in stranger["stderr"]
    for result in after[:-2]:  # trusted once, remembered for this code
        assert result["code"] == 0, result["stderr"][-3000:]
    cosine = after[-2]  # the score function cannot be written for Marian either
    assert cosine["code"] == 1 and "model.score_fn='lab_cosine'" in cosine["stderr"]
    assert (tmp_path / "runs/variant/test_scores.json").is_file()
    assert (tmp_path / "runs/variant/attention/attention.html").is_file()
    refused = after[-1]
    assert refused["code"] == 1 and len(refused["stderr"].strip().splitlines()) == 1
    assert "model.ffn='swiglu'" in refused["stderr"]
    assert f"registered by the extension {lab / 'my_ext.py'}" in refused["stderr"]

    with open(moved / "my_ext.py", "a") as f:
        f.write("\n# tuned after the run started\n")
    sweep = ["sweep", f"--config={moved}/config.py:debug", "--workdir=runs/sweep", *small,
             "--sweep=model.ffn=standard,swiglu", "--seeds=2", "--parallel=2",
             "--baseline=model.ffn=standard", "--limit=8"]  # fmt: skip
    resumed, swept = _cases(tmp_path, "again", [
        [f"--config={moved}/config.py:debug", w, *small, *sparse,
         "--config.train.num_steps=8"],
        sweep,
    ])  # fmt: skip
    assert resumed["code"] == 1
    assert f"{moved / 'my_ext.py'} changed since --workdir=runs/variant" in resumed["stderr"]
    assert "restore the run's code" in resumed["stderr"]
    assert swept["code"] == 0, swept["stdout"][-2000:] + swept["stderr"][-2000:]
    report = (tmp_path / "runs/sweep/results.md").read_text()
    assert "## Against the baseline `ffn=standard`" in report
    assert "| ffn=swiglu |" in report.split("Against the baseline")[1]
    assert (tmp_path / "runs/sweep/results.png").read_bytes()[:4] == b"\x89PNG"
    for seed in (0, 1):  # each run kept the extension and was scored
        run = tmp_path / f"runs/sweep/ffn=swiglu/seed{seed}"
        assert (run / "extensions/my_ext.py").is_file() and (run / "test_scores.json").is_file()
