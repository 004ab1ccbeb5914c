"""A lexical shortcut to the softmax (Nguyen & Chiang, 2018, "Improving Lexical
Choice in Neural Machine Translation"), for ``ModelConfig.lexical_shortcut``.

Legend: b batch, s source length, t target length, m d_model.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.attention import attention_weights


class LexicalShortcut(nn.Module):
    """``W_out (sum_i a_i e(x_i))``: attention weights ``a`` from the decoder output
    over the encoder output, applied to the source token embeddings ``e(x_i)``
    (without positions). ``W_out`` starts at zero, so the model starts as without it;
    the decoder adds the result, after residual dropout, to its output before the logits.

    Decoding keeps the keys in the 'cache' collection, written on the step that
    brings the encoder output (like cross-attention); the source embeddings are
    looked up again each step (a gather of ``[b, s, m]``)."""

    config: ModelConfig

    @nn.compact
    def __call__(
        self,
        x: Array,
        encoded: Array | None,
        source_embedded: Array,
        mask: Array | None,
        *,
        decode: bool = False,
    ) -> Array:
        c = self.config

        def dense(name, init=None):
            return nn.Dense(
                c.d_model,
                use_bias=False,
                dtype=c.compute_dtype,
                param_dtype=c.parameter_dtype,
                kernel_init=P.param_init(init or nn.initializers.xavier_uniform(), P.EMBED, None),
                name=name,
            )

        project_key = dense("key")
        if decode and encoded is None:
            if not self.has_variable("cache", "lexical_key"):
                raise ValueError(
                    "lexical shortcut cache is empty: call the decoder once with the encoder "
                    "output before decoding with encoded=None"
                )
            key = self.variables["cache"]["lexical_key"]
        else:
            if encoded is None:
                raise ValueError("the lexical shortcut needs the encoder output")
            key = project_key(encoded)
            if decode:
                self.variable("cache", "lexical_key", lambda: key).value = key
        query = dense("query")(x)
        # One head: [b, t, m] x [b, s, m] -> [b, 1, t, s].
        weights = attention_weights(query[:, :, None, :], key[:, :, None, :], mask)
        context = jnp.einsum("bqk,bkm->bqm", weights[:, 0], source_embedded.astype(x.dtype))
        return dense("out", nn.initializers.zeros)(context)
