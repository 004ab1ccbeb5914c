"""train.profile=START:STEPS: the shared :debug run (tests/fixtures.py, with
``train.profile=2:2`` and ``model.remat=full``) wrote a profiler trace of its steps 2
and 3 under the workdir, that JAX's own reader opens and that names the train steps;
and a bad value is refused with the form to write."""

import pytest

from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.config.rules import profile_steps


def test_the_run_wrote_a_trace_of_its_train_steps(trained_run):
    import jax

    workdir, _ = trained_run
    traces = sorted((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert len(traces) == 1, traces
    names = set()
    for plane in jax.profiler.ProfileData.from_file(str(traces[0])).planes:
        for line in plane.lines:
            names.update(event.name for event in line.events)
    assert "train" in names  # the step annotations (TensorBoard's step view)
    assert any("train_step" in name for name in names), sorted(names)[:20]


def test_profile_values():
    assert profile_steps("") is None
    assert profile_steps("2:3") == (2, 3)
    for bad in ("2", "0:3", "2:0", "a:b", "2:3:4"):
        with pytest.raises(ConfigError, match="write START:STEPS"):
            profile_steps(bad)
