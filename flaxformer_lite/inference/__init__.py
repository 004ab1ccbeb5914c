"""Using a trained run: decoding, translation, evaluation, averaging, pictures.

Cached greedy/beam/sampling decoding, the Translator and its streaming commands, BLEU
evaluation, checkpoint averaging, attention maps, and ``run`` (a workdir opened for
reading: its config, tokenizer, model and parameters). May import ``model/``,
``data/``, ``workdir/``, ``config/`` and ``sparse/``; never ``training/``.
"""
