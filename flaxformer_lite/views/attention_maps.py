"""Attention pictures of one sentence: every layer and head of a trained run.

  python -m flaxformer_lite.main attention --workdir=runs/ende_small "Where is the station?"

translates the sentence (the run's decoding settings, or the decoding flags),
runs the model once more on (source, translation) with its attention weights
stored (``--target``: on this translation instead of its own), and writes

* ``<output>.png``: a grid with a row per layer of each kind (encoder
  self-attention, decoder self-attention, encoder-decoder "cross" attention)
  and a column per head; queries down, keys across, the sentencepiece pieces
  on the axes. Colour is the weight, 0 to 1, the same scale in every panel.
* ``<output>.html``: one self-contained page (data and script inline, no
  server, no network) to flip through kinds, layers and heads (or their
  mean): the pieces as two columns joined by lines whose opacity is the
  weight, and the weight matrix; hovering a piece shows where it attends
  (or, on the key side, what attends to it). ``page.html#kind=cross&layer=1&head=0&query=3``
  opens at that view.

Decoder rows are the decoder's inputs (``<s>`` and the translation shifted
right): the query at row ``i`` predicts piece ``i`` of the translation. For a
language-model run the text itself is fed and only decoder self-attention
exists. Sparse self-attention is shown as the dense weights its pattern allows.
"""

from __future__ import annotations

import dataclasses
import html
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.inference.translate import TranslateError, Translator
from flaxformer_lite.model.build import build_model
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.layer_layout import unrolled

KINDS = {"encoder": "encoder self", "decoder": "decoder self", "cross": "cross"}
BOS_PIECE, EOS_PIECE = "<s>", "</s>"


@dataclasses.dataclass(frozen=True)
class AttentionMaps:
    """The attention weights of one (source, output) pair.

    ``weights[kind]`` is ``[layers, heads, queries, keys]`` for kind in
    ``encoder`` | ``decoder`` | ``cross`` (those the model has); ``axes(kind)``
    gives the pieces along queries and keys.
    """

    text: str
    output: str  # the translation ('' for a language model)
    source_pieces: tuple[str, ...]  # encoder input (translation runs)
    decoder_pieces: tuple[str, ...]  # decoder input: <s> + output shifted right
    weights: dict[str, np.ndarray]
    # [layers, heads, queries]: each query's largest pre-softmax score, by kind
    max_logits: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    def axes(self, kind: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return {
            "encoder": (self.source_pieces, self.source_pieces),
            "decoder": (self.decoder_pieces, self.decoder_pieces),
            "cross": (self.decoder_pieces, self.source_pieces),
        }[kind]


def _pieces(tokenizer, ids) -> list[str]:
    out = []
    for i in np.asarray(ids).tolist():
        out.append(EOS_PIECE if i == 1 else tokenizer.id_to_piece(int(i)))
    return out


def _stack(layers: dict, kind: str, name: str = "attention_weights") -> np.ndarray:
    """``[layers, heads, q, k]`` from ``{"layer_0": {kind: {name: (w,)}}}`` (``name``:
    the sown weights, or ``attention_max_logit`` ``[layers, heads, q]``)."""
    names = sorted(layers, key=lambda n: int(n.rpartition("_")[2]))
    return np.stack([np.asarray(layers[n][kind][name][0][0]) for n in names])


def attention_maps(
    translator: Translator, text: str, target: str | None = None, **decode_options
) -> AttentionMaps:
    """Translate ``text`` (or, for a language model, take it as it is) and read every
    layer's and head's attention weights on the result. ``target``: draw the model
    reading this translation (a reference, say) instead of its own."""
    text = text.strip()
    if not text:
        raise TranslateError("the sentence to draw is empty; give a sentence")
    params = translator.params
    if isinstance(params, tuple):  # an ensemble: its first member
        params = params[0]
    config, params = unrolled(translator.config, params)  # each layer by its name
    config = dataclasses.replace(config, sow_attention_weights=True)
    tokenizer = translator.tokenizer
    lm = translator.run is not None and translator.run.is_lm
    model = build_model(config, "lm" if lm else "translation")
    ids = tokenizer.encode(text)
    if len(ids) > config.max_len:
        raise TranslateError(
            f"the sentence has {len(ids)} pieces, more than model.max_len={config.max_len}; "
            "draw a shorter one"
        )
    if lm:
        output, targets = "", ids
        _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, mutable=["intermediates"]))(
            params, jnp.asarray(ids)[None]
        )
        source = ()
    else:
        options = {k: v for k, v in decode_options.items() if v is not None}
        output = target.strip() if target else translator.translate([text], **options)[0]
        targets = tokenizer.side(1).encode(output)[: config.max_len]
        _, state = jax.jit(
            lambda p, s, t: model.apply({"params": p}, s, t, mutable=["intermediates"])
        )(params, jnp.asarray(ids)[None], jnp.asarray(targets)[None])
        source = tuple(_pieces(tokenizer, ids))
    found = state["intermediates"]
    where = {"decoder": ("decoder", "self_attention")}
    if "encoder" in found:
        where |= {"encoder": ("encoder", "self_attention"), "cross": ("decoder", "cross_attention")}
    weights = {k: _stack(found[stack], module) for k, (stack, module) in where.items()}
    logits = {
        k: _stack(found[stack], module, "attention_max_logit")
        for k, (stack, module) in where.items()
    }
    decoder = (BOS_PIECE, *_pieces(tokenizer, targets[:-1]))
    return AttentionMaps(text, output, source, decoder, weights, logits)


# The PNG grid ------------------------------------------------------------------------
def draw_grid(maps: AttentionMaps, path) -> location.Path:
    """Every (kind, layer) a row, every head a column; pieces on the axes."""
    rows = [(kind, layer) for kind in maps.weights for layer in range(len(maps.weights[kind]))]
    heads = max(w.shape[1] for w in maps.weights.values())
    longest = max(max(len(q), len(k)) for q, k in map(maps.axes, maps.weights))
    cell = max(2.2, 0.16 * longest + 0.8)  # inches per panel
    # matplotlib's Figure, not pyplot: imported when drawn (a training process that
    # never draws does not pay for it), and a notebook's backend stays as it is.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(cell * heads, cell * len(rows)))
    axes = fig.subplots(len(rows), heads, squeeze=False)
    for r, (kind, layer) in enumerate(rows):
        queries, keys = maps.axes(kind)
        for h in range(heads):
            ax = axes[r][h]
            if h >= maps.weights[kind].shape[1]:
                ax.axis("off")
                continue
            ax.imshow(maps.weights[kind][layer, h], cmap="Blues", vmin=0.0, vmax=1.0)
            ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=6)
            ax.set_yticks(range(len(queries)), queries, fontsize=6)
            if r == 0:
                ax.set_title(f"head {h}", fontsize=9)
            if h == 0:
                ax.set_ylabel(f"{KINDS[kind]}\nlayer {layer}", fontsize=9)
    title = maps.text if not maps.output else f"{maps.text}  →  {maps.output}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = location.path(path, "--output")
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.save_figure(fig, path, dpi=110)
    return path


# The HTML page -----------------------------------------------------------------------
def page_data(maps: AttentionMaps) -> dict:
    """What the page draws: per kind, its pieces and weights rounded to 1e-4."""
    kinds = {}
    for kind, w in maps.weights.items():
        queries, keys = maps.axes(kind)
        kinds[kind] = {
            "label": KINDS[kind],
            "queries": list(queries),
            "keys": list(keys),
            "weights": np.round(w.astype(np.float64), 4).tolist(),
        }
    return {"text": maps.text, "output": maps.output, "kinds": kinds}


# The page: an HTML file of the package, ``__TITLE__`` and ``__DATA__`` filled in.
PAGE_TEMPLATE = Path(__file__).with_name("attention_page.html")


def write_page(maps: AttentionMaps, path) -> location.Path:
    """The self-contained HTML viewer (:data:`PAGE_TEMPLATE`) with the maps' data inline."""
    data = json.dumps(page_data(maps), ensure_ascii=False).replace("</", "<\\/")
    title = maps.text if not maps.output else f"{maps.text} → {maps.output}"
    page = (
        PAGE_TEMPLATE.read_text(encoding="utf-8")
        .replace("__TITLE__", html.escape(title))
        .replace("__DATA__", data)
    )
    path = location.path(path, "--output")
    path.parent.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(path, page)
    return path


def main(
    workdir: str,
    texts: list[str],
    output: str | None,
    target: str | None = None,
    **decode_options,
) -> list[location.Path]:
    """The ``attention`` command: PNG and HTML of the (one) sentence in ``texts``."""
    if len(texts) != 1:
        raise TranslateError(
            f"attention draws one sentence; got {len(texts)} arguments (quote the sentence)"
        )
    translator = Translator.from_workdir(workdir)
    maps = attention_maps(translator, texts[0], target, **decode_options)
    if output:
        prefix = location.check(output, "--output")
    else:
        prefix = location.path(workdir) / "attention" / "attention"
    written = [
        draw_grid(maps, prefix.with_name(prefix.name + ".png")),
        write_page(maps, prefix.with_name(prefix.name + ".html")),
    ]
    if maps.output:
        print(f"{maps.text} -> {maps.output}")
    for path in written:
        print(f"wrote {path}")
    return written


__all__ = ["AttentionMaps", "attention_maps", "draw_grid", "page_data", "write_page"]
