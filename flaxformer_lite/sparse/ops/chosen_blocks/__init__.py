"""Attention over the key blocks a routing chose for each query (MoBA's gate, NSA's
selection), and each query's own block: the work is the routing's pairs, never ``n x n``.

``xla_gather`` (each query gathers its blocks), ``xla_chunks`` (each key block meets the
queries that chose it, in dense chunks: XLA's faster form), ``pallas_triton_tiles``
(query tiles over the union of their queries' blocks), ``pallas_triton_gather`` (key
block by key block over gathered query rows).
"""
