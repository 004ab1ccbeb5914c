"""Sparse attention as data and kernels: the bottom layer.

Patterns (``patterns``: which keys each query sees, as a rule and a block plan), their
spec grammar and registry (``spec``: ``model.attention_pattern``), the blocked kernels
that never form an ``n x n`` array (``blocked``, ``block_kernel``, ``online_softmax``,
``topk``) and receptive-field analysis (``analysis``). Imports nothing of the project,
so the config can validate pattern specs and the model can run them.
"""
