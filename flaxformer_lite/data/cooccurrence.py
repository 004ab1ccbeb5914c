"""Initial token embeddings from co-occurrence counts (PPMI + truncated eigendecomposition).

A translation pair is a tiny bilingual document: the pieces of its source and
of its target occur together. Counting, over all training pairs, how often two
pieces share a pair, weighting the counts by positive pointwise mutual
information (PPMI, with the context distribution smoothed by ``**0.75``) and
keeping its top ``dim`` eigen-directions gives every piece a vector whose
neighbours are the pieces it co-occurs with *across* the languages: with the
Ding sentences and dictionary phrases, ``▁voice`` lands next to ``▁Stimme``,
``▁station`` next to ``▁Bahnhof``, ``▁always`` next to ``▁immer``. With tied
embeddings the model starts out knowing which target pieces go with which
source pieces, instead of learning the lexicon from a few thousand sentences.

This is the count-based route to word vectors (Levy & Goldberg, 2014: SVD of
the shifted PPMI matrix approximates skip-gram); here the context is the pair,
which is what makes the vectors bilingual. No JAX, seconds on a CPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import scipy.sparse as sparse
# scipy is imported by the functions that use it: every training process imports this
# module (through data.assembly), and only runs with PPMI-initialised embeddings need it.


def cooccurrence_counts(documents: Iterable[np.ndarray], vocab_size: int) -> sparse.csr_matrix:
    """``C[i, j]`` = number of documents holding both piece ``i`` and piece ``j`` (i != j)."""
    import scipy.sparse as sparse

    rows = [np.unique(np.asarray(d, np.int64)) for d in documents]
    rows = [r[(r >= 0) & (r < vocab_size)] for r in rows]
    if not rows:
        raise ValueError("no documents to count co-occurrences in")
    indptr = np.cumsum([0] + [len(r) for r in rows])
    indices = np.concatenate(rows) if indptr[-1] else np.zeros(0, np.int64)
    x = sparse.csr_matrix(
        (np.ones(len(indices), np.float64), indices, indptr), shape=(len(rows), vocab_size)
    )
    counts = (x.T @ x).tocsr()
    counts.setdiag(0)
    counts.eliminate_zeros()
    return counts


def ppmi(counts: sparse.spmatrix, smoothing: float = 0.75) -> sparse.csr_matrix:
    """Positive PMI of a symmetric count matrix, context probabilities ``∝ count**smoothing``."""
    import scipy.sparse as sparse

    c = counts.tocoo()
    total = c.data.sum()
    if total <= 0:
        raise ValueError("the co-occurrence matrix is empty: no piece shares a document")
    row = np.asarray(counts.sum(axis=1)).ravel()
    context = np.asarray(counts.sum(axis=0)).ravel() ** smoothing
    context = context / context.sum()
    pmi = np.log(c.data / total) - np.log(row[c.row] / total) - np.log(context[c.col])
    keep = pmi > 0
    return sparse.csr_matrix((pmi[keep], (c.row[keep], c.col[keep])), shape=counts.shape)


def ppmi_embeddings(
    documents: Iterable[np.ndarray], vocab_size: int, dim: int, *, seed: int = 0
) -> tuple[np.ndarray, int]:
    """``[vocab_size, dim]`` unit-norm vectors (rows of ``Q sqrt(Λ)`` for the ``dim``
    largest eigenvalues of the PPMI matrix) and the number of pieces that got one.

    Pieces that share no document with another (special ids, unseen pieces) keep a
    random unit-norm row, as a fresh embedding table would give them (the
    model's initialiser draws rows of norm ~1: N(0, 1/dim) entries).
    """
    if not 0 < dim < vocab_size:
        raise ValueError(f"embedding dim {dim} must be in (0, vocab_size={vocab_size})")
    matrix = ppmi(cooccurrence_counts(documents, vocab_size))
    seen = np.asarray((matrix != 0).sum(axis=1)).ravel() > 0
    rng = np.random.default_rng(seed)
    out = rng.normal(size=(vocab_size, dim))
    k = min(dim, int(seen.sum()) - 1)
    if k >= 1:
        # The largest *algebraic* eigenpairs of the symmetric matrix, not its top singular
        # vectors: a piece and its translation that co-occur only with each other form
        # a +a/-a eigenvalue pair, and the SVD's U sqrt(S) would make them orthogonal.
        import scipy.sparse.linalg as sparse_linalg

        v0 = rng.normal(size=vocab_size)  # a fixed start vector: the same result every run
        values, vectors = sparse_linalg.eigsh(matrix, k=k, which="LA", v0=v0)
        vectors = vectors * np.sqrt(np.maximum(values, 0.0))
        out[seen, :k] = vectors[seen]
        out[seen, k:] = 0.0
    norms = np.linalg.norm(out, axis=1, keepdims=True)
    return (out / np.maximum(norms, 1e-12)).astype(np.float32), int(seen.sum())


def nearest(table: np.ndarray, index: int, k: int = 5) -> list[int]:
    """The ``k`` rows closest to row ``index`` by cosine (itself excluded)."""
    unit = table / np.maximum(np.linalg.norm(table, axis=1, keepdims=True), 1e-12)
    scores = unit @ unit[index]
    scores[index] = -np.inf
    return [int(i) for i in np.argsort(-scores)[:k]]
