"""Mask helpers against literal matrices."""

import numpy as np
import pytest

from flaxformer_lite.model.masks import (
    combine_masks,
    make_causal_mask,
    make_padding_mask,
    make_position_causal_mask,
    make_segment_mask,
)

T, F = True, False


def test_padding_mask_literal():
    q = np.array([[5, 6, 0]])
    k = np.array([[7, 0]])
    m = make_padding_mask(q, k, pad_id=0)
    assert m.shape == (1, 1, 3, 2) and m.dtype == bool
    np.testing.assert_array_equal(m[0, 0], [[T, F], [T, F], [F, F]])


def test_padding_mask_other_pad_id():
    m = make_padding_mask(np.array([[3, 9]]), np.array([[9, 3]]), pad_id=9)
    np.testing.assert_array_equal(m[0, 0], [[F, T], [F, F]])


def test_causal_mask_literal():
    m = make_causal_mask(3)
    assert m.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(m[0, 0], [[T, F, F], [T, T, F], [T, T, T]])


def test_segment_mask_literal():
    seg = np.array([[1, 1, 2, 0]])
    m = make_segment_mask(seg, seg)
    np.testing.assert_array_equal(
        m[0, 0],
        [[T, T, F, F], [T, T, F, F], [F, F, T, F], [F, F, F, F]],
    )


def test_segment_mask_cross_lengths():
    m = make_segment_mask(np.array([[1, 2]]), np.array([[1, 1, 2]]))
    np.testing.assert_array_equal(m[0, 0], [[T, T, F], [F, F, T]])


def test_position_causal_mask():
    m = make_position_causal_mask(np.array([[0, 1, 0]]), np.array([[0, 1, 0]]))
    np.testing.assert_array_equal(m[0, 0], [[T, F, T], [T, T, T], [T, F, T]])


def test_combine_masks_and_none():
    a = make_causal_mask(3)
    b = make_padding_mask(np.array([[1, 1, 0]]), np.array([[1, 1, 0]]))
    m = combine_masks(a, None, b)
    np.testing.assert_array_equal(m[0, 0], [[T, F, F], [T, T, F], [F, F, F]])
    assert combine_masks(None, None) is None


def test_combine_masks_rejects_wrong_rank():
    with pytest.raises(ValueError, match="4-D"):
        combine_masks(np.ones((2, 2), bool), make_causal_mask(2))
