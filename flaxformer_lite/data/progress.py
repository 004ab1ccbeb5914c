"""TFDS's progress bars only where someone watches them.

TFDS draws its bars (tqdm) while it builds or downloads a dataset: on a terminal they
redraw in place; in a log file, a pipe or a CI job they are carriage returns and
cursor-up escapes that garble the log, so that a failing build's error line reads
``...[A    ...[A error: ...``. :func:`where_seen` keeps them on a terminal and in a
notebook (tqdm draws widgets there) and hides them elsewhere, for one build.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import tensorflow_datasets as tfds


def seen() -> bool:
    """Whether progress bars are seen: both output streams a terminal, or a notebook."""
    if "ipykernel" in sys.modules:
        return True
    return all(getattr(s, "isatty", lambda: False)() for s in (sys.stdout, sys.stderr))


@contextlib.contextmanager
def where_seen() -> Iterator[None]:
    """A TFDS build or download inside shows its progress bars only if :func:`seen`."""
    if seen():
        yield
        return
    tfds.disable_progress_bar()
    try:
        yield
    finally:
        tfds.enable_progress_bar()
