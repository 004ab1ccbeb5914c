"""TFDS builds of any size without TensorFlow.

TFDS's writer keeps a split's serialized examples in memory up to 1 GB
(``tensorflow_datasets.core.shuffle.MAX_MEM_BUFFER_SIZE``); past that it spills them
to temporary bucket files through ``tf.io.gfile``, so a build of a corpus of WMT's
size (4.5M pairs, ~1.4 GB) stops with ``No module named 'tensorflow'`` where
TensorFlow is not installed, as here: the builders of our own corpora, of a user's
files and TFDS's own ``wmt14_translate`` alike. The buckets are plain local files
written and read back by the same process, so :func:`install` gives the shuffler
the few ``tf.io.gfile`` / ``tf.errors`` names it uses, backed by Python's own file
functions (where TensorFlow is installed, TFDS uses its own). The buffer is lowered to
256 MB, so that a build's memory does not grow with the corpus up to 1 GB.
"""

from __future__ import annotations

import importlib.util
import os
import types


class _NeverRaised(Exception):
    """Stands for ``tf.errors.ResourceExhaustedError`` (local files raise OSError)."""


def _gfile() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        GFile=open, exists=os.path.exists, remove=os.remove, makedirs=os.makedirs
    )


_SHIM = types.SimpleNamespace(
    io=types.SimpleNamespace(gfile=_gfile()),
    errors=types.SimpleNamespace(ResourceExhaustedError=_NeverRaised),
)


BUFFER_BYTES = 256 << 20  # spill past this, not 1 GB: a build's memory stays small


def install() -> bool:
    """Let TFDS's shuffler spill without TensorFlow, from ``BUFFER_BYTES`` on; True if
    the shim is in place."""
    from tensorflow_datasets.core import shuffle

    shuffle.MAX_MEM_BUFFER_SIZE = min(shuffle.MAX_MEM_BUFFER_SIZE, BUFFER_BYTES)
    if importlib.util.find_spec("tensorflow") is not None:
        return False
    shuffle.tf = _SHIM
    return True
