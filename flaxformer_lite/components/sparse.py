"""Sparse attention for the model: pattern specs from the config, per layer and per head.

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
                   in its head group; no cached decoding)
=================  ===========================================================

Examples: ``local:window=64+global:first=2``, ``sparse_strided:stride=64``,
``local:window=32;dilated:window=8,dilation=8`` (half the heads each),
``bigbird|local:window=128`` (alternating layers).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import Array

from flaxformer_lite.components import kernels
from flaxformer_lite.components.attention import attention_weights, dot_product_attention
from flaxformer_lite.config import ATTENTION_IMPLS, ConfigError, ModelConfig, register_check
from flaxformer_lite.sparse import patterns as P
from flaxformer_lite.sparse.blocked import sparse_attention
from flaxformer_lite.sparse.online_softmax import segment_mask
from flaxformer_lite.sparse.topk import topk_attention

IMPLS = ATTENTION_IMPLS

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
    "topk": ({"k": 64}, lambda a, blk, seed: P.TopK(a["k"])),
}


class PatternSpecError(ValueError):
    """A sparse pattern spec that does not parse or does not fit the model."""

    pass


PatternFactory = Callable[[dict, int, int], P.Pattern]


def register_pattern(name: str, defaults: dict[str, int | None]):
    """Decorator: make ``name`` a pattern of the spec grammar (and so of
    ``model.attention_pattern``). ``defaults`` are its integer keys;
    the factory gets ``(args, block_size, seed)`` with the spec's values filled in::

        @register_pattern("local_dilated", {"window": 32, "dilation": 4})
        def _local_dilated(a, block_size, seed):
            return P.Local(a["window"]) | P.Dilated(a["window"], a["dilation"])
    """

    def add(factory: PatternFactory) -> PatternFactory:
        if name in _ATOMS or not name.isidentifier():
            raise ValueError(f"sparse pattern name {name!r} is taken or not an identifier")
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
        if len(atoms) > 1 and any(isinstance(a, P.TopK) for a in atoms):
            raise PatternSpecError(f"{text!r}: topk cannot be combined with other patterns")
    if len(terms) > 1 and any(isinstance(t, P.TopK) for t in terms):
        raise PatternSpecError(f"{text!r}: topk cannot be combined with other patterns")
    return terms[0] if len(terms) == 1 else P.Union(tuple(terms))


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
    return [g.causal() for g in out] if causal else out


def check_spec(spec: str, num_heads: int, num_layers: int, block_size: int) -> None:
    """Validate a spec against the model (raises PatternSpecError with the fix)."""
    if is_dense(spec):
        return
    for layer in range(max(num_layers, 1)):
        for pattern in layer_patterns(
            spec, layer, num_heads, block_size=block_size, seed=0, causal=False
        ):
            if not isinstance(pattern, P.TopK):  # (dynamic: nothing to plan)
                pattern.plans(2 * block_size + 1, block_size)  # surfaces bad parameters early


@register_check
def check_model_pattern(config: ModelConfig) -> None:
    """``model.attention_pattern`` parses and fits the model (run by every ModelConfig)."""
    if is_dense(config.attention_pattern):
        return
    try:
        check_spec(
            config.attention_pattern,
            config.num_heads,
            max(config.num_encoder_layers, config.num_decoder_layers),
            config.attention_block_size,
        )
    except PatternSpecError as e:
        raise ConfigError(
            f"model.attention_pattern={config.attention_pattern!r}: {e} "
            "(grammar: flaxformer_lite/components/sparse.py)"
        ) from None
    if config.attention_impl == "cudnn":
        for layer in parse_spec(config.attention_pattern, config.attention_block_size):
            for pattern in layer:
                try:
                    kernels.cudnn_computes(pattern)
                except ValueError as e:
                    raise ConfigError(
                        f"model.attention_pattern={config.attention_pattern!r}: {e}"
                    ) from None


def sliding_window(patterns: list[P.Pattern]) -> int | None:
    """Largest window if every head group is a (causal) Local band, else None."""
    windows = []
    for p in patterns:
        if not isinstance(p, P.Local):
            return None
        windows.append(p.window)
    return max(windows)


def multihead_sparse_attention(
    query: Array,
    key: Array,
    value: Array,
    patterns: list[P.Pattern],
    *,
    impl: str = "blocked",
    block_size: int = 64,
    segments: Array | None = None,
    packed: bool = False,
    scale: float | None = None,
    scan_blocks: int | None = None,
) -> Array:
    """``[b, n, h, d]`` self-attention, head groups each under their own pattern.

    ``impl=cudnn`` runs the groups cuDNN computes on it and a two-sided Local band on
    the blocked kernel (cuDNN's window is left-only); ``packed``: rows hold several
    examples (``segments`` from the batch's segmentation), for cuDNN's packed layout."""
    h = query.shape[2]
    per = h // len(patterns)
    outs = []
    for g, pattern in enumerate(patterns):
        sl = slice(g * per, (g + 1) * per)
        q, k, v = query[:, :, sl], key[:, :, sl], value[:, :, sl]
        if impl == "splash":
            return kernels.splash_attention(
                query, key, value, patterns, segments=segments, scale=scale
            )
        if impl == "cudnn" and kernels.cudnn_computes(pattern):
            outs.append(
                kernels.cudnn_attention(
                    q, k, v, pattern=pattern, q_segments=segments, packed=packed, scale=scale
                )
            )
        elif isinstance(pattern, P.TopK):  # dynamic: the same kernel for both impls
            outs.append(
                topk_attention(
                    q if scale is None else q * (scale * math.sqrt(q.shape[-1])), k, v,
                    pattern.k, causal=pattern.is_causal, q_segments=segments,
                    kv_segments=segments, query_block=min(block_size, 128),
                )
            )  # fmt: skip
        elif impl in ("blocked", "cudnn"):
            outs.append(
                sparse_attention(
                    q, k, v, pattern, block_size=block_size, q_segments=segments,
                    kv_segments=segments, scale=scale, scan_blocks=scan_blocks,
                )
            )  # fmt: skip
        elif impl == "reference":
            outs.append(masked_dense_attention(q, k, v, pattern, segments=segments, scale=scale))
        else:
            raise ValueError(f"attention_impl={impl!r}; choose one of {', '.join(IMPLS)}")
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def masked_dense_attention(
    query: Array,
    key: Array,
    value: Array,
    pattern: P.Pattern,
    *,
    segments: Array | None = None,
    scale: float | None = None,
) -> Array:
    """The pattern's attention as dense attention under its ``[n, n]`` mask
    (``attention_impl=reference``): quadratic memory, for checking and small ``n``."""
    n, d = query.shape[1], query.shape[-1]
    mask = jnp.asarray(pattern.mask(n))[None, None]
    if segments is not None:
        mask = mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return dot_product_attention(
        query, key, value, mask, score_fn=lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    )


def dense_attention_weights(
    query: Array,
    key: Array,
    patterns: list[P.Pattern],
    *,
    segments: Array | None = None,
    scale: float | None = None,
) -> Array:
    """``[b, h, n, n]`` attention weights of the head groups' patterns, as a dense array:
    what the blocked kernel computes without forming it, for pictures
    (``sow_attention_weights``) and checks at small ``n``."""
    n, h, d = query.shape[1], query.shape[2], query.shape[-1]
    per = h // len(patterns)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = jnp.einsum("bqhd,bkhd->bhqk", query, key) * scale
    masks = []
    for g, p in enumerate(patterns):
        if isinstance(p, P.TopK):  # the keys scoring at least the k-th best
            allowed = jnp.tril(jnp.ones((n, n), bool)) if p.is_causal else jnp.ones((n, n), bool)
            group = jnp.where(allowed, scores[:, g * per : (g + 1) * per], -jnp.inf)
            kth = jax.lax.top_k(group, min(p.k, n))[0][..., -1:]
            masks.append(allowed & (group >= kth))
        else:
            masks.append(jnp.broadcast_to(jnp.asarray(p.mask(n)), (1, per, n, n)))
    mask = jnp.concatenate(
        [jnp.broadcast_to(m, (scores.shape[0], per, n, n)) for m in masks], axis=1
    )
    if segments is not None:
        mask = mask & segment_mask(segments[:, :, None], segments[:, None, :])[:, None]
    return attention_weights(query, key, mask, score_fn=lambda q, k: scores)


def decode_mask(patterns: list[P.Pattern], q_pos: Array, k_pos: Array, n: int) -> Array:
    """``[1, h_groups->h, q, k]`` mask of the patterns for cached decoding steps."""
    if any(isinstance(p, P.TopK) for p in patterns):
        raise PatternSpecError(
            "cached decoding is not implemented for topk attention: its keys depend on "
            "the scores; evaluate perplexity, or train with a static pattern to generate"
        )
    masks = [p.allows(q_pos[:, None], k_pos[None, :], n) for p in patterns]
    return jnp.stack(masks)[None]  # [1, groups, q, k]; the caller repeats per head
