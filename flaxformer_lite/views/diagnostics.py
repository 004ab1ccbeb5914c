"""Attention diagnostics: per layer and head, how attention is spread, and how much of
it a sparse pattern would keep.

For weights ``p [q, k]`` of one head (a softmax row per query), over the queries that
attend anywhere:

* ``entropy``: mean over queries of ``-sum_j p_ij log p_ij`` (nats; 0 = one key,
  ``log k`` = uniform);
* ``distance``: mean over queries of ``sum_j p_ij |i - j|`` (self-attention only);
* ``max_logit``: the largest pre-softmax score of the head (saturation shows here);
* ``mass_in[name]``: mean over queries of the weight inside a pattern: a sparse
  pattern spec (``local:window=8``, ``bigbird:block=4``, the causal variant in a
  causal decoder), or ``topk:k=8`` (each query's 8 largest weights). Self-attention
  only; "attention is mostly sparse" means these are close to 1 for small patterns.

:func:`head_stats` computes them from arrays; :func:`run_stats` for a trained run on
given sentences (the ``diagnostics`` command: a table and a figure); training logs
them every ``train.attention_stats_every`` steps (``training/train.py``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from flaxformer_lite.inference.streaming import read_lines
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar.spec import parse_spec
from flaxformer_lite.views.attention_maps import attention_maps
from flaxformer_lite.workdir import location, storage

STATS = ("entropy", "distance", "max_logit")


def _pattern_mask(spec: str, q: int, k: int, causal: bool) -> np.ndarray | None:
    """``[q, k]`` bool mask of a static pattern spec (one pattern for every head), or
    None for a top-k spec (dynamic, computed from the weights)."""
    (pattern,) = parse_spec(spec, block_size=max(1, _spec_block(spec)))[0]
    if isinstance(pattern, D.TopK):
        return None
    if isinstance(pattern, D.Dynamic):
        raise ValueError(
            f"--pattern={spec}: its blocks are routed from the model's queries and keys, "
            "not from the weights; measure static patterns or topk:k=K"
        )
    pattern = pattern.causal() if causal else pattern
    n = max(q, k)
    return np.asarray(pattern.mask(n))[:q, :k]


def _spec_block(spec: str) -> int:
    """The block size a pattern spec names (``block=B``), else 4."""
    for part in spec.replace(":", ",").split(","):
        if part.startswith("block="):
            return int(part.split("=")[1])
    return 4


def head_stats(
    weights: np.ndarray,
    max_logits: np.ndarray | None = None,
    *,
    patterns: Sequence[str] = (),
    self_attention: bool = True,
    causal: bool = False,
) -> dict[str, np.ndarray]:
    """Statistics of ``weights [b, h, q, k]`` (``max_logits [b, h, q]``) per head:
    each a ``[h]`` array (see the module docstring); ``mass_in:<spec>`` per pattern
    (self-attention only). Queries with no weight (padding) are left out."""
    w = np.asarray(weights, np.float64)
    b, h, q, k = w.shape
    live = w.sum(-1) > 0.5  # [b, h, q]: queries that attend (padding rows are all zero)

    def mean(x):  # over the live queries of each head
        return np.where(live, x, 0).sum((0, 2)) / np.maximum(live.sum((0, 2)), 1)

    logs = np.log(np.where(w > 0, w, 1.0))
    out = {"entropy": mean(-(w * logs).sum(-1))}
    if self_attention:
        gap = np.abs(np.arange(q)[:, None] - np.arange(k)[None, :])
        out["distance"] = mean((w * gap).sum(-1))
    if max_logits is not None:
        m = np.where(live, np.asarray(max_logits, np.float64), -np.inf)
        out["max_logit"] = m.max((0, 2))
    if self_attention:
        for spec in patterns:
            mask = _pattern_mask(spec, q, k, causal)
            if mask is None:  # topk:k=K: the K largest weights of each query
                kk = int(spec.partition("=")[2] or 64)
                inside = -np.sort(-w, axis=-1)[..., :kk].sum(-1)
            else:
                inside = (w * mask).sum(-1)
            out[f"mass_in:{spec}"] = mean(inside)
    return out


def module_stats(
    intermediates: dict, *, patterns: Sequence[str] = (), causal_decoder: bool = True
) -> dict[str, dict[str, np.ndarray]]:
    """Statistics of every attention module in a model's sown ``intermediates``:
    ``{"encoder/layer_0/self_attention": {stat: [h]}, ...}`` (weights averaged over the
    batch's live queries)."""
    out = {}

    def visit(node, path):
        if isinstance(node, dict) and "attention_weights" in node:
            (weights,) = node["attention_weights"]
            (logits,) = node.get("attention_max_logit", (None,))
            kind = path[-1]
            out["/".join(path)] = head_stats(
                np.asarray(weights), None if logits is None else np.asarray(logits),
                patterns=patterns, self_attention=kind == "self_attention",
                causal=causal_decoder and path[0] == "decoder",
            )  # fmt: skip
            return
        if isinstance(node, dict):
            for name, child in node.items():
                visit(child, (*path, name))

    visit(intermediates, ())
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(path: str) -> tuple:
    """Encoder first, then the decoder; by layer; self-attention before cross."""
    stack, layer, kind = (path.split("/") + ["", "", ""])[:3]
    return (stack != "encoder", int(layer.rpartition("_")[2] or 0), kind != "self_attention")


def flat(stats: dict[str, dict[str, np.ndarray]]) -> dict[str, float]:
    """``{"<module>/head_<h>/<stat>": value}``: scalars for a metrics log."""
    return {
        f"{module}/head_{h}/{name}": float(v)
        for module, by in stats.items()
        for name, values in by.items()
        for h, v in enumerate(values)
    }


def table(stats: dict[str, dict[str, np.ndarray]]) -> str:
    """A markdown table: a row per module and head, a column per statistic."""
    names = sorted({n for by in stats.values() for n in by}, key=_stat_order)
    lines = [
        "| attention | head | " + " | ".join(names) + " |",
        "|---|---:|" + "---:|" * len(names),
    ]
    for module, by in stats.items():
        heads = len(next(iter(by.values())))
        for h in range(heads):
            cells = [f"{by[n][h]:.3f}" if n in by else "—" for n in names]
            lines.append(f"| {module} | {h} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _stat_order(name: str) -> tuple:
    return (STATS.index(name) if name in STATS else len(STATS), name)


def draw(stats: dict[str, dict[str, np.ndarray]], path: location.Path, title: str = "") -> None:
    """One panel per statistic: modules down, heads across, the value as colour."""
    from matplotlib.figure import Figure  # no pyplot: a notebook's backend stays as it is

    names = sorted({n for by in stats.values() for n in by}, key=_stat_order)
    modules = list(stats)
    heads = max(len(next(iter(by.values()))) for by in stats.values())
    fig = Figure(figsize=(2.2 * len(names) + 2, 0.35 * len(modules) + 1.5))
    axes = fig.subplots(1, len(names), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        grid = np.full((len(modules), heads), np.nan)
        for r, m in enumerate(modules):
            if name in stats[m]:
                grid[r, : len(stats[m][name])] = stats[m][name]
        image = ax.imshow(grid, aspect="auto", cmap="viridis")
        ax.set_title(name.replace("mass_in:", "in "), fontsize=8)
        ax.set_xticks(range(heads))
        ax.set_xlabel("head", fontsize=8)
        ax.set_yticks(range(len(modules)), modules if ax is axes[0][0] else [""] * len(modules),
                      fontsize=7)  # fmt: skip
        fig.colorbar(image, ax=ax, fraction=0.05)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    storage.save_figure(fig, path, dpi=100)


def average(per_text: list[dict[str, dict[str, np.ndarray]]], counts: list[int]):
    """The statistics of several texts, each weighted by its ``counts`` (queries); the
    largest logit is the maximum."""
    out: dict[str, dict[str, np.ndarray]] = {}
    total = float(sum(counts))
    for stats, n in zip(per_text, counts, strict=True):
        for module, by in stats.items():
            acc = out.setdefault(module, {})
            for name, values in by.items():
                if name == "max_logit":
                    acc[name] = np.maximum(acc.get(name, -np.inf), values)
                else:
                    acc[name] = acc.get(name, 0.0) + values * (n / total)
    return out


def run_stats(
    translator, texts: Sequence[str], patterns: Sequence[str] = (), **decode_options
) -> dict[str, dict[str, np.ndarray]]:
    """The statistics of a trained run (a :class:`Translator`) on ``texts``: each text
    translated (or, for a language model, read), its attention sown, then averaged over
    the texts by their numbers of queries."""
    per_text, counts = [], []
    for text in texts:
        maps = attention_maps(translator, text, **decode_options)
        intermediates = {}
        for kind, weights in maps.weights.items():
            stack, module = (("encoder", "self_attention") if kind == "encoder" else
                             ("decoder", "self_attention" if kind == "decoder"
                              else "cross_attention"))  # fmt: skip
            for layer, w in enumerate(weights):
                node = {"attention_weights": (w[None],)}
                if kind in maps.max_logits:
                    node["attention_max_logit"] = (maps.max_logits[kind][layer][None],)
                intermediates.setdefault(stack, {}).setdefault(f"layer_{layer}", {})[module] = node
        per_text.append(module_stats(intermediates, patterns=patterns))
        counts.append(len(maps.source_pieces) + len(maps.decoder_pieces))
    return average(per_text, counts)


def write_report(stats, output: location.Path, title: str) -> dict[str, Any]:
    """``<output>.md`` (the table), ``.json`` (the values) and ``.png`` (the figure)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(output.with_suffix(".md"), f"{title}\n\n{table(stats)}\n")
    values = {m: {n: np.asarray(v).tolist() for n, v in by.items()} for m, by in stats.items()}
    storage.write_atomic(output.with_suffix(".json"), json.dumps(values, indent=2))
    draw(stats, output.with_suffix(".png"), title)
    return values


def main(workdir, texts, input_path, patterns, output, **decode_options) -> None:
    """``main diagnostics``: per-head attention statistics of a run over some texts
    (the arguments, or the lines of ``input_path``)."""
    lines = read_lines(list(texts), input_path, "texts", Counter())
    texts = [t for t in lines if t.strip()]
    translator = Translator.from_workdir(workdir)
    stats = run_stats(translator, texts, patterns, **decode_options)
    if output:
        output = location.check(output, "--output")
    else:
        output = location.path(workdir) / "diagnostics" / "attention_stats"
    write_report(stats, output, f"{workdir}: attention statistics over {len(texts)} text(s)")
    print(table(stats))
    print(f"wrote {output}.md, .json and .png")
