"""Each query's ``k`` best-scoring keys (``topk:k=K``): every score decides, so time is
``n^2`` and memory a query block's ``B x n`` (``xla``); no fused kernel computes it.
"""
