"""How sparse attention is computed: an op a folder, its backends beside it.

Every op takes ``q``, ``k``, ``v`` (``[b, n, h, d]``) and what says which keys each
query reads (a pattern, a routing), and returns ``[b, n, h, d]``: the attention of
each query over exactly those keys, zero for a query that may read none. Its backends
compute the same values (the tests hold each against a float64 dense reference):
``xla*.py`` (XLA, every platform, the reference among the kernels), ``pallas_triton*.py``
and ``*_triton.py`` (Pallas kernels, lowered by Triton on a GPU and run by Pallas'
interpreter elsewhere), ``splash.py`` (TPU splash attention's masks).

The ops, and what each may import besides the grammar and the shared pieces:
``block_sparse``, ``band``, ``chosen_blocks``, ``topk`` (none: the primitives), ``moba``
(the chosen blocks), ``nsa`` (MoBA's routing, the chosen blocks, a window). Shared:
``online_softmax`` (partial softmaxes and their exact merge), ``packing`` (packed rows
in each sequence's own coordinates), ``pallas_flash`` (the flash-attention plumbing of
the GPU kernels) and ``triton_lowering`` (the only file that names Triton: tile
products, masked loads and stores, launch parameters).
"""
