"""train.profile=START:STEPS: the shared :debug run (tests/fixtures.py, with
``train.profile=2:2`` and ``model.remat=full``) wrote a profiler trace of its steps 2
and 3 under the workdir, that JAX's own reader opens and that names the train steps;
and a bad value is refused with the form to write."""

import pytest

from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.config.profile import profile_steps


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


# ~15 s each, in the slow tier: the default run keeps the trace test above and the
# float32 scan+remat test of tests/test_scan_layers.py.
@pytest.mark.slow
@pytest.mark.parametrize("resume", [False, True])
def test_a_scanned_rematerialized_profiled_run(fixture_data, tmp_path, monkeypatch, resume):
    """:debug with model.scan_layers, remat=full and train.profile=2:2 trains and
    writes its trace; (slow tier) the same run resumed with scan_layers=False reads the
    scanned checkpoint (parameters and Adam's moments converted) and trains on."""
    import json

    from flaxformer_lite.training.train import train_and_evaluate
    from tests.fixtures import debug_config, train_on_one_device

    train_on_one_device(monkeypatch)
    workdir = tmp_path / "run"
    config = debug_config(fixture_data[1], num_steps=3, eval_every=3, checkpoint_every=3)
    config.model.scan_layers, config.model.remat, config.train.profile = True, "full", "2:2"
    config.train.eval_bleu_sentences = 0
    first = train_and_evaluate(config, workdir)
    assert first["step"] == 3
    assert list((workdir / "profile").glob("plugins/profile/*/*.xplane.pb"))
    if not resume:
        return
    config.model.scan_layers, config.train.num_steps, config.train.profile = False, 5, ""
    second = train_and_evaluate(config, workdir)
    assert second["step"] == 5 and second["trained_steps"] == 2
    steps = [json.loads(line)["step"] for line in open(workdir / "metrics.jsonl")]
    assert max(steps) == 5
