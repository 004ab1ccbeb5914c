"""What a run's attention looks like: maps and statistics, apart from decoding.

``attention_maps``: every layer's and head's encoder, decoder and cross-attention on
one sentence, as a PNG grid and a self-contained HTML page (``attention_page.html``);
``diagnostics``: per head, the attention's entropy, distance, largest logit and the
mass inside given sparse patterns over some texts (a table, JSON and a figure; also
logged in training). May import ``inference/`` and the layers below it; never
``training/``.
"""
