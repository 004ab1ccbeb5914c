"""PPMI embedding initialisation: counts, PPMI against a float64 formula, neighbours."""

import numpy as np
import pytest
import scipy.sparse

from flaxformer_lite.data import cooccurrence


def test_counts_are_documents_sharing_both_pieces():
    docs = [np.array([1, 2, 2, 3]), np.array([2, 3]), np.array([4])]
    c = cooccurrence.cooccurrence_counts(docs, 6).toarray()
    want = np.zeros((6, 6))
    want[1, 2] = want[2, 1] = 1  # doc 0 (a repeated piece counts once)
    want[1, 3] = want[3, 1] = 1
    want[2, 3] = want[3, 2] = 2  # docs 0 and 1
    np.testing.assert_array_equal(c, want)


def test_ppmi_matches_the_definition():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 5, (7, 7)).astype(np.float64)
    counts = counts + counts.T
    np.fill_diagonal(counts, 0)
    got = cooccurrence.ppmi(scipy.sparse.csr_matrix(counts), smoothing=0.75).toarray()
    total = counts.sum()
    p_ij = counts / total
    p_i = counts.sum(1) / total
    ctx = counts.sum(0) ** 0.75
    p_j = ctx / ctx.sum()
    with np.errstate(divide="ignore"):
        pmi = np.log(p_ij) - np.log(p_i)[:, None] - np.log(p_j)[None, :]
    want = np.where(counts > 0, np.maximum(pmi, 0.0), 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_translation_pairs_become_neighbours():
    # 10 "English" pieces 10..19 and their "German" partners 20..29; every document
    # holds a word, its partner and 3 random pieces of either language.
    rng = np.random.default_rng(1)
    vocab = 40
    docs = []
    for _ in range(3000):
        i = int(rng.integers(0, 10))
        docs.append(np.array([10 + i, 20 + i, *rng.integers(10, 30, 3)]))
    table, covered = cooccurrence.ppmi_embeddings(docs, vocab, 16, seed=0)
    assert table.shape == (vocab, 16) and table.dtype == np.float32
    assert covered == 20  # ids 0..9 and 30..39 never occur: random rows
    np.testing.assert_allclose(np.linalg.norm(table, axis=1), 1.0, rtol=1e-5)
    for i in range(10):
        assert cooccurrence.nearest(table, 10 + i, 1) == [20 + i]
        assert cooccurrence.nearest(table, 20 + i, 1) == [10 + i]
    again, _ = cooccurrence.ppmi_embeddings(docs, vocab, 16, seed=0)
    np.testing.assert_allclose(table, again, atol=1e-6)  # ARPACK: same start vector


def test_errors():
    with pytest.raises(ValueError, match="dim 8 must be in"):
        cooccurrence.ppmi_embeddings([np.array([1, 2])], 8, 8)
    with pytest.raises(ValueError, match="no piece shares a document"):
        cooccurrence.ppmi_embeddings([np.array([1]), np.array([2])], 8, 4)
