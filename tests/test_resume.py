"""The training loop's checkpoints: exact resume, averaging, budgets, the best and EMA
checkpoints, and the stops (NaN, another model's workdir, an unwritable one)."""

import json

import jax
import numpy as np
import pytest

from flaxformer_lite.config import experiment
from flaxformer_lite.inference.average import average_params, average_workdir, validation_nll
from flaxformer_lite.inference.run import Run
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.model.build import build_model
from flaxformer_lite.training import schedules
from flaxformer_lite.training.state import (
    abstract_train_state,
    create_train_state,
    evaluation_params,
    make_optimizer,
)
from flaxformer_lite.training.train import (
    TrainingError,
    train_and_evaluate,
)
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from tests.fixtures import debug_config

pytestmark = pytest.mark.usefixtures("one_device")  # none of these is about devices


def _last_params(workdir, config):
    target = abstract_train_state(config).params
    params, step = ckpt_lib.restore_params(workdir, target, kind="last")
    return params, step


def test_resume_is_exact(fixture_data, tmp_path, capsys):
    _, data_dir = fixture_data
    # No validation BLEU: its greedy decode is not part of what resumes (test_cli's runs
    # cover it) and costs each of the three runs a compilation.
    kw = dict(checkpoint_every=3, eval_bleu_sentences=0)
    straight = tmp_path / "straight"
    # The straight run also writes final checkpoints (the cadence leaves only step 6 in
    # the last quarter, 4.5-6; the marks 4.875 and 5.25 both fall to step 5) and says
    # what the recorded curve gives at its 6 steps: saves and words change no parameter.
    config = debug_config(data_dir, num_steps=6, final_checkpoints=4, **kw)
    config.train.expected_bleu = "4:1.0,8:3.0"
    train_and_evaluate(config, straight)
    assert ckpt_lib.steps(straight) == [3, 5, 6]
    said = capsys.readouterr().out
    said = " ".join(said.split())
    assert "6 steps; by its record (train.expected_bleu) this recipe gives test BLEU " in said
    assert "gives test BLEU ~2.0 at 6 steps (3.0 at 8)" in said
    # `average` takes the late window only (from step 5), and says what it left out.
    assert average_workdir(straight, 4, validate=False) == (6, [5, 6])
    said = capsys.readouterr().out
    assert "--num=4: the last 25% of the run's 6 steps (from step 5) holds 2" in said
    assert "left out steps 3: before the last 25%" in said
    # With validation (the default) it keeps the mean or step 6 alone, whichever has the
    # lower validation nll; step 6's is the one the run logged at its end (the same
    # float32 forward, summed in another order: 1e-5 is ~100x that rounding).
    run = Run.open(straight)
    mean_nll, last_nll = validation_nll(
        run, [average_params(run, [5, 6]), average_params(run, [6])]
    )  # fmt: skip
    logged = [r for r in map(json.loads, open(straight / "metrics.jsonl")) if "nll" in r]
    assert last_nll == pytest.approx(logged[-1]["nll"], rel=1e-5)
    assert average_workdir(straight, 4)[1] == ([6] if last_nll < mean_nll else [5, 6])
    assert f"validation nll {mean_nll:.4f} for the mean of steps 5, 6" in capsys.readouterr().out
    split = tmp_path / "split"
    train_and_evaluate(debug_config(data_dir, num_steps=3, **kw), split)
    metrics = train_and_evaluate(debug_config(data_dir, num_steps=6, **kw), split)
    assert {"loss", "nll", "perplexity", "accuracy"} <= set(metrics)
    a, step_a = _last_params(straight, debug_config(data_dir))
    b, step_b = _last_params(split, debug_config(data_dir))
    assert step_a == step_b == 6
    jax.tree.map(np.testing.assert_array_equal, a, b)
    # Averaging the last two checkpoints (3 and 6: --window=1 reaches back to any), of
    # the moving average the run evaluated with (the default config keeps one).
    average_workdir(split, 2, window=1.0, validate=False)
    avg, _ = ckpt_lib.restore_params(split, a, kind="averaged")
    target = abstract_train_state(debug_config(data_dir))
    state3, _ = ckpt_lib.Checkpoints(split).restore(target, 3)
    state6, _ = ckpt_lib.Checkpoints(split).restore(target, 6)
    assert debug_config(data_dir).optimizer.ema_decay > 0
    mean = jax.tree.map(
        lambda x, y: (np.asarray(x) + np.asarray(y)) / 2,
        evaluation_params(state6),
        evaluation_params(state3),
    )
    jax.tree.map(
        lambda m, want: np.testing.assert_allclose(np.asarray(m), want, rtol=1e-6), avg, mean
    )
    # Averaging again with another count replaces the average (same last step).
    average_workdir(split, 1, window=1.0)
    again, _ = ckpt_lib.restore_params(split, a, kind="averaged")
    jax.tree.map(
        lambda m, want: np.testing.assert_allclose(np.asarray(m), np.asarray(want), rtol=1e-6),
        again,
        evaluation_params(state6),
    )


def _validation_steps(workdir) -> list[int]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r["split"] == "validation"]


@pytest.mark.slow
def test_time_budget_stops_early_with_a_checkpoint_and_resumes(fixture_data, tmp_path):
    _, data_dir = fixture_data
    # A budget that has run out before the first step: one step is taken, then the run
    # stops there, evaluated and checkpointed as if that step were the last.
    config = debug_config(data_dir, num_steps=6, checkpoint_every=4, eval_every=4)
    config.train.max_minutes = 1e-6
    metrics = train_and_evaluate(config, tmp_path)
    assert {"loss", "accuracy"} <= set(metrics)
    assert (metrics["step"], metrics["trained_steps"], metrics["budget_reached"]) == (1, 1, 1.0)
    assert _validation_steps(tmp_path) == [1]
    _, step = _last_params(tmp_path, config)
    assert step == 1
    # The budget is the run's, over resumes: running the same command again trains nothing.
    again = train_and_evaluate(config, tmp_path)
    assert (again["step"], again["trained_steps"], again["budget_reached"]) == (1, 0, 1.0)
    assert again["loss"] == pytest.approx(metrics["loss"], rel=1e-6)  # the same checkpoint
    _, step = _last_params(tmp_path, config)
    assert step == 1
    # Without the budget the same workdir resumes there and trains to num_steps.
    config.train.max_minutes = 0.0
    done = train_and_evaluate(config, tmp_path)
    assert (done["step"], done["trained_steps"], done["budget_reached"]) == (6, 5, 0.0)
    assert _validation_steps(tmp_path) == [1, 4, 6]
    _, step = _last_params(tmp_path, config)
    assert step == 6


def _logged_rates(workdir) -> dict[int, float]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return {r["step"]: r["learning_rate"] for r in records if r["split"] == "train"}


@pytest.mark.slow
def test_cooldown_fraction_ramps_the_rate_to_zero_by_steps_and_by_the_clock(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=6, log_every=1, eval_every=6, checkpoint_every=6)
    config.optimizer.cooldown_fraction = 0.5
    config.train.embedding_init = "random"  # the initial parameters are create_train_state's
    train_and_evaluate(config, tmp_path / "steps")
    noam = schedules.noam(config.model.d_model, config.optimizer.warmup_steps)
    rates = _logged_rates(tmp_path / "steps")
    for step, factor in ((1, 1.0), (4, 1.0), (5, 2 / 3), (6, 1 / 3)):
        assert rates[step] == pytest.approx(float(noam(step - 1)) * factor, rel=1e-6), step
    # A budget spent before the first step: the one step taken has a factor of 0, so
    # it leaves the initial parameters as they were.
    config.train.max_minutes = 1e-6
    train_and_evaluate(config, tmp_path / "clock")
    assert _logged_rates(tmp_path / "clock") == {1: 0.0}
    params, step = _last_params(tmp_path / "clock", config)
    assert step == 1
    model = build_model(experiment.validate_experiment(config))
    init = create_train_state(model, make_optimizer(config.optimizer, model.config, 6)[0], 0, 32)
    jax.tree.map(np.testing.assert_array_equal, params, init.params)


@pytest.mark.slow
def test_ema_run_evaluates_and_keeps_the_average(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=4, eval_every=4, checkpoint_every=4)
    config.optimizer.ema_decay = 0.5
    train_and_evaluate(config, tmp_path)
    state, _ = ckpt_lib.Checkpoints(tmp_path).restore(abstract_train_state(config), 4)
    ema = evaluation_params(state)
    best, step = ckpt_lib.restore_params(tmp_path, state.params, kind="best")
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, best, ema)
    differs = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), ema, state.params
    )
    assert any(jax.tree.leaves(differs))  # the average is not the last parameters
    # The last checkpoint translates, and averages, with the moving average too.
    last = Translator.from_workdir(tmp_path, kind="last")
    assert last.checkpoint == "last checkpoint, step 4"
    jax.tree.map(np.testing.assert_array_equal, last.params, ema)
    average_workdir(tmp_path, 1)
    averaged, _ = ckpt_lib.restore_params(tmp_path, state.params, kind="averaged")
    jax.tree.map(np.testing.assert_array_equal, averaged, ema)


def test_other_models_workdir_is_refused(fixture_data, tmp_path):
    _, data_dir = fixture_data
    train_and_evaluate(debug_config(data_dir, num_steps=2), tmp_path)
    other = debug_config(data_dir, num_steps=2)
    other.model.d_ff = 128
    with pytest.raises(TrainingError, match=r"different model \(model.d_ff: 64 -> 128\)"):
        train_and_evaluate(other, tmp_path)


def test_nan_loss_stops_with_the_step_and_keeps_the_checkpoint(fixture_data, tmp_path):
    _, data_dir = fixture_data
    config = debug_config(data_dir, num_steps=40, checkpoint_every=2, log_every=2, eval_every=40)
    config.optimizer.schedule = "constant"
    config.optimizer.warmup_steps = 0
    config.optimizer.clip_grad_norm = 0.0
    config.optimizer.learning_rate = 1e30
    with pytest.raises(TrainingError, match=r"the loss is (nan|inf) .* at step \d+") as e:
        train_and_evaluate(config, tmp_path)
    assert "last good checkpoint is" in str(e.value)


def test_unwritable_workdir(fixture_data, tmp_path):
    _, data_dir = fixture_data
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(TrainingError, match="cannot write to --workdir"):
        train_and_evaluate(debug_config(data_dir), blocker / "run")


@pytest.mark.slow
def test_resume_is_exact_over_epochs(fixture_data, tmp_path):
    """The full form of test_resume_is_exact: 30 steps (several epochs of the fixture
    pairs, with the resampled phrase pool) straight, or stopped and resumed at 10 and 20,
    give the same validation losses and the same parameters."""
    _, data_dir = fixture_data

    def config(steps):
        c = debug_config(data_dir, num_steps=steps, checkpoint_every=10, eval_every=10)
        c.data.train_splits = "train,train_phrases:20"
        c.data.resample_subsets = True
        return c

    straight = train_and_evaluate(config(30), tmp_path / "straight")
    for steps in (10, 20, 30):
        pieces = train_and_evaluate(config(steps), tmp_path / "pieces")
        assert pieces["trained_steps"] == 10
    assert pieces["loss"] == straight["loss"]
    a, _ = _last_params(tmp_path / "straight", config(30))
    b, _ = _last_params(tmp_path / "pieces", config(30))
    jax.tree.map(np.testing.assert_array_equal, a, b)
