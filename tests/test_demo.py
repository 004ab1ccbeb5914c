"""`make demo` (interim): the paper model's forward/backward pass runs end to end."""

import subprocess
import sys

import pytest

from flaxformer_lite import demo


def test_demo_runs_paper_base(capsys):
    demo.main(["--batch", "1", "--length", "4"])
    out = capsys.readouterr().out
    assert "63,082,496 parameters" in out
    assert "loss (ls=0.1)" in out and "gradient norm" in out


def test_demo_rejects_bad_arguments():
    with pytest.raises(SystemExit) as e:
        demo.main(["--batch", "0"])
    assert e.value.code == 2


def test_demo_module_entry_point():
    result = subprocess.run(
        [sys.executable, "-m", "flaxformer_lite.demo", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and "--preset" in result.stdout
