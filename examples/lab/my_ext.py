"""A lab's own ideas, registered under new names: nothing in flaxformer_lite changes.

- ``model.ffn=swiglu``: a gated feed-forward block, silu(x W) * (x V) then W2
  (Shazeer 2020, "GLU Variants Improve Transformer"), its hidden width d_ff;
- ``model.score_fn=lab_cosine``: cosine similarity of queries and keys times a fixed
  temperature (a score without parameters);
- ``model.attention_pattern=lab_band:window=W,stride=S``: a band of half-width W plus
  every S-th key (a pattern of the spec grammar, so sweeps, diagnostics and every
  kernel take it).

Named in a config's ``model.extensions`` (see ``config.py`` beside it), this file is
imported by every command that reads the config or the run, and the run folder keeps
a copy of it. Importing it runs its code: keep it to definitions.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.attention import dot_scores, register_score_fn
from flaxformer_lite.model.dropout import Dropout
from flaxformer_lite.model.registry import register_ffn
from flaxformer_lite.sparse.grammar import patterns
from flaxformer_lite.sparse.grammar.spec import register_pattern


class GatedFeedForward(nn.Module):
    """``[b, l, d_model] -> [b, l, d_model]``: silu(x W) * (x V), dropout, then W2."""

    config: object  # the run's ModelConfig

    @nn.compact
    def __call__(self, x, *, deterministic: bool = True):
        c = self.config

        def dense(features, name, axes):  # parameters with logical axes: shardable
            return nn.Dense(
                features,
                dtype=c.compute_dtype,
                param_dtype=c.parameter_dtype,
                kernel_init=P.param_init(nn.initializers.xavier_uniform(), *axes),
                bias_init=P.param_init(nn.initializers.zeros_init(), axes[1]),
                name=name,
            )

        gate = jax.nn.silu(dense(c.d_ff, "wi", (P.EMBED, P.MLP))(x))
        h = gate * dense(c.d_ff, "wi_gate", (P.EMBED, P.MLP))(x)
        h = Dropout(c.ffn_dropout, c.dropout_bits)(h, deterministic=deterministic)
        return dense(c.d_model, "wo", (P.MLP, P.EMBED))(h)


@register_ffn("swiglu")
def _swiglu(config, name):
    return GatedFeedForward(config, name=name)


@register_score_fn("lab_cosine")
def _cosine(*, num_heads, head_dim, dtype, param_dtype, module_name):
    def unit(x):
        return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-6)

    return lambda q, k: 10.0 * dot_scores(unit(q), unit(k))


@register_pattern("lab_band", {"window": 8, "stride": 16})
def _band(args, block_size, seed):
    return patterns.Local(args["window"]) | patterns.Strided(args["stride"])
