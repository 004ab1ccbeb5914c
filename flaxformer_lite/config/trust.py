"""Whose word lets a run's code run: the trust record, and what a file would register.

A run folder may carry Python files (its extensions, ``extensions/``); importing one
runs it. :mod:`~flaxformer_lite.config.extensions`, the one importer, imports a run's
copy only for its author on the same machine (the original file at the path the run
recorded, with the same SHA-256), for code the command's own config names, or on the
user's word: ``--trust_extensions`` (:func:`trust_all`), remembered here by SHA-256
in the user's config folder (``$XDG_CONFIG_HOME/flaxformer_lite``, by default
``~/.config/flaxformer_lite``), never in the run's folder, so a copied run cannot vouch
for itself. What a file would register is read from its source without running it
(:func:`declared`), so the refusal can say what the code is for.
"""

from __future__ import annotations

import ast
import json
import os
import time
from pathlib import Path

RECORD = "trusted_extensions.json"
_TRUST_ALL = [False]

# register_* -> the kind of name it registers, as the registries call them
KINDS = {
    "register_pattern": "sparse pattern",
    "register_score_fn": "score function",
    "register_ffn": "feed-forward block",
    "register_norm": "normalisation",
    "register_positional": "position encoding",
    "register_attention": "attention layer",
}


def trust_all(on: bool = True) -> None:
    """``--trust_extensions``: import every run's code this process reads (and remember
    it by SHA-256, so the next command on the same code needs no flag)."""
    _TRUST_ALL[0] = on


def trusting_all() -> bool:
    return _TRUST_ALL[0]


def record_path() -> Path:
    """The user's trust record (not the run's: a folder cannot vouch for itself)."""
    root = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(root) / "flaxformer_lite" / RECORD


def trusted() -> dict[str, dict]:
    """SHA-256 -> what was trusted (entry, when, from which run)."""
    path = record_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def remember(records: list[dict], workdir) -> None:
    """Add ``records`` (a manifest's, trusted by the flag) to the user's trust record."""
    known = trusted()
    for r in records:
        known.setdefault(r["sha256"], {"entry": r["entry"], "run": str(workdir),
                                       "trusted": time.strftime("%Y-%m-%d %H:%M:%S")})  # fmt: skip
    path = record_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    tmp.replace(path)


def declared(code: bytes) -> list[str]:
    """What a file's source registers, read without running it: ``sparse pattern
    'my_band'`` for each ``register_pattern("my_band", ...)`` call with a literal name
    (a name computed at run time shows as ``?``)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return ["(not valid Python)"]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        if name in KINDS:
            first = node.args[0] if node.args else None
            label = repr(first.value) if isinstance(first, ast.Constant) else "?"
            found.append(f"{KINDS[name]} {label}")
    return list(dict.fromkeys(found)) or ["nothing it names"]
