"""Using a trained run: decoding, translation, evaluation, averaging.

Cached greedy/beam/sampling decoding, the Translator and its streaming commands, BLEU
evaluation, checkpoint averaging, and ``run`` (a workdir opened for reading: its
config, tokenizer, model and parameters). Models in and out are ``exchange/``'s, the
attention's pictures and statistics ``views/``'s. May import ``model/``,
``data/``, ``workdir/``, ``config/`` and ``sparse/``; never ``training/``.
"""
