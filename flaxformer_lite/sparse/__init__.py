"""Sparse attention: what a pattern is, apart from how it is computed. The bottom layer.

- ``grammar/``: what a pattern is. ``patterns`` (which keys each query sees: an exact
  rule and a cover of blocks), ``dynamic`` (patterns whose keys depend on the content:
  ``moba``, ``nsa``), ``spec`` (the grammar and registry of ``model.attention_pattern``),
  ``plans`` (a cover as blocks, columns, strides and rows), ``tiles`` (a cover as the
  tiles a fused kernel visits), ``analysis`` (receptive fields of stacked layers). No
  JAX: the config validates specs with them.
- ``ops/``: how it is computed, an op a folder with its backends beside it
  (``xla.py``: XLA, every platform; ``pallas_triton.py``: Pallas lowered by Triton on a
  GPU, Pallas' interpreter elsewhere; ``splash.py``: TPU). ``block_sparse`` (any static
  pattern), ``band`` (a window), ``chosen_blocks`` (the key blocks a routing chose),
  ``moba``, ``nsa``, ``topk``; ``online_softmax`` and ``pallas_flash`` are what they
  share.
- ``dispatch``: the one table of which kernel computes which pattern on which backend,
  with each refusal's reason; the model and the config ask it.

Imports nothing of the project. ``flaxformer_lite.sparse.patterns``, ``.spec`` and
``.analysis`` stay the grammar's public names; the modules' names before the rooms
(``sparse.blocked``, ``sparse.band_gpu``, ...) import their new modules, for one
release (the package's ``__init__`` keeps the list; ``docs/architecture.md`` shows it).
"""

import sys

from flaxformer_lite.sparse.grammar import analysis, patterns, spec

# The grammar's public names: the same module objects under both paths.
for _name, _module in (("analysis", analysis), ("patterns", patterns), ("spec", spec)):
    sys.modules[f"{__name__}.{_name}"] = _module
