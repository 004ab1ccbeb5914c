"""The ablation report: every point of a sweep against a baseline point (``sweep
--baseline=POINT``), with what is significant marked, and a figure.

Two noises separate a difference from a result, and the report tests both:

- **the test set's**: within one seed, the paired bootstrap over the test sentences
  (Koehn 2004; sacrebleu's ``paired_bs``, 1,000 resamples, its fixed seed): how often a
  resampled test set reverses the difference;
- **training's**: across seeds (run ``i`` of each point shares seed ``train.seed + i``
  with the baseline's), a paired t-test of the per-seed differences.

A difference is marked significant only if both hold at p < 0.05 with one sign in
every seed; everything else is marked *n.s.* (Marie et al., ACL 2021, on MT papers
that claim differences without such a test). A generated task without translations
(accuracy) or a language model (validation nll) gets the test across seeds alone.

``results.png``: the validation nll over the steps per point (mean of the seeds, a
band of ± one std), and the final test metric per point with ± one std error bars.
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from typing import Any

from flaxformer_lite.sweep.spec import find_baseline
from flaxformer_lite.workdir import location, storage

__all__ = ["compare", "figure", "find_baseline", "paired_bootstrap", "report", "t_test"]

ALPHA = 0.05
RESAMPLES = 1000


def _label(row: dict[str, Any]) -> str:
    return row["run"].rpartition("/")[0]


def _translations(folder: location.Path, split: str) -> tuple[list[str], list[str]] | None:
    path = folder / f"{split}_translations.tsv"
    if not path.is_file():
        return None
    text = io.StringIO(path.read_bytes().decode("utf-8"), newline="")
    rows = list(csv.DictReader(text, delimiter="\t", quoting=csv.QUOTE_NONE))
    return [r["hypothesis"] for r in rows], [r["reference"] for r in rows]


def paired_bootstrap(base: list[str], other: list[str], refs: list[str]) -> dict[str, float]:
    """p-values of ``other`` against ``base`` on the same sentences, BLEU and chrF
    (sacrebleu's paired bootstrap resampling)."""
    from sacrebleu.metrics import BLEU, CHRF
    from sacrebleu.significance import PairedTest

    test = PairedTest([("baseline", base), ("point", other)], {"bleu": BLEU(), "chrf": CHRF()},
                      [refs], test_type="bs", n_samples=RESAMPLES)  # fmt: skip
    _, results = test()  # keyed by the metrics' own names (BLEU, chrF2), in their order
    scores = [v for k, v in results.items() if k != "System"]
    return {metric: s[1].p_value for metric, s in zip(("bleu", "chrf"), scores, strict=True)}


def t_test(deltas: list[float]) -> float | None:
    """Two-sided p of a paired t-test that the mean difference is 0 (None: one seed)."""
    if len(deltas) < 2:
        return None
    std = statistics.stdev(deltas)
    if std == 0:
        return 0.0 if statistics.fmean(deltas) else 1.0
    from scipy import stats  # a dependency of jax

    t = statistics.fmean(deltas) / (std / math.sqrt(len(deltas)))
    return float(2 * stats.t.sf(abs(t), len(deltas) - 1))


def compare(rows: list[dict[str, Any]], baseline: str, split: str, workdir: location.Path):
    """Per point other than ``baseline``: the per-seed differences of its main metric
    (with the bootstrap's p where both runs' translations are there), their t-test, and
    the verdict. Returns (main metric key, [record per point])."""
    ok = [r for r in rows if r.get("status") == "ok"]
    main = next((k for k in (f"{split}_bleu", f"{split}_accuracy", "valid_nll")
                 if any(r.get(k) is not None for r in ok)), None)  # fmt: skip
    by_point: dict[str, dict[int, dict]] = {}
    for r in ok:
        by_point.setdefault(_label(r), {})[r["seed"]] = r
    base = by_point.get(baseline, {})
    out = []
    for point, seeds in by_point.items():
        if point == baseline or main is None:
            continue
        per_seed = []
        for seed in sorted(set(seeds) & set(base)):
            a, b = base[seed], seeds[seed]
            if a.get(main) is None or b.get(main) is None:
                continue
            p = None
            pair = [_translations(workdir / r["run"], split) for r in (a, b)]
            if b[main] == a[main]:
                p = 1.0  # no difference (sacrebleu would give a zero one p = 1 / 1,001)
            elif main.endswith("_bleu") and all(pair) and pair[0][1] == pair[1][1]:
                p = paired_bootstrap(pair[0][0], pair[1][0], pair[0][1])["bleu"]
            per_seed.append((seed, b[main] - a[main], p))
        deltas = [d for _, d, _ in per_seed]
        p_seeds = t_test(deltas)
        one_sign = bool(deltas) and (all(d > 0 for d in deltas) or all(d < 0 for d in deltas))
        within = all(p is not None and p < ALPHA for _, _, p in per_seed) or main != f"{split}_bleu"
        significant = p_seeds is not None and p_seeds < ALPHA and one_sign and within
        extra = {k: [seeds[s][k] - base[s][k] for s in set(seeds) & set(base)
                     if seeds[s].get(k) is not None and base[s].get(k) is not None]
                 for k in (f"{split}_chrf", "valid_nll") if k != main}  # fmt: skip
        out.append({"point": point, "per_seed": per_seed, "p_seeds": p_seeds,
                    "significant": significant, "extra": extra})  # fmt: skip
    return main, out


def _name(key: str) -> str:
    return key.replace("_", " ").replace("bleu", "BLEU").replace("chrf", "chrF")


def _mean_std(values: list[float], fmt: str) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.fmean(values))} ± {statistics.stdev(values):.2f}"


def report(rows: list[dict[str, Any]], baseline: str, split: str, workdir: location.Path):
    """(the markdown section of ``results.md`` against ``baseline``, {point: significant})."""
    main, points = compare(rows, baseline, split, workdir)
    if main is None:
        return f"\n## Against the baseline `{baseline}`\n\nNo finished run has a metric.\n", {}
    name = _name(main)
    lines = [
        "",
        f"## Against the baseline `{baseline}`",
        "",
        f"Δ = point − baseline, seed by seed (run i of each point has the same seed). Per "
        f"seed: the difference and its paired bootstrap p over the {split} sentences "
        f"(sacrebleu paired_bs, {RESAMPLES:,} resamples). Over seeds: mean ± sample std "
        f"and a paired t-test. **Significant** only at p < {ALPHA} both ways, one sign in "
        "every seed; otherwise n.s.",
        "",
        f"| point | Δ {name} | per seed: Δ (bootstrap p) | p over seeds | "
        + " | ".join(f"Δ {_name(k)}" for k in (points[0]["extra"] if points else {}))
        + " | verdict |",
        "|" + "---|" * (5 + len(points[0]["extra"] if points else {})),
    ]
    for p in points:
        deltas = [d for _, d, _ in p["per_seed"]]
        seeds = ", ".join(f"{d:+.2f}" + (f" ({q:.3f})" if q is not None else "")
                          for _, d, q in p["per_seed"])  # fmt: skip
        p_seeds = "—" if p["p_seeds"] is None else f"{p['p_seeds']:.3f}"
        extra = [_mean_std(v, "{:+.3f}") for v in p["extra"].values()]
        verdict = "**significant**" if p["significant"] else "n.s."
        cells = [p["point"], _mean_std(deltas, "{:+.2f}"), seeds or "—", p_seeds, *extra, verdict]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", {p["point"]: p["significant"] for p in points}


def figure(rows: list[dict[str, Any]], baseline: str | None, split: str, workdir: location.Path,
           verdicts: dict[str, bool] | None = None) -> None:  # fmt: skip
    """``results.png``: validation nll curves (mean ± std over seeds) per point, and the
    final test metric per point with ± std error bars (the baseline in black; a point
    against it labelled * where significant, n.s. where not)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.get("status") == "ok"]
    key = next((k for k in (f"{split}_bleu", f"{split}_accuracy", "valid_nll")
                if any(r.get(k) is not None for r in ok)), None)  # fmt: skip
    points = list(dict.fromkeys(_label(r) for r in ok))
    if not points:
        return
    colors = {p: "k" if p == baseline else f"C{i % 10}" for i, p in enumerate(points)}
    fig, (curves, final) = plt.subplots(1, 2, figsize=(11, 4))
    for point in points:
        runs = []
        for r in (r for r in ok if _label(r) == point):
            path = workdir / r["run"] / "metrics.jsonl"
            if path.is_file():
                lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
                runs.append({x["step"]: x["nll"] for x in lines
                             if x.get("split") == "validation" and "nll" in x})  # fmt: skip
        steps = sorted(set.intersection(*(set(r) for r in runs))) if runs else []
        if steps:
            values = [[r[s] for r in runs] for s in steps]
            mean = [statistics.fmean(v) for v in values]
            std = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in values]
            curves.plot(steps, mean, label=point, color=colors[point])
            curves.fill_between(steps, [m - s for m, s in zip(mean, std, strict=True)],
                                [m + s for m, s in zip(mean, std, strict=True)],
                                color=colors[point], alpha=0.2)  # fmt: skip
    curves.set(xlabel="step", ylabel="validation nll", title="validation (mean ± std over seeds)")
    curves.legend(fontsize=7)
    if key is not None:
        for i, point in enumerate(points):
            values = [r[key] for r in ok if _label(r) == point and r.get(key) is not None]
            if values:
                std = statistics.stdev(values) if len(values) > 1 else 0.0
                final.errorbar([i], [statistics.fmean(values)], yerr=[std], fmt="o", capsize=4,
                               color=colors[point])  # fmt: skip
        marks = {p: " *" if v else " (n.s.)" for p, v in (verdicts or {}).items()}
        labels = [p + marks.get(p, " (baseline)" if p == baseline else "") for p in points]
        final.set_xticks(range(len(points)), labels, rotation=20, fontsize=7, ha="right")
        final.set(ylabel=_name(key), title="final (mean ± std over seeds)")
    fig.tight_layout()
    storage.save_figure(fig, workdir / "results.png", dpi=110)
    plt.close(fig)
