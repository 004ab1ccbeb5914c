"""What a training step keeps for its backward pass: the bytes of the saved residuals.

``saved_bytes(loss, params)`` traces ``jax.vjp`` of the loss (shapes only, nothing runs)
and adds up the residuals JAX saves for the backward pass, the arguments left out:
the activation memory that ``model.remat`` trades for recomputation, counted the same
way on every backend. (XLA's memory analysis of a compiled step is the other measure;
XLA's CPU compiler removes the optimization barriers that keep a recomputation apart,
so on a CPU it shows no saving: a 1k-token 8-layer LM's step held 854 MiB of
temporaries with and without ``remat=full``.)
"""

from __future__ import annotations

import contextlib
import io
import math
import re

from jax.ad_checkpoint import print_saved_residuals

_ITEM_BYTES = {"bool": 1, "i8": 1, "u8": 1, "bf16": 2, "f16": 2, "i16": 2, "u16": 2,
               "f32": 4, "i32": 4, "u32": 4, "f64": 8, "i64": 8, "u64": 8}  # fmt: skip
_LINE = re.compile(r"([^\[\s]+)\[([\d,]*)\]")


def saved_bytes(fn, *args) -> int:
    """Bytes of the residuals ``jax.vjp(fn, *args)`` saves, not counting ``args``."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # JAX's public listing of them is printed
        print_saved_residuals(fn, *args)
    total = 0
    for line in out.getvalue().splitlines():
        found = _LINE.match(line)
        if found is None or "from the argument" in line:
            continue
        shape = [int(x) for x in found.group(2).split(",") if x]
        total += _ITEM_BYTES.get(found.group(1), 8) * math.prod(shape)  # keys: 8 bytes
    return total
