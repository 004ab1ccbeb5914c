"""How a test set is cut into decoding batches, and how long each batch's outputs may be.

Sentences are sorted by length. A batch's source width is a power of two (at least
16, at most ``max_len``), and it holds as many sentences as a token budget allows at
that width (or a fixed count), so that every batch of a width has one shape. Its
output limit is the longest source + ``max_extra`` pieces (with
``max_length_ratio``: no more than that row's bound), and the search compiles for
the limit of the widest batch of the width: one compiled search per width.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

# The narrowest source width. Each width compiles its own search (~2.8 s for beam 4 on
# 2 cores): the sentences of up to 8 pieces run at 16, half as many a batch, and a
# test set compiles one search fewer. On the demo's test split: a fresh process's
# translation 27.3-27.8 s -> 23.3-24.2 s, warm unchanged (14.2-15.0 s / 14.4-15.9 s),
# the same outputs.
NARROWEST = 16


def width(length: int, max_len: int) -> int:
    """A batch's padded source length: a power of two (at least NARROWEST), at most
    max_len."""
    return min(2 ** math.ceil(math.log2(max(length, NARROWEST))), max_len)


def rows(source_width: int, batch_tokens: int, batch_size: int | None) -> int:
    """Rows of a batch of ``source_width``: ``batch_size``, else the token budget's."""
    return batch_size or max(1, batch_tokens // source_width)


def batches(
    encoded: list[np.ndarray], max_len: int, batch_tokens: int, batch_size: int | None = None
) -> Iterator[tuple[list[int], np.ndarray, int]]:
    """(indices, padded ``[rows, width]`` ids, longest length) per batch, sorted by
    length: each batch grows while the wider batch still holds every row."""
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    start = 0
    while start < len(order):
        stop = start + 1
        while stop < len(order):
            wide = width(len(encoded[order[stop]]), max_len)
            if stop + 1 - start > rows(wide, batch_tokens, batch_size):
                break
            stop += 1
        idx = order[start:stop]
        longest = max(len(encoded[i]) for i in idx)
        wide = width(longest, max_len)
        padded = np.zeros((rows(wide, batch_tokens, batch_size), wide), np.int32)
        for r, i in enumerate(idx):
            padded[r, : len(encoded[i])] = encoded[i]
        yield idx, padded, longest
        start = stop


def output_limit(length: int, decode, max_len: int, max_length: int | None = None) -> int:
    """The output limit of a batch whose longest source has ``length`` pieces (EOS
    included): ``max_length`` if given, else length + ``decode.max_extra`` (and, with
    ``decode.max_length_ratio``, no more than its longest row's bound), at most max_len."""
    if max_length:
        return max_length
    limit = min(length + decode.max_extra, max_len)
    if decode.max_length_ratio:  # no row outlives its own bound
        limit = min(limit, math.ceil(decode.max_length_ratio * (length - 1)) + 6)
    return limit


def length_bounds(decode, lengths: np.ndarray, limit, real: np.ndarray) -> dict:
    """A beam search's bounds on each sentence's tokens before EOS under ``decode``'s
    length ratios (``lengths``: source pieces, EOS excluded; ``limit``: the batch's
    output limit, or one per sentence): ``min_lengths`` with ``min_length_ratio``, and
    ``max_lengths`` for every row, so that padding rows (not ``real``: 0) end at once."""
    bounds = {}
    if decode.min_length_ratio:
        least = np.minimum(np.floor(decode.min_length_ratio * lengths), np.asarray(limit) - 1)
        bounds["min_lengths"] = least.astype(np.int32)
    most = np.broadcast_to(limit, lengths.shape)
    if decode.max_length_ratio:
        most = np.ceil(decode.max_length_ratio * lengths) + 5
    bounds["max_lengths"] = np.where(real, most, 0).astype(np.int32)
    return bounds
