"""inference/run.py: a workdir read without training/: the parameter average found in any
optimizer layout, checkpoint kinds and steps, and the errors of a folder that is no run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config.experiment import OptimizerConfig
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.inference.run import Run
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.training.state import create_train_state, evaluation_params, make_optimizer
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir.folder import find_params_ema, write_config

MODEL = ModelConfig(
    vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
    num_decoder_layers=1, max_len=16,
)  # fmt: skip


@pytest.mark.parametrize(
    "options",
    [
        dict(ema_decay=0.9),
        dict(ema_decay=0.9, clip_grad_norm=1.0, embedding_lr_scale=0.5),
        dict(ema_decay=0.9, cooldown_fraction=0.3, weight_decay=0.01),
        dict(ema_decay=0.9, grad_accum_steps=2),  # optax.MultiSteps wraps the state
    ],
    ids=["plain", "clip+scale", "cooldown+adamw", "accumulation"],
)
def test_the_stored_average_is_found_in_every_optimizer_layout(options, tmp_path):
    """What inference reads from a checkpoint (no optimizer built) is what training
    evaluates with (``evaluation_params``)."""
    tx, _ = make_optimizer(OptimizerConfig(warmup_steps=2, **options), MODEL, 10)
    state = create_train_state(Transformer(MODEL), tx, 0, 8)
    # A moving average that differs from the parameters.
    shifted = jax.tree.map(lambda x: x + 0.5 if x.dtype == jnp.float32 else x, state.opt_state)
    state = state.replace(opt_state=shifted)
    checkpoints = ckpt_lib.Checkpoints(tmp_path)
    checkpoints.save(3, state)
    checkpoints.close()
    stored, step = ckpt_lib.restore_state_part(tmp_path, "opt_state")
    assert step == 3
    found = find_params_ema(stored)
    want = evaluation_params(state)
    assert jax.tree.structure(found) == jax.tree.structure(want)
    jax.tree.map(np.testing.assert_array_equal, found, want)
    differs = jax.tree.map(lambda a, b: bool(np.any(a != b)), found, state.params)
    assert all(jax.tree.leaves(differs))


def test_no_average_in_a_plain_adam_state(tmp_path):
    tx, _ = make_optimizer(OptimizerConfig(warmup_steps=2), MODEL, 10)
    state = create_train_state(Transformer(MODEL), tx, 0, 8)
    checkpoints = ckpt_lib.Checkpoints(tmp_path)
    checkpoints.save(1, state)
    checkpoints.close()
    assert find_params_ema(ckpt_lib.restore_state_part(tmp_path, "opt_state")[0]) is None
    with pytest.raises(ckpt_lib.CheckpointError, match="has no 'nothing'"):
        ckpt_lib.restore_state_part(tmp_path, "nothing")
    with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint of step 7 .* kept are 1"):
        ckpt_lib.restore_state_part(tmp_path, "params", step=7)


def test_a_folder_that_is_no_run(tmp_path):
    with pytest.raises(ckpt_lib.CheckpointError, match="is not a training run"):
        Run.open(tmp_path)
    (tmp_path / ckpt_lib.CONFIG_FILE).write_text('{"model": {"d_model": "wide"}}')
    with pytest.raises(ckpt_lib.CheckpointError, match="not a config this version can read"):
        Run.open(tmp_path)
    write_config(tmp_path, '{"model": {}, "data": {}}')
    run = Run.open(tmp_path)  # every other field at its default
    assert run.config.model == ModelConfig() and run.steps("best") == []
    with pytest.raises(ckpt_lib.CheckpointError, match="holds no checkpoint yet"):
        run.params()
    with pytest.raises(ckpt_lib.CheckpointError, match="tokenizer.model is missing"):
        run.tokenizer  # noqa: B018
    with pytest.raises(ckpt_lib.CheckpointError, match="checkpoint kind 'newest'"):
        run.params("newest")
