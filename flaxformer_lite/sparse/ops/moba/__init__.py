"""MoBA (``moba:block=B,k=K``): each query's own key block and the ``K - 1`` blocks whose
mean key scores best, attended through :mod:`~flaxformer_lite.sparse.ops.chosen_blocks`.

``xla`` (the op and its routing in XLA), ``routing_triton`` (the routing fused for GPUs,
without the ``n x n / B`` scores in memory).
"""
