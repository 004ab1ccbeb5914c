"""How sparse attention is computed: an op a folder, its backends beside it.

Every op takes ``q``, ``k``, ``v`` (``[b, n, h, d]``) and what says which keys each
query reads (a pattern, a routing), and returns ``[b, n, h, d]``: the attention of
each query over exactly those keys, zero for a query that may read none. Its backends
compute the same values (the tests hold each against a float64 dense reference):
``xla.py`` (XLA, every platform, the reference among the kernels), ``pallas_triton*.py``
(Pallas kernels lowered by Triton on a GPU, by Pallas' interpreter elsewhere; what is
Triton's is in :mod:`~flaxformer_lite.sparse.ops.pallas_flash`), ``splash.py`` (TPU
splash attention's masks). Shared: ``online_softmax`` (partial softmaxes and their
exact merge) and ``pallas_flash`` (the flash-attention plumbing of the GPU kernels).
"""
