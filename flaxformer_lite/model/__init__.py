"""The models: building blocks, the encoder-decoder and the decoder-only LM.

Components (score functions, masks, multi-head attention and the one place a kernel is
chosen, embeddings, FFN, dropout, the cuDNN/splash/chunked kernels), whole models
(``transformer``, ``lm``, ``build``) and the logical axes that shard their parameters
(``partitioning``). May import ``config/`` and ``sparse/``; nothing here reads data,
a workdir or trains.
"""
