"""model.remat: every policy computes the same loss and gradients as the model that
keeps its activations (float64: to a few ulps; dropout on, so the recomputed dropout
masks must be the ones of the forward pass), with the same parameters, and keeps less
for the backward pass (the saved residuals, training/activations.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ModelConfig, Transformer
from flaxformer_lite.config.model import REMAT_POLICIES, ConfigError
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.training.activations import saved_bytes

CFG = ModelConfig(
    vocab_size=24, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1,
    num_decoder_layers=2, max_len=32, attention_dropout=0.1, ffn_dropout=0.1,
    dtype="float64", param_dtype="float64",
)  # fmt: skip
SRC = jnp.array([[5, 6, 7, 8, 1, 0, 0, 0], [9, 10, 11, 12, 13, 14, 1, 0]])
TGT = jnp.array([[20, 21, 22, 1, 0, 0], [3, 4, 5, 6, 7, 1]])


def _loss_and_grads(model, params, *args):
    def loss(p):
        out = model.apply(
            {"params": p}, *args, deterministic=False, rngs={"dropout": jax.random.key(7)}
        )
        return jnp.sum(jnp.tanh(out))

    return jax.jit(jax.value_and_grad(loss))(params)


# Each case compiles two float64 steps (~5-20 s): all in the slow tier; the default run
# keeps remat's cheap form in tests/test_scan_layers.py (the first steps' losses of a
# scanned model with remat=full equal the unrolled plain model's, float32).
CASES = [
    (arch, policy)
    for arch in ("translation", "sparse lm")
    for policy in REMAT_POLICIES
    if policy != "none"
]
DEFAULT: set = set()


@pytest.mark.parametrize(
    "arch,policy",
    [c if c in DEFAULT else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
)
def test_every_policy_gives_the_same_loss_and_gradients(arch, policy):
    # float64 end to end: the rematerialized pass recomputes the same operations, so
    # values agree to a few ulps (observed 0 to 1e-15; the bound 1e-12 relative).
    with jax.enable_x64(True):
        if arch == "translation":
            models = [Transformer(CFG), Transformer(CFG.replace(remat=policy))]
            args = (SRC, TGT)
        else:  # decoder-only, a sparse pattern through the blocked kernel
            sparse = CFG.replace(attention_pattern="local:window=3+global:first=1",
                                 attention_block_size=4, attention_dropout=0.0)  # fmt: skip
            models = [LanguageModel(sparse), LanguageModel(sparse.replace(remat=policy))]
            args = (jnp.concatenate([SRC, SRC], axis=1),)
        params = unbox(models[0].init(jax.random.key(0), *args))["params"]
        remat_params = unbox(models[1].init(jax.random.key(0), *args))["params"]
        assert jax.tree.structure(remat_params) == jax.tree.structure(params)
        (loss, grads), (remat_loss, remat_grads) = (
            _loss_and_grads(m, params, *args) for m in models
        )
        assert remat_loss.dtype == jnp.float64
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-12)
        for (path, g), r in zip(
            jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(remat_grads),
            strict=True,
        ):  # fmt: skip
            np.testing.assert_allclose(r, g, rtol=1e-12, atol=1e-14, err_msg=str(path))


def test_remat_keeps_less_for_the_backward_pass():
    """What a 1k-token, 8-layer LM saves for its backward pass (traced, nothing runs):
    everything without remat; each layer's input under full (the 8 inputs, the logits'
    and the loss's own); the matmul outputs in between under dots."""
    config = ModelConfig(vocab_size=64, d_model=64, num_heads=4, d_ff=256,
                         num_decoder_layers=8, max_len=1024)  # fmt: skip
    tokens = jnp.ones((1, 1024), jnp.int32)

    def saved(policy):
        model = LanguageModel(config.replace(remat=policy))
        params = jax.eval_shape(lambda: unbox(model.init(jax.random.key(0), tokens))["params"])

        def loss(p):
            out = model.apply({"params": p}, tokens, deterministic=False,
                              rngs={"dropout": jax.random.key(1)})  # fmt: skip
            return jnp.mean(out)

        return saved_bytes(loss, params)

    none, full, dots = saved("none"), saved("full"), saved("dots")
    layer_inputs = 8 * 1024 * 64 * 4
    assert layer_inputs <= full < 2 * layer_inputs  # + the embedding's and logits' own
    assert full < dots < none / 10, (none, dots, full)


def test_an_unknown_policy_is_named():
    with pytest.raises(ConfigError, match="model.remat='some'.*none, full, dots, dots_all"):
        CFG.replace(remat="some")
