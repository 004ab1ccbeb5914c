"""What the translator and the generator accept as text: one line per text (line and
paragraph separators inside a text become spaces), what they do with an input over
``model.max_len``, and the error that names a bad value and its fix.
"""

from __future__ import annotations

LONG_INPUTS = ("truncate", "refuse")  # what translate does with a source over max_len


class TranslateError(ValueError):
    """Bad input to the translator; the message names the value and the fix."""


# Characters that end a line for str.splitlines() or a terminal, besides "\n": inside a
# line they would split one input or output line into several.
_BREAKS = dict.fromkeys([*range(0x00, 0x09), *range(0x0A, 0x20), 0x7F, 0x85, 0x2028, 0x2029], " ")


def one_line(text: str) -> str:
    """``text`` with tabs kept and other control characters and line or paragraph
    separators replaced by spaces: one line in, one line out."""
    return text.translate(_BREAKS)
