"""Models in and out: a run written for other libraries, and their models read as runs.

``export``: a run's parameters and tokenizer as a transformers folder (Marian, or
Pegasus where pre-LN) or a CTranslate2 model, which those libraries load alone;
``hf_import``: a transformers Marian / OPUS-MT or Pegasus folder read as a run's model
fields, parameters and tokenizer (``train.init_from``). Parameters and tokenizers only,
never training state or a folder's code. Reads a run as inference does: may import
``inference/``, ``model/``, ``data/``, ``workdir/``, ``config/`` and ``sparse/``; never
``training/``.
"""
