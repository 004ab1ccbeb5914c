"""Any static pattern, from its cover: ``out_i = sum_{j allowed(i, j)} softmax_j(q_i.k_j) v_j``.

``xla`` (the blocked kernel: the cover's blocks, columns, strides and rows as partial
softmaxes, merged; ``xla_blocks`` its block part, a group of query blocks at a time),
``pallas_triton`` (one fused kernel over the pattern's tile plan; ``regroup`` makes a
stride's pairs contiguous first), ``splash`` (TPU splash's mask of a pattern).
"""
