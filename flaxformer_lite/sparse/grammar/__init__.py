"""What a pattern is, whatever computes it: the rule, the cover, the spec grammar.

``patterns`` (static patterns as data: ``allows(i, j, n)``, the exact rule, and
``plans(n, block)``, a cover the kernels compute), ``dynamic`` (``moba``, ``nsa``: keys
chosen from the content, block by block), ``spec`` (``model.attention_pattern``: the
grammar, the registry, per-layer and per-head-group forms), ``plans`` (a cover's
blocks, columns, strides and rows), ``tiles`` (a cover as the tiles a fused kernel and
splash visit, full or partial), ``analysis`` (receptive fields, pattern pictures).
numpy only: the config checks specs with these before JAX is imported.
"""
