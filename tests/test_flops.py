"""Model FLOPs (training/flops.py) against a count of the matmuls the model really runs."""

import math

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.training import flops


def _dot_flops(jaxpr) -> float:
    """2 x multiply-adds of every dot_general in a jaxpr, sub-jaxprs included."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), (batch, _) = eqn.params["dimension_numbers"]
            lhs, rhs = (v.aval.shape for v in eqn.invars)
            out = eqn.outvars[0].aval.shape
            total += 2.0 * math.prod(out) * math.prod(lhs[d] for d in contract)
            del rhs, batch
        for param in eqn.params.values():
            for sub in param if isinstance(param, tuple | list) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    total += _dot_flops(inner)
    return total


CONFIG = ModelConfig(
    vocab_size=96,
    d_model=48,
    num_heads=4,
    d_ff=80,
    num_encoder_layers=2,
    num_decoder_layers=3,
    max_len=32,
    embedding_dropout=0.0,
    residual_dropout=0.0,
)


@pytest.mark.parametrize("d_k,d_v", [(None, None), (16, 8)])
def test_forward_flops_count_every_matmul(d_k, d_v):
    c = CONFIG.replace(d_k=d_k, d_v=d_v)
    model = Transformer(c)
    src, tgt = jnp.ones((3, 12), jnp.int32), jnp.ones((3, 10), jnp.int32)
    params = jax.eval_shape(lambda: unbox(model.init(jax.random.key(0), src, tgt)))["params"]
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, src, tgt))(params).jaxpr
    assert flops.forward_flops(c, 3, 12, 10) == pytest.approx(_dot_flops(jaxpr), rel=1e-9)
    assert flops.train_step_flops(c, 3, 12, 10) == 3 * flops.forward_flops(c, 3, 12, 10)


def test_lm_forward_flops_count_every_matmul():
    model = LanguageModel(CONFIG)
    tokens = jnp.ones((2, 16), jnp.int32)
    params = jax.eval_shape(lambda: unbox(model.init(jax.random.key(0), tokens)))["params"]
    jaxpr = jax.make_jaxpr(lambda p: model.apply({"params": p}, tokens))(params).jaxpr
    assert flops.lm_forward_flops(CONFIG, 2, 16) == pytest.approx(_dot_flops(jaxpr), rel=1e-9)
    assert flops.train_step_flops(CONFIG, 2, 16, 16, "lm") == 3 * flops.lm_forward_flops(
        CONFIG, 2, 16
    )


def test_matmul_peak_is_a_rate():
    peak = flops.matmul_peak_flops(n=256, repeats=3)
    assert math.isfinite(peak) and peak > 1e6  # FLOP/s of a 256 x 256 matmul
