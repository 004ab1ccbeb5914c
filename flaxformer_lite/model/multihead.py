"""Multi-head attention: projections W_i^Q, W_i^K, W_i^V, W^O and a KV cache.

Legend: b batch, q/k lengths, h heads, d head dim, m d_model, t cache length.

Parameters (``d_k = d_v = d_model / h`` unless set in the config):
  query/kernel ``[m, h, d_k]``, key/kernel ``[m, h, d_k]``,
  value/kernel ``[m, h, d_v]``, out/kernel ``[h, d_v, m]`` (+ biases if ``use_bias``).

Decoding (``decode=True``), in the 'cache' collection:
  * self-attention keeps ``cached_key``/``cached_value`` ``[b, h, t, d]`` (head-major:
    the order the attention products read, so a step copies no cache) and
    ``cache_index``; each call writes its keys at the index and attends
    causally over the cache. The cache length ``t`` is the length of the
    inputs of the ``init`` call that created it.
  * cross-attention stores the projected encoder keys/values the first time it
    is called with ``inputs_kv``; later calls pass ``inputs_kv=None`` and reuse
    them, so the encoder output is projected once per sentence, not per step.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
from jax import Array, lax

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.model import head_groups as sparse
from flaxformer_lite.model import kernels
from flaxformer_lite.model import partitioning as P
from flaxformer_lite.model.attention import (
    attention_weights,
    dropout_weights,
    make_score_fn,
)
from flaxformer_lite.model.chunked import chunked_attention
from flaxformer_lite.model.dropout import make_rng
from flaxformer_lite.model.embedding import default_positions, rotate
from flaxformer_lite.model.masks import SegmentIds, combine_masks, make_causal_mask
from flaxformer_lite.sparse.grammar import spec
from flaxformer_lite.sparse.grammar.dynamic import NSA


def projection_init() -> nn.initializers.Initializer:
    """Glorot-uniform over (fan_in, fan_out) of the flattened kernel."""
    return nn.initializers.xavier_uniform()


class MultiHeadAttention(nn.Module):
    """Multi-head attention as in Section 3.2.2 of the paper.

    Attributes:
      config: the model config (sizes, score function, dropout, dtypes).
      self_attention: True for self-attention (keys/values from ``inputs_q``);
        False for cross-attention (keys/values from ``inputs_kv``).
    """

    config: ModelConfig
    self_attention: bool = True
    layer: int = 0  # index in its stack: selects the layer's sparse pattern
    causal: bool = False  # decoder self-attention: sparse patterns take their causal variant

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None = None,
        mask: Array | SegmentIds | None = None,
        *,
        deterministic: bool = True,
        decode: bool = False,
        positions: Array | None = None,
    ) -> Array:
        """Attend from ``inputs_q [b, q, m]`` to ``inputs_kv [b, k, m]``.

        Args:
          inputs_q: queries' inputs.
          inputs_kv: keys'/values' inputs for cross-attention; ignored for
            self-attention; ``None`` in cross-attention decode mode = use the cache.
          mask: boolean ``[b or 1, 1, q, k]`` (in self-attention decode mode,
            ``k`` is the cache length; the causal cache mask is added here), or
            :class:`SegmentIds` for sparse self-attention (``config.attention_pattern``).
          deterministic: disable dropout.
          decode: use and update the 'cache' collection.
          positions: ``[b, q]`` positions of the queries (self-attention with
            ``positional=rotary``: queries and keys are turned by them before the kernel,
            so the cache holds turned keys); default 0..q-1 (needed when decoding).
        Returns:
          ``[b, q, m]``.
        """
        c = self.config
        h, dk, dv = c.num_heads, c.head_dim_qk, c.head_dim_v

        def dense(features, axis, name):
            # Q/K/V [m, h, d] split their heads (column-parallel), W^O [h, d, m] too
            # (row-parallel): partitioning.RULES maps the names to the mesh.
            if name == "out":
                kernel_axes, bias_axes = (P.HEADS, P.HEAD_DIM, P.EMBED), (P.EMBED,)
            else:
                kernel_axes, bias_axes = (P.EMBED, P.HEADS, P.HEAD_DIM), (P.HEADS, P.HEAD_DIM)
            return nn.DenseGeneral(
                features=features,
                axis=axis,
                use_bias=c.use_bias,
                dtype=c.compute_dtype,
                param_dtype=c.parameter_dtype,
                kernel_init=P.param_init(projection_init(), *kernel_axes),
                bias_init=P.param_init(nn.initializers.zeros_init(), *bias_axes),
                name=name,
            )

        def heads(x):
            return P.constrain(x, P.BATCH, P.LENGTH, P.ACT_HEADS, None)

        project_query = lambda x: heads(dense((h, dk), -1, "query")(x))
        project_key = lambda x: heads(dense((h, dk), -1, "key")(x))
        project_value = lambda x: heads(dense((h, dv), -1, "value")(x))
        score = make_score_fn(
            c.score_fn,
            num_heads=h,
            head_dim=dk,
            dtype=c.compute_dtype,
            param_dtype=c.parameter_dtype,
            module_name="score",
        )

        patterns = self._patterns()
        query = project_query(inputs_q)
        stepping = False  # a cached decoding step (not the call that creates the cache)
        if self.self_attention:
            key, value = project_key(inputs_q), project_value(inputs_q)
            if c.positional == "rotary":
                if positions is None and decode:
                    raise ValueError("rotary positions: pass the decoding step's positions")
                if positions is None:
                    positions = default_positions(*inputs_q.shape[:2])
                query, key = rotate(query, positions), rotate(key, positions)
            if decode:
                mask = self._dense(mask)
                stepping = self.has_variable("cache", "cached_key")
                key, value, mask = self._self_attention_cache(key, value, mask, patterns, query)
        else:
            key, value = self._cross_attention_kv(inputs_kv, decode, project_key, project_value)
        x = self._attend(
            query, key, value, mask, patterns, score, deterministic=deterministic, decode=decode
        )
        if decode and stepping and patterns and any(isinstance(p, NSA) for p in patterns):
            x = self._nsa_step(x, patterns, query, key, value)
        return dense(c.d_model, (-2, -1), "out")(x)

    def _patterns(self):
        """This layer's head groups' patterns (sparse self-attention), else None."""
        c = self.config
        if not (self.self_attention and c.sparse_attention):
            return None
        return spec.layer_patterns(
            c.attention_pattern, self.layer, c.num_heads, block_size=c.attention_block_size,
            seed=c.attention_seed, causal=self.causal,
        )  # fmt: skip

    def _nsa_step(self, x, patterns, query, key, value) -> Array:
        """A cached step's output with NSA's head groups computed over the cache (its
        gated branches), the other groups' kept."""
        steps = query.shape[1]  # the step's positions: the cache index before it
        q_pos = self.get_variable("cache", "cache_index") - steps + jnp.arange(steps)
        return sparse.nsa_decode_groups(
            x, patterns, query, _head_major(key), _head_major(value), q_pos,
            self._nsa_params(patterns), scale=1.0 if self.config.score_fn == "dot" else None,
        )  # fmt: skip

    def _dense(self, mask: Array | SegmentIds | None) -> Array | None:
        """A token-form mask as the ``[b, 1, q, k]`` array (with causality where the layer
        is causal), for the kernels that read one."""
        if not isinstance(mask, SegmentIds):
            return mask
        causal = make_causal_mask(mask.ids.shape[1]) if self.causal else None
        return combine_masks(mask.dense(), causal)

    def _attend(
        self, query, key, value, mask, patterns, score, *, deterministic: bool, decode: bool
    ) -> Array:
        """``[b, q, h, d] -> [b, q, h, v]``: the one place a kernel is chosen.

        Sparse self-attention: the head groups' patterns (``sparse.py``, by
        ``attention_impl``). Dense, outside cached decoding and weight sowing:
        ``chunked`` and ``cudnn`` read the mask in token form; everything else (and
        cached decoding) the plain kernel, which forms the weights ``[b, h, q, k]``.
        """
        c = self.config
        scale = 1.0 if c.score_fn == "dot" else None
        tokens = mask if isinstance(mask, SegmentIds) else None
        if patterns is not None and not decode:
            if mask is not None and tokens is None:
                raise ValueError(
                    "sparse self-attention takes its mask as SegmentIds (token ids), "
                    "not a dense [b, 1, q, k] array"
                )
            segments = None if tokens is None else tokens.ids
            nsa = self._nsa_params(patterns)
            x = sparse.multihead_sparse_attention(
                query, key, value, patterns, impl=c.attention_impl,
                block_size=c.attention_block_size, segments=segments,
                packed=tokens is not None and tokens.packed, scale=scale,
                scan_blocks=c.attention_scan_blocks or None, nsa_params=nsa,
            )  # fmt: skip
            if c.sow_attention_weights:  # for pictures: the n x n array, made only here
                scores, allowed = sparse.dense_scores(
                    query,
                    key,
                    patterns,
                    segments=segments,
                    scale=scale,
                    nsa_params=nsa,
                    packed=tokens is not None and tokens.packed,
                )
                weights = attention_weights(query, key, allowed, score_fn=lambda q, k: scores)
                self._sow(weights, scores, allowed)
            return x
        fused = not decode and not c.sow_attention_weights
        if fused and c.attention_impl in ("chunked", "cudnn"):
            if mask is not None and tokens is None:
                raise ValueError(
                    f"attention_impl={c.attention_impl} takes its mask as SegmentIds (token "
                    "ids), not a dense [b, 1, q, k] array"
                )
            q_ids = None if tokens is None else tokens.ids
            kv_ids = None if tokens is None else tokens.keys
            if c.attention_impl == "chunked":
                return chunked_attention(
                    query, key, value, q_segments=q_ids, k_segments=kv_ids,
                    causal=self.causal, scale=scale, chunk=c.attention_chunk,
                )  # fmt: skip
            return kernels.cudnn_attention(
                query, key, value, causal=self.causal, q_segments=q_ids, kv_segments=kv_ids,
                packed=tokens is not None and tokens.packed, scale=scale,
            )  # fmt: skip
        mask = self._dense(mask)
        weights = attention_weights(query, key, mask, score_fn=score)
        if c.sow_attention_weights:
            self._sow(weights, score(query, key), mask)
        if not deterministic and c.attention_dropout > 0.0:
            weights = dropout_weights(weights, c.attention_dropout, make_rng(self), c.dropout_bits)
        return jnp.einsum("bhqk,bkhv->bqhv", weights, value)

    def _nsa_params(self, patterns) -> dict[int, dict]:
        """Each ``nsa`` head group's learned parts (sparse/ops/nsa/xla.py): the compressed
        branch's per-head key and value projections (identity at start) and the three
        gates' weights and biases (zero: each branch weighs 1/2 at start)."""
        c = self.config
        per, out = c.num_heads // len(patterns), {}
        eye = lambda key, shape, dtype: jnp.broadcast_to(jnp.eye(shape[-1], dtype=dtype), shape)
        zeros = nn.initializers.zeros_init()
        for g, pattern in enumerate(patterns):
            if isinstance(pattern, NSA):
                shapes = {
                    "compress_k": ((per, c.head_dim_qk, c.head_dim_qk), eye),
                    "compress_v": ((per, c.head_dim_v, c.head_dim_v), eye),
                    "gate_w": ((per, c.head_dim_qk, 3), zeros),
                    "gate_b": ((per, 3), zeros),
                }
                out[g] = {
                    name: self.param(
                        f"nsa{g}_{name}",
                        P.param_init(init, P.HEADS, *(None,) * (len(shape) - 1)),
                        shape, c.parameter_dtype,
                    )
                    for name, (shape, init) in shapes.items()
                }  # fmt: skip
        return out

    def _sow(self, weights: Array, scores: Array, mask: Array | None) -> None:
        """For pictures and diagnostics: the weights ``[b, h, q, k]`` and each query's
        largest allowed logit ``[b, h, q]`` (the pre-softmax score)."""
        self.sow("intermediates", "attention_weights", weights)
        if mask is not None:
            scores = jnp.where(mask, scores, -jnp.inf)
        self.sow("intermediates", "attention_max_logit", jnp.max(scores, axis=-1))

    def _self_attention_cache(
        self, key: Array, value: Array, mask: Array | None, patterns=None, query=None
    ) -> tuple[Array, Array, Array | None]:
        window = None if patterns is None else spec.sliding_window(patterns)
        if window is not None and self.causal:
            return self._sliding_window_cache(key, value, mask, patterns, window)
        creating = not self.has_variable("cache", "cached_key")
        # Stored head-major, [b, h, t, d]: the layout the score and value products
        # read, so a step does not transpose the whole cache (it did: storing it
        # head-major made a cached greedy step 1.5x faster at batch 32 on CPU).
        cached_key = self.variable(
            "cache", "cached_key", jnp.zeros, _head_major(key).shape, key.dtype
        )
        cached_value = self.variable(
            "cache", "cached_value", jnp.zeros, _head_major(value).shape, value.dtype
        )
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if creating:
            # The init call only shapes the cache; attention runs as given.
            return key, value, mask
        steps = key.shape[1]
        cache_len = cached_key.value.shape[2]
        i = index.value
        if i.ndim:  # a position per row (continuous batching)
            return self._per_row_cache(key, value, mask, patterns, cached_key, cached_value, index)
        # _in_dim: the other indices take i's integer type (int32 under x64 too).
        cached_key.value = lax.dynamic_update_slice_in_dim(
            cached_key.value, _head_major(key), i, axis=2
        )
        cached_value.value = lax.dynamic_update_slice_in_dim(
            cached_value.value, _head_major(value), i, axis=2
        )
        index.value = i + steps
        q_pos = i + jnp.arange(steps)
        k_pos = jnp.arange(cache_len)
        cache_mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
        if patterns is not None:
            cache_mask = cache_mask & self._pattern_mask(
                patterns, q_pos, k_pos, cache_len, query, cached_key.value
            )
        return (
            _head_major(cached_key.value),
            _head_major(cached_value.value),
            combine_masks(mask, cache_mask),
        )

    def _per_row_cache(self, key, value, mask, patterns, cached_key, cached_value, index):
        """One step with each row at its own position ``index [b]`` (a row whose
        sentence ended takes the next one from position 0: its older entries lie beyond
        its position, masked, and are overwritten as it goes)."""
        if patterns is not None or key.shape[1] != 1:
            raise ValueError("a position per row: dense self-attention, one step at a time")
        i = index.value
        rows = jnp.arange(i.shape[0])
        cached_key.value = cached_key.value.at[rows, :, i].set(key[:, 0])
        cached_value.value = cached_value.value.at[rows, :, i].set(value[:, 0])
        index.value = i + 1
        k_pos = jnp.arange(cached_key.value.shape[2])
        cache_mask = (k_pos[None, :] <= i[:, None])[:, None, None, :]
        return (
            _head_major(cached_key.value),
            _head_major(cached_value.value),
            combine_masks(mask, cache_mask),
        )

    def _pattern_mask(self, patterns, q_pos, k_pos, length, query=None, keys=None) -> Array:
        """``[b or 1, h, q, k]``: each head group's pattern at these positions (dynamic
        ones route their ``query`` over the cached ``keys`` ``[b, h, L, d]``)."""
        scale = 1.0 if self.config.score_fn == "dot" else None
        return sparse.decode_mask(
            patterns, self.config.num_heads, q_pos, k_pos, length, query, keys, scale
        )

    def _sliding_window_cache(
        self, key: Array, value: Array, mask: Array | None, patterns, window: int
    ) -> tuple[Array, Array, Array | None]:
        """A ring buffer of the last ``window + 1`` keys/values (causal local patterns).

        Memory is O(window), not O(length): slot ``i % size`` holds position
        ``i``; ``cached_positions`` remembers which position each slot holds, as
        position + 1 so that 0 means empty: every cache leaf starts at zero, which
        is how ``decoding`` builds caches (from shapes alone).
        """
        creating = not self.has_variable("cache", "cached_key")
        b, t, h = key.shape[:3]
        size = min(t, window + 1)
        cached_key = self.variable(
            "cache", "cached_key", jnp.zeros, (b, size, h, key.shape[-1]), key.dtype
        )
        cached_value = self.variable(
            "cache", "cached_value", jnp.zeros, (b, size, h, value.shape[-1]), value.dtype
        )
        positions = self.variable("cache", "cached_positions", jnp.zeros, (size,), jnp.int32)
        index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if creating:
            return key, value, mask
        if key.shape[1] != 1:
            raise ValueError(
                f"the sliding-window cache takes one token per decoding step, got {key.shape[1]}"
            )
        i = index.value
        slot = i % cached_key.value.shape[1]
        cached_key.value = lax.dynamic_update_slice_in_dim(cached_key.value, key, slot, axis=1)
        cached_value.value = lax.dynamic_update_slice_in_dim(
            cached_value.value, value, slot, axis=1
        )
        positions.value = positions.value.at[slot].set(i + 1)
        index.value = i + 1
        q_pos = i + jnp.arange(1)
        k_pos = positions.value - 1  # -1: an empty slot
        cache_mask = ((k_pos >= 0) & (k_pos[None, :] <= q_pos[:, None]))[None, None]
        cache_mask = cache_mask & self._pattern_mask(patterns, q_pos, k_pos, i + 1)
        return cached_key.value, cached_value.value, combine_masks(mask, cache_mask)

    def _cross_attention_kv(
        self, inputs_kv: Array | None, decode: bool, project_key, project_value
    ) -> tuple[Array, Array]:
        if not decode:
            if inputs_kv is None:
                raise ValueError("cross-attention needs inputs_kv (the encoder output)")
            return project_key(inputs_kv), project_value(inputs_kv)
        if inputs_kv is None:
            if not self.has_variable("cache", "cross_key"):
                raise ValueError(
                    "cross-attention cache is empty: call the decoder once with the encoder "
                    "output before decoding with encoded=None"
                )
            cache = self.variables["cache"]
            return _head_major(cache["cross_key"]), _head_major(cache["cross_value"])
        key, value = project_key(inputs_kv), project_value(inputs_kv)
        # Head-major like the self-attention cache. The barrier keeps XLA from
        # cancelling this transpose against the one at each use, which would move
        # it into every decoding step.
        stored = lax.optimization_barrier((_head_major(key), _head_major(value)))
        cross_key = self.variable("cache", "cross_key", lambda: stored[0])
        cross_value = self.variable("cache", "cross_value", lambda: stored[1])
        cross_key.value, cross_value.value = stored
        return key, value


def _head_major(x: Array) -> Array:
    """``[b, t, h, d]`` <-> ``[b, h, t, d]`` (the cache's storage order; its own inverse)."""
    return jnp.swapaxes(x, 1, 2)
