"""A window: ``out_i = sum_{-right <= i - j <= left} softmax_j(q_i.k_j) v_j``, visiting only
the key blocks it reaches (``pallas_triton``; on XLA the window is a static pattern of
:mod:`~flaxformer_lite.sparse.ops.block_sparse`).
"""
