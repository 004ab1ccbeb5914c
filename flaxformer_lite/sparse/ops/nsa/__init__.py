"""NSA (``nsa:block=B,k=K,window=W``): compressed blocks, selected blocks and a window,
mixed by learned gates.

``xla`` (the op; its selected branch is :mod:`~flaxformer_lite.sparse.ops.chosen_blocks`,
its window :mod:`~flaxformer_lite.sparse.ops.band` on a GPU), ``compressed_triton`` (the
compressed branch fused for GPUs).
"""
