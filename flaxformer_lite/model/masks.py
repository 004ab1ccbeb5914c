"""Attention masks: pure functions on token ids, segment ids and lengths.

Convention: a mask is boolean, True = the query may attend to the key, with
shape ``[batch or 1, 1, q_length, kv_length]`` (the head axis broadcasts).
``combine_masks`` is the one place masks meet, so padding, causality and
packing compose by logical AND.
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp
from jax import Array


def make_padding_mask(query_tokens: Array, key_tokens: Array, pad_id: int = 0) -> Array:
    """True where neither the query nor the key token is padding.

    Args:
      query_tokens: ``[B, Q]`` token ids.
      key_tokens: ``[B, K]`` token ids.
    Returns:
      ``[B, 1, Q, K]`` boolean mask. A padding query attends to nothing (its
      attention output is zero, see ``dot_product_attention``).
    """
    q = jnp.asarray(query_tokens) != pad_id
    k = jnp.asarray(key_tokens) != pad_id
    return q[:, None, :, None] & k[:, None, None, :]


def make_causal_mask(length: int) -> Array:
    """``[1, 1, L, L]``: query i may attend to keys 0..i."""
    idx = jnp.arange(length)
    return (idx[None, :] <= idx[:, None])[None, None]


def make_segment_mask(q_segments: Array, kv_segments: Array) -> Array:
    """``[B, 1, Q, K]``: True where query and key belong to the same packed example.

    Segment ids number the examples packed into a row (1, 2, ...); 0 is padding
    and matches nothing, so padding never attends or is attended to.
    """
    q = jnp.asarray(q_segments)
    k = jnp.asarray(kv_segments)
    same = q[:, None, :, None] == k[:, None, None, :]
    return same & (q != 0)[:, None, :, None]


def make_position_causal_mask(q_positions: Array, kv_positions: Array) -> Array:
    """``[B, 1, Q, K]``: True where the key position is <= the query position."""
    q = jnp.asarray(q_positions)
    k = jnp.asarray(kv_positions)
    return k[:, None, None, :] <= q[:, None, :, None]


def combine_masks(*masks: Array | None) -> Array | None:
    """Logical AND of the given masks (``None`` entries are ignored); broadcasts shapes.

    Returns ``None`` when every argument is ``None`` (attend everywhere).
    """
    present = [jnp.asarray(m, dtype=bool) for m in masks if m is not None]
    if not present:
        return None
    ndims = {m.ndim for m in present}
    if ndims != {4}:
        raise ValueError(
            f"masks must all be 4-D [batch, heads, q_len, kv_len]; got shapes "
            f"{[tuple(m.shape) for m in present]}"
        )
    out = present[0]
    for m in present[1:]:
        out = jnp.logical_and(out, m)
    return out


@flax.struct.dataclass
class SegmentIds:
    """An attention mask in token form, for kernels that never form an ``n x n`` array
    (sparse patterns, chunked dense, cuDNN).

    ``ids [B, Q]``: a query attends only keys with its own id; 0 marks padding.
    Unpacked batches use 1 for every real token. ``kv_ids [B, K]``: the keys' ids
    where they differ from the queries' (cross-attention: decoder queries, encoder
    keys), else None. ``packed`` (static): rows hold several examples (the ids come
    from the batch's segmentation), not one example and padding. Causality, where
    needed, comes from the layer. ``dense()`` gives the equivalent mask.
    """

    ids: Array
    kv_ids: Array | None = None
    packed: bool = flax.struct.field(pytree_node=False, default=False)

    @classmethod
    def from_tokens(cls, tokens: Array, segmentation: Array | None, pad_id: int) -> SegmentIds:
        return cls(_token_ids(tokens, segmentation, pad_id), packed=segmentation is not None)

    @classmethod
    def cross(
        cls,
        q_tokens: Array,
        kv_tokens: Array,
        q_segmentation: Array | None,
        kv_segmentation: Array | None,
        pad_id: int,
    ) -> SegmentIds:
        """Cross-attention's mask: padding on both sides, and packed examples matched by
        id (target example k attends to source example k)."""
        return cls(
            _token_ids(q_tokens, q_segmentation, pad_id),
            _token_ids(kv_tokens, kv_segmentation, pad_id),
            packed=q_segmentation is not None,
        )

    @property
    def keys(self) -> Array:
        return self.ids if self.kv_ids is None else self.kv_ids

    def dense(self) -> Array:
        return make_segment_mask(self.ids, self.keys)


def _token_ids(tokens: Array, segmentation: Array | None, pad_id: int) -> Array:
    real = jnp.asarray(tokens) != pad_id
    ids = jnp.ones_like(tokens, jnp.int32) if segmentation is None else segmentation
    return jnp.where(real, ids, 0).astype(jnp.int32)
