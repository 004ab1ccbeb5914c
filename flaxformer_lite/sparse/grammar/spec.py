"""The sparse-pattern spec of ``model.attention_pattern``: grammar, registry, layers.

The model config selects sparse self-attention with five fields::

    --config.model.attention_pattern=bigbird           # or a spec, see below; "dense" = off
    --config.model.attention_impl=blocked              # blocked | reference (dense mask)
    --config.model.attention_block_size=64
    --config.model.attention_seed=0                    # random patterns
    --config.model.attention_scan_blocks=16            # 0 = fastest; >0 = less memory

The pattern applies to every self-attention: as written in the encoder, as its
causal variant in the decoder and the decoder-only LM. Cross-attention stays
dense.

Spec grammar (no spaces)::

    spec    := layer ('|' layer)*        one per layer, cycled over the layers
    layer   := heads (';' heads)*        head groups: the heads split evenly
    heads   := term ('+' term)*          union
    term    := atom ('&' atom)*          intersection
    atom    := name (':' key=value (',' key=value)*)?

Names and their keys (defaults in brackets; ``block`` defaults to
``attention_block_size``):

=================  ===========================================================
``full``           dense attention as a pattern
``local``          ``window`` [128]
``dilated``        ``window`` [8], ``dilation`` [2]
``strided``        ``stride`` [64] (every stride-th key only)
``sparse_strided`` ``stride`` [64]: local(stride-1) + strided (Sparse Transformer)
``fixed``          ``stride`` [64], ``summary`` [1] (Sparse Transformer)
``global``         ``first`` [1] tokens, or ``positions`` as ``0/17/-1``
``random``         ``blocks`` [3], ``block``
``block_local``    ``radius`` [1], ``block``
``bigbird``        ``window`` [3] blocks, ``global`` [2] blocks, ``random`` [3], ``block``
``longformer``     ``window`` [256], ``global`` [1] first tokens
``etc``            ``window`` [128], ``global`` [8] first tokens
``topk``           ``k`` [64]: each query's k best-scoring keys (dynamic; alone
                   in its head group; no cached decoding; time n^2)
``moba``           ``block``, ``k`` [3], ``block_gate`` [0]: each query's own key
                   block and the k-1 whose mean key best matches it (MoBA; dynamic,
                   sub-quadratic; ``block_gate=1``: one choice per query block)
``nsa``            ``block``, ``k`` [4], ``window`` [64]: NSA's compressed,
                   selected and sliding-window branches, gated (dynamic)
=================  ===========================================================

Examples: ``local:window=64+global:first=2``, ``sparse_strided:stride=64``,
``local:window=32;dilated:window=8,dilation=8`` (half the heads each),
``bigbird|local:window=128`` (alternating layers).
"""

from __future__ import annotations

from collections.abc import Callable

from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P

_ATOMS = {
    "full": ({}, lambda a, blk, seed: P.Full()),
    "local": ({"window": 128}, lambda a, blk, seed: P.Local(a["window"])),
    "dilated": (
        {"window": 8, "dilation": 2},
        lambda a, blk, seed: P.Dilated(a["window"], a["dilation"]),
    ),
    "strided": ({"stride": 64}, lambda a, blk, seed: P.Strided(a["stride"])),
    "sparse_strided": (
        {"stride": 64},
        lambda a, blk, seed: P.sparse_transformer_strided(a["stride"]),
    ),
    "fixed": (
        {"stride": 64, "summary": 1},
        lambda a, blk, seed: P.Fixed(a["stride"], a["summary"]),
    ),
    "global": ({"first": 1, "positions": None}, lambda a, blk, seed: _global(a)),
    "random": (
        {"blocks": 3, "block": None},
        lambda a, blk, seed: P.RandomBlocks(a["block"] or blk, a["blocks"], seed),
    ),
    "block_local": (
        {"radius": 1, "block": None},
        lambda a, blk, seed: P.BlockLocal(a["block"] or blk, a["radius"]),
    ),
    "bigbird": (
        {"window": 3, "global": 2, "random": 3, "block": None},
        lambda a, blk, seed: P.bigbird(
            a["block"] or blk, a["window"], a["global"], a["random"], seed
        ),
    ),
    "longformer": (
        {"window": 256, "global": 1},
        lambda a, blk, seed: P.longformer(a["window"], tuple(range(a["global"]))),
    ),
    "etc": ({"window": 128, "global": 8}, lambda a, blk, seed: P.etc(a["window"], a["global"])),
    "topk": ({"k": 64}, lambda a, blk, seed: D.TopK(a["k"])),
    "moba": (
        {"block": None, "k": 3, "block_gate": 0},
        lambda a, blk, seed: D.MoBA(a["block"] or blk, a["k"], bool(a["block_gate"])),
    ),
    "nsa": (
        {"block": None, "k": 4, "window": 64},
        lambda a, blk, seed: D.NSA(a["block"] or blk, a["k"], a["window"]),
    ),
}


class PatternSpecError(ValueError):
    """A sparse pattern spec that does not parse or does not fit the model."""

    pass


PatternFactory = Callable[[dict, int, int], P.Pattern]


def _first_claim(kind: str, name: str, factory: PatternFactory, taken: bool) -> bool:
    if taken:
        raise ValueError(f"{kind} {name!r} is taken (built in); register yours under another name")
    return True


# Whether a registration goes ahead (kind, name, factory, name taken) -> bool:
# config/extensions.py installs its rule (the same code may register a name again).
CLAIM = [_first_claim]


def register_pattern(name: str, defaults: dict[str, int | None]):
    """Decorator: make ``name`` a pattern of the spec grammar (and so of
    ``model.attention_pattern``). ``defaults`` are its integer keys;
    the factory gets ``(args, block_size, seed)`` with the spec's values filled in::

        @register_pattern("local_dilated", {"window": 32, "dilation": 4})
        def _local_dilated(a, block_size, seed):
            return P.Local(a["window"]) | P.Dilated(a["window"], a["dilation"])
    """

    def add(factory: PatternFactory) -> PatternFactory:
        if not name.isidentifier():
            raise ValueError(f"sparse pattern name {name!r} is not an identifier")
        if CLAIM[0]("sparse pattern", name, factory, name in _ATOMS):
            _ATOMS[name] = (dict(defaults), factory)
        return factory

    return add


def pattern_names() -> tuple[str, ...]:
    """The names the spec grammar knows (built in and registered)."""
    return tuple(_ATOMS)


def _global(a: dict) -> P.Pattern:
    if a["positions"] is not None:
        return P.Global(tuple(a["positions"]))
    return P.Global(tuple(range(a["first"])))


def _parse_atom(text: str, block_size: int, seed: int) -> P.Pattern:
    name, _, rest = text.partition(":")
    if name not in _ATOMS:
        raise PatternSpecError(
            f"unknown sparse pattern {name!r} in {text!r}; known: {', '.join(_ATOMS)}"
        )
    defaults, build = _ATOMS[name]
    args = dict(defaults)
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in defaults:
            raise PatternSpecError(
                f"pattern {name!r}: bad argument {item!r}; keys are {', '.join(defaults) or 'none'}"
            )
        try:
            if key == "positions":
                args[key] = tuple(int(x) for x in value.split("/"))
            else:
                args[key] = int(value)
        except ValueError:
            raise PatternSpecError(
                f"pattern {name!r}: {key}={value!r} is not an integer"
                + (" list like 0/17/-1" if key == "positions" else "")
            ) from None
    try:
        return build(args, block_size, seed)
    except ValueError as e:
        raise PatternSpecError(f"pattern {text!r}: {e}") from None


def _parse_heads(text: str, block_size: int, seed: int) -> P.Pattern:
    terms = []
    for term in text.split("+"):
        atoms = [_parse_atom(a, block_size, seed) for a in term.split("&")]
        terms.append(atoms[0] if len(atoms) == 1 else P.Intersection(tuple(atoms)))
        if len(atoms) > 1 and any(isinstance(a, D.Dynamic) for a in atoms):
            raise PatternSpecError(
                f"{text!r}: {_dynamic(atoms)} cannot be combined with other patterns"
            )
    if len(terms) > 1 and any(isinstance(t, D.Dynamic) for t in terms):
        raise PatternSpecError(
            f"{text!r}: {_dynamic(terms)} cannot be combined with other patterns"
        )
    return terms[0] if len(terms) == 1 else P.Union(tuple(terms))


def _dynamic(patterns) -> str:
    """The spec name of the first dynamic pattern among ``patterns``."""
    found = next(p for p in patterns if isinstance(p, D.Dynamic))
    return {D.TopK: "topk", D.MoBA: "moba", D.NSA: "nsa"}.get(type(found), type(found).__name__)


def is_dense(spec: str) -> bool:
    return spec.strip() in ("", "dense")


def parse_spec(spec: str, block_size: int = 64, seed: int = 0) -> list[list[P.Pattern]]:
    """Spec -> ``[layer][head group]`` patterns (layers cycle; see the module doc)."""
    if is_dense(spec):
        raise PatternSpecError("the spec 'dense' selects no sparse pattern")
    if any(ch.isspace() for ch in spec):
        raise PatternSpecError(f"attention pattern {spec!r} must not contain spaces")
    return [
        [_parse_heads(h, block_size, seed) for h in layer.split(";")] for layer in spec.split("|")
    ]


def parse_spec_texts(spec: str, layer: int) -> list[str]:
    """The head groups of layer ``layer`` as written in the spec (layers cycle)."""
    layers = spec.split("|")
    return layers[layer % len(layers)].split(";")


def layer_patterns(
    spec: str, layer: int, num_heads: int, *, block_size: int, seed: int, causal: bool
) -> list[P.Pattern]:
    """The head-group patterns of layer ``layer`` (random ones drawn for that layer)."""
    layers = parse_spec(spec, block_size, seed)
    groups = layers[layer % len(layers)]
    if num_heads % len(groups):
        raise PatternSpecError(
            f"{len(groups)} head groups in {spec!r} do not divide num_heads={num_heads}"
        )
    out = [g.for_layer(layer) for g in groups]
    try:
        return [g.causal() for g in out] if causal else out
    except ValueError as e:
        raise PatternSpecError(f"attention pattern {spec!r} in a causal layer: {e}") from None


def check_spec(
    spec: str, num_heads: int, num_layers: int, block_size: int, causal_layers: int = 0
) -> None:
    """Validate a spec against the model (raises PatternSpecError with the fix); the
    first ``causal_layers`` layers (a decoder's) also in their causal variants."""
    if is_dense(spec):
        return
    for layer in range(causal_layers):
        layer_patterns(spec, layer, num_heads, block_size=block_size, seed=0, causal=True)
    for layer in range(max(num_layers, 1)):
        for pattern in layer_patterns(
            spec, layer, num_heads, block_size=block_size, seed=0, causal=False
        ):
            if not isinstance(pattern, D.Dynamic):  # (dynamic: nothing to plan)
                pattern.plans(2 * block_size + 1, block_size)  # surfaces bad parameters early


def sliding_window(patterns: list[P.Pattern]) -> int | None:
    """Largest window if every head group is a (causal) Local band, else None."""
    windows = []
    for p in patterns:
        if not isinstance(p, P.Local):
            return None
        windows.append(p.window)
    return max(windows)
