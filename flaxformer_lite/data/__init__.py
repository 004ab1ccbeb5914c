"""Data: corpora, TFDS builders, the tokenizer, a run's data and the input pipeline.

Debian-package corpora and their parsers (``corpora``, ``prepare``), TFDS builders
writing array_record (``builders``; a user's own text files: ``files``) read with
grain (``sources``), the joint
sentencepiece model (``tokenizer``), the token cache of memory-mapped ids
(``token_store``) and the example table over it (``table``), a run's splits, ids and
PPMI start (``assembly``, ``cooccurrence``) and packing into batches (``packing``,
``pipeline``). May import ``config/``; nothing here knows the model.
"""
