"""Is learned attention mostly sparse? The share of each head's attention mass inside
local windows, the top-k keys and BigBird's pattern, on trained runs of two models,
several seeds each.

  .venv/bin/python experiments/attention_sparsity/run.py \\
      [--translation RUN [RUN ...]] [--lm RUN [RUN ...]] [--texts=100] [--report]

The translation runs are the demo's (configs/ende_small.py at its fixed 1,560 steps,
experiments/translation_recipe); their texts are the first ``--texts`` validation
sentences of ding_de_en, each translated by the run (beam 4) and read back with the
weights sown. The language models are configs/lm_small.py on the KJV (trained by the
commands in this folder's README); their texts are the validation books' verses joined
into passages of about 100 pieces. For every attention module and head:
``inference/diagnostics.py``'s entropy, mean distance, largest logit and the mass
inside each pattern below, averaged over the texts by their numbers of queries; and,
for scale, the mass the same patterns hold of *uniform* attention over the same texts
(a pattern covering 30% of the keys keeps 30% of a uniform head).

Each measured run is filed in results.json under its model and training seed,
replacing an earlier entry of the same seed, so seeds can be measured one at a time;
table.md and sparsity.png give the mean +- std over the seeds filed. ``--report``
redraws those two from results.json alone (a fresh clone, no trained runs).
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
from flaxformer_lite.inference.translate import Translator  # noqa: E402
from flaxformer_lite.views import diagnostics  # noqa: E402
from flaxformer_lite.views.attention_maps import attention_maps  # noqa: E402

WINDOWS = (1, 2, 4, 8, 16)
TOPK = (1, 2, 4, 8, 16)
BIGBIRD = "bigbird:block=4,window=3,global=1,random=1"
PATTERNS = (
    *(f"local:window={w}" for w in WINDOWS),
    *(f"topk:k={k}" for k in TOPK),
    BIGBIRD,
)
KINDS = {"encoder": "encoder self", "decoder": "decoder self", "cross": "cross"}
MODEL_NAMES = {"translation": "translation", "lm": "language model"}


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


def last_validation(workdir: Path) -> dict:
    """The run's last validation record (step, perplexity, and BLEU where it scored it)."""
    path = Path(workdir) / "metrics.jsonl"
    records = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    records = [r for r in records if r.get("split") == "validation"]
    if not records:
        return {}
    return {k: records[-1][k] for k in ("step", "perplexity", "bleu") if k in records[-1]}


def measure(translator, texts: list[str]) -> dict:
    learned, uniform = stats_of(translator, texts)
    return {
        "workdir": str(translator.run.workdir),
        "seed": int(translator.run.config.train.seed),
        "checkpoint": translator.checkpoint,
        "validation": last_validation(translator.run.workdir),
        "texts": len(texts),
        "learned": summary(learned),
        "uniform": summary(uniform),
        "heads": {
            m: {n: np.asarray(v).tolist() for n, v in by.items()} for m, by in learned.items()
        },
    }


def file_run(result: dict, model: str, entry: dict) -> None:
    """Put ``entry`` in ``result``'s runs of ``model``, replacing the same seed's."""
    runs = [r for r in result["runs"].get(model, []) if r["seed"] != entry["seed"]]
    result["runs"][model] = sorted([*runs, entry], key=lambda r: r["seed"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--translation", nargs="*", default=[], help="trained ende_small runs")
    parser.add_argument("--lm", nargs="*", default=[], help="trained lm_small runs")
    parser.add_argument("--texts", type=int, default=100)
    parser.add_argument("--data_dir", default="data/tfds")
    parser.add_argument(
        "--report", action="store_true", help="redraw table.md and sparsity.png from results.json"
    )
    args = parser.parse_args()
    path = HERE / "results.json"
    result = json.loads(path.read_text()) if path.exists() else {}
    result.setdefault("patterns", list(PATTERNS))
    result.setdefault("runs", {})
    if not args.report:
        for workdir in [*args.translation, *args.lm]:
            if not Path(workdir, "config.json").is_file():
                sys.exit(
                    f"error: {workdir} is not a trained run (no config.json); train it with "
                    "the commands in experiments/attention_sparsity/README.md"
                )
        if args.translation:
            pairs = load_texts("ding_de_en", "validation", ("en",), args.data_dir)
            sentences = [p[0] for p in pairs][: args.texts]
            for workdir in args.translation:
                translator = Translator.from_workdir(workdir)
                file_run(result, "translation", measure(translator, sentences))
                print(f"translation {workdir}: done", flush=True)
        if args.lm:
            verses = [v[0] for v in load_texts("bible_en_es", "validation", ("en",), args.data_dir)]
            for workdir in args.lm:
                lm = Translator.from_workdir(workdir)
                file_run(result, "lm", measure(lm, passages(verses, lm.tokenizer)[: args.texts]))
                print(f"lm {workdir}: done", flush=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(path)
    write_table(result)
    draw(result)


def over_seeds(runs: list[dict], side: str, kind: str, name: str, of: str = "mean"):
    """(mean, std) over ``runs`` of one statistic's ``of`` (mean / min / max over heads),
    or None where a run lacks it."""
    values = [r[side][kind][name][of] for r in runs if name in r[side].get(kind, {})]
    if len(values) < len(runs) or not values:
        return None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


NAMES = (
    ["entropy", "distance"]
    + [f"mass_in:local:window={w}" for w in WINDOWS[1::2]]
    + [f"mass_in:topk:k={k}" for k in TOPK[1::2]]
    + [f"mass_in:{BIGBIRD}"]
)


def write_table(result: dict) -> None:
    lines = [
        "Each cell: the mean over seeds of a statistic's mean over modules and heads, "
        "+- its std over seeds; in parentheses, what the same pattern keeps of uniform "
        "attention over the same texts.",
        "",
        "| run | attention | seeds | entropy (nats) | distance | "
        + " | ".join(f"in local w={w}" for w in WINDOWS[1::2])
        + " | " + " | ".join(f"in top-{k}" for k in TOPK[1::2])
        + " | in BigBird |",
        "|---|---|---:|" + "---:|" * len(NAMES),
    ]  # fmt: skip
    for model in ("translation", "lm"):
        runs = result["runs"].get(model, [])
        if not runs:
            continue
        for kind in ("encoder", "decoder", "cross"):
            if kind not in runs[0]["learned"]:
                continue

            def cell(name, runs=runs, kind=kind):
                got = over_seeds(runs, "learned", kind, name)
                base = over_seeds(runs, "uniform", kind, name)
                if got is None:
                    return "—"
                digits = 1 if name == "distance" else 2
                return f"{got[0]:.{digits}f} ± {got[1]:.{digits}f} ({base[0]:.{digits}f})"

            lines.append(
                f"| {MODEL_NAMES[model]} | {KINDS[kind]} | {len(runs)} | "
                + " | ".join(cell(n) for n in NAMES) + " |"
            )  # fmt: skip
    lines += [
        "",
        "The runs measured: their last validation (perplexity; BLEU for translation).",
        "",
        "| run | seed | checkpoint | validation perplexity | validation BLEU |",
        "|---|---:|---|---:|---:|",
    ]
    for model in ("translation", "lm"):
        for r in result["runs"].get(model, []):
            v = r.get("validation", {})
            ppl = f"{v['perplexity']:.1f}" if "perplexity" in v else "—"
            bleu = f"{v['bleu']:.2f}" if "bleu" in v else "—"
            lines.append(
                f"| {MODEL_NAMES[model]} | {r['seed']} | {r.get('checkpoint') or '—'} | {ppl} | "
                f"{bleu} |"
            )
    lines += [
        "",
        "Per head, over all seeds: the lowest and highest head's share (uniform's in parentheses).",
        "",
        "| run | attention | in top-2 | in top-8 | in local w=8 | in BigBird |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for model in ("translation", "lm"):
        runs = result["runs"].get(model, [])
        for kind in ("encoder", "decoder"):
            if not runs or kind not in runs[0]["learned"]:
                continue
            cells = []
            for name in ("mass_in:topk:k=2", "mass_in:topk:k=8", "mass_in:local:window=8",
                         f"mass_in:{BIGBIRD}"):  # fmt: skip
                lo = min(r["learned"][kind][name]["min"] for r in runs)
                hi = max(r["learned"][kind][name]["max"] for r in runs)
                base = np.mean([r["uniform"][kind][name]["mean"] for r in runs])
                cells.append(f"{lo:.2f}-{hi:.2f} ({base:.2f})")
            lines.append(f"| {MODEL_NAMES[model]} | {KINDS[kind]} | " + " | ".join(cells) + " |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draw(result: dict) -> None:
    models = [m for m in ("translation", "lm") if result["runs"].get(m)]
    fig, axes = plt.subplots(len(models), 2, figsize=(10, 3.4 * len(models)), squeeze=False)
    for row, model in enumerate(models):
        runs = result["runs"][model]
        for col, (label, sizes, name) in enumerate(
            [
                ("local window w", WINDOWS, "mass_in:local:window={}"),
                ("top-k keys", TOPK, "mass_in:topk:k={}"),
            ]  # fmt: skip
        ):
            ax = axes[row][col]
            for kind, colour in (("encoder", "C0"), ("decoder", "C1")):
                if kind not in runs[0]["learned"]:
                    continue
                got = [over_seeds(runs, "learned", kind, name.format(s)) for s in sizes]
                lo = [over_seeds(runs, "learned", kind, name.format(s), "min")[0] for s in sizes]
                base = [over_seeds(runs, "uniform", kind, name.format(s))[0] for s in sizes]
                ax.errorbar(sizes, [g[0] for g in got], yerr=[g[1] for g in got], fmt="o-",
                            color=colour, capsize=3,
                            label=f"{KINDS[kind]}: learned (mean ± std over seeds)")  # fmt: skip
                ax.plot(sizes, lo, ":", color=colour, label=f"{KINDS[kind]}: lowest head (mean)")
                ax.plot(sizes, base, "--", color=colour, alpha=0.5, label=f"{KINDS[kind]}: uniform")
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.02)
            ax.set_xlabel(label)
            ax.set_ylabel("share of attention mass")
            seeds = ", ".join(str(r["seed"]) for r in runs)
            ax.set_title(f"{MODEL_NAMES[model]}: seeds {seeds}, {runs[0]['texts']} texts",
                         fontsize=9)  # fmt: skip
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(HERE / "sparsity.png", dpi=100)


if __name__ == "__main__":
    main()
