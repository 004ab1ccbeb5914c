"""Is learned attention mostly sparse? The share of each head's attention mass inside
local windows, the top-k keys and BigBird's pattern, on two trained runs.

  .venv/bin/python experiments/attention_sparsity/run.py \\
      [--translation=runs/ende_fixed] [--lm=runs/lm_kjv] [--texts=100]

The translation run is the demo's (configs/ende_small.py at its fixed 1,560 steps,
experiments/translation_recipe); its texts are the first ``--texts`` validation
sentences of ding_de_en, each translated by the run (beam 4) and read back with the
weights sown. The language model is configs/lm_small.py on the KJV (``--lm``, trained
by the command in this folder's README); its texts are the validation books' verses
joined into passages of about 100 pieces. For every attention module and head:
``inference/diagnostics.py``'s entropy, mean distance, largest logit and the mass
inside each pattern below, averaged over the texts by their numbers of queries; and,
for scale, the mass the same patterns hold of *uniform* attention over the same texts
(a pattern covering 30% of the keys keeps 30% of a uniform head). Writes
results.json, table.md and sparsity.png here; ``--report`` redraws the last two from
results.json alone (a fresh clone, no trained runs).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.data.sources import load_texts  # noqa: E402
from flaxformer_lite.inference import diagnostics  # noqa: E402
from flaxformer_lite.inference.attention_maps import attention_maps  # noqa: E402
from flaxformer_lite.inference.translate import Translator  # noqa: E402

WINDOWS = (1, 2, 4, 8, 16)
TOPK = (1, 2, 4, 8, 16)
BIGBIRD = "bigbird:block=4,window=3,global=1,random=1"
PATTERNS = (
    *(f"local:window={w}" for w in WINDOWS),
    *(f"topk:k={k}" for k in TOPK),
    BIGBIRD,
)
KINDS = {"encoder": "encoder self", "decoder": "decoder self", "cross": "cross"}


MODULES = {"encoder": ("encoder", "self_attention"), "decoder": ("decoder", "self_attention"),
           "cross": ("decoder", "cross_attention")}  # fmt: skip


def sown(maps, uniform: bool = False) -> dict:
    """A text's weights (and largest logits) as a model's sown intermediates; with
    ``uniform``, attention spread evenly over the keys each query may see instead."""
    out = {}
    for kind, w in maps.weights.items():
        if uniform:
            allowed = np.ones_like(w) if kind != "decoder" else np.tril(np.ones(w.shape[-2:]))
            w = np.broadcast_to(allowed, w.shape) / np.broadcast_to(allowed, w.shape).sum(
                -1, keepdims=True
            )
        stack, module = MODULES[kind]
        for layer, weights in enumerate(w):
            node = {"attention_weights": (weights[None],)}
            if not uniform:
                node["attention_max_logit"] = (maps.max_logits[kind][layer][None],)
            out.setdefault(stack, {}).setdefault(f"layer_{layer}", {})[module] = node
    return out


def stats_of(translator, texts: list[str]) -> tuple[dict, dict]:
    """(learned, uniform) statistics over ``texts``, each text read once, averaged by
    its number of queries."""
    learned, uniform, counts = [], [], []
    for text in texts:
        maps = attention_maps(translator, text)
        learned.append(diagnostics.module_stats(sown(maps), patterns=PATTERNS))
        uniform.append(diagnostics.module_stats(sown(maps, uniform=True), patterns=PATTERNS))
        counts.append(len(maps.source_pieces) + len(maps.decoder_pieces))
    return diagnostics.average(learned, counts), diagnostics.average(uniform, counts)


def passages(texts: list[str], tokenizer, pieces: int = 100) -> list[str]:
    """Consecutive verses joined until a passage holds about ``pieces`` pieces."""
    out, current = [], []
    for t in texts:
        current.append(t)
        if len(tokenizer.encode(" ".join(current))) >= pieces:
            out.append(" ".join(current))
            current = []
    return out


def summary(stats: dict) -> dict:
    """Per attention kind: each statistic's mean over modules and heads, and its range
    over heads."""
    out = {}
    for module, by in stats.items():
        kind = "encoder" if module.startswith("encoder") else (
            "cross" if "cross" in module else "decoder")  # fmt: skip
        entry = out.setdefault(kind, {})
        for name, values in by.items():
            entry.setdefault(name, []).extend(np.asarray(values).tolist())
    return {
        kind: {
            n: {"mean": float(np.mean(v)), "min": float(np.min(v)), "max": float(np.max(v))}
            for n, v in by.items()
        }  # fmt: skip
        for kind, by in out.items()
    }


def measure(workdir: str, texts: list[str]) -> dict:
    translator = Translator.from_workdir(workdir)
    learned, uniform = stats_of(translator, texts)
    return {
        "workdir": workdir,
        "texts": len(texts),
        "learned": summary(learned),
        "uniform": summary(uniform),
        "heads": {
            m: {n: np.asarray(v).tolist() for n, v in by.items()} for m, by in learned.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--translation", default="runs/ende_fixed")
    parser.add_argument("--lm", default="runs/lm_kjv")
    parser.add_argument("--texts", type=int, default=100)
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument(
        "--report", action="store_true", help="redraw table.md and sparsity.png from results.json"
    )
    args = parser.parse_args()
    if args.report:
        result = json.loads((HERE / "results.json").read_text())
        write_table(result)
        draw(result)
        return
    result = {"patterns": list(PATTERNS)}
    sentences = [p[0] for p in load_texts("ding_de_en", "validation", ("en",), args.data_dir)]
    result["translation"] = measure(args.translation, sentences[: args.texts])
    print("translation: done", flush=True)
    if Path(args.lm).is_dir():
        lm = Translator.from_workdir(args.lm)
        verses = [v[0] for v in load_texts("bible_en_es", "validation", ("en",), args.data_dir)]
        result["lm"] = measure(args.lm, passages(verses, lm.tokenizer)[: args.texts])
        print("lm: done", flush=True)
    (HERE / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    write_table(result)
    draw(result)


def write_table(result: dict) -> None:
    lines = [
        "| run | attention | entropy (nats) | distance | "
        + " | ".join(f"in local w={w}" for w in WINDOWS[1::2])
        + " | " + " | ".join(f"in top-{k}" for k in TOPK[1::2])
        + " | in BigBird |",
        "|---|---|" + "---:|" * (2 + len(WINDOWS[1::2]) + len(TOPK[1::2]) + 1),
    ]  # fmt: skip
    for run in ("translation", "lm"):
        if run not in result:
            continue
        learned, uniform = result[run]["learned"], result[run]["uniform"]
        for kind in ("encoder", "decoder", "cross"):
            if kind not in learned:
                continue
            got, base = learned[kind], uniform[kind]

            def cell(name, got=got, base=base):
                if name not in got:
                    return "—"
                return f"{got[name]['mean']:.2f} ({base[name]['mean']:.2f})"

            names = [f"mass_in:local:window={w}" for w in WINDOWS[1::2]]
            names += [f"mass_in:topk:k={k}" for k in TOPK[1::2]] + [f"mass_in:{BIGBIRD}"]
            lines.append(
                f"| {run} | {KINDS[kind]} | {cell('entropy')} | {cell('distance')} | "
                + " | ".join(cell(n) for n in names) + " |"
            )  # fmt: skip
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draw(result: dict) -> None:
    runs = [r for r in ("translation", "lm") if r in result]
    fig, axes = plt.subplots(len(runs), 2, figsize=(10, 3.4 * len(runs)), squeeze=False)
    for row, run in enumerate(runs):
        learned, uniform = result[run]["learned"], result[run]["uniform"]
        for col, (label, sizes, name) in enumerate(
            [
                ("local window w", WINDOWS, "mass_in:local:window={}"),
                ("top-k keys", TOPK, "mass_in:topk:k={}"),
            ]  # fmt: skip
        ):
            ax = axes[row][col]
            for kind, colour in (("encoder", "C0"), ("decoder", "C1")):
                if kind not in learned:
                    continue
                got = [learned[kind][name.format(s)]["mean"] for s in sizes]
                lo = [learned[kind][name.format(s)]["min"] for s in sizes]
                base = [uniform[kind][name.format(s)]["mean"] for s in sizes]
                ax.plot(sizes, got, "o-", color=colour, label=f"{KINDS[kind]}: learned (mean)")
                ax.plot(sizes, lo, ":", color=colour, label=f"{KINDS[kind]}: lowest head")
                ax.plot(sizes, base, "--", color=colour, alpha=0.5, label=f"{KINDS[kind]}: uniform")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel(label)
            ax.set_ylabel("share of attention mass")
            ax.set_title(f"{run} ({result[run]['texts']} texts)", fontsize=9)
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(HERE / "sparsity.png", dpi=100)


if __name__ == "__main__":
    main()
