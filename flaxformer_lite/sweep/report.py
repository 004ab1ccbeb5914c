"""A sweep's tables: ``results.md``, mean ± sample std over the seeds of each point.

The columns (:data:`METRICS`) are what :func:`~flaxformer_lite.sweep.rows.measure`
and the evaluation put in each run's row of ``results.jsonl``.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from typing import Any

from flaxformer_lite.sweep.spec import Sweep

# The columns of results.md: row key, heading, format.
METRICS = {
    "parameters": ("params", "{:,.0f}"),
    "flops_per_step": ("GFLOP/step", "{:.3g}"),
    "tokens_per_sec": ("tokens/s", "{:,.0f}"),
    "wall_minutes": ("wall min", "{:.2f}"),
    "steps": ("steps", "{:.0f}"),
    "valid_nll": ("valid nll", "{:.3f}"),
    "valid_perplexity": ("valid ppl", "{:.2f}"),
    "valid_accuracy": ("valid acc", "{:.4f}"),
    "test_bleu": ("test BLEU", "{:.2f}"),
    "test_chrf": ("test chrF", "{:.2f}"),
    "test_accuracy": ("test acc", "{:.4f}"),
}
_SCALE = {"flops_per_step": 1e-9}
_NOISY = {"valid_nll", "valid_perplexity", "valid_accuracy", "test_bleu", "test_chrf",
          "test_accuracy"}  # fmt: skip


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and the sample standard deviation (None for a single value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def summarize(sweep: Sweep, rows: list[dict[str, Any]]) -> str:
    """``results.md``: one line per point, mean ± std over its finished seeds."""
    by_point: dict[str, list[dict]] = {}
    for row in rows:
        by_point.setdefault(row["run"].rpartition("/")[0], []).append(row)
    split_keys = {f"{sweep.split}_bleu": "BLEU", f"{sweep.split}_chrf": "chrF"}
    columns = [k for k in METRICS if any(k in r for r in rows)]
    columns += [k for k in split_keys if k not in columns and any(k in r for r in rows)]
    head = [
        "point",
        "seeds",
        *(METRICS.get(k, (f"{sweep.split} {split_keys.get(k)}",))[0] for k in columns),
    ]
    lines = [
        f"# Sweep of `{sweep.config}`",
        "",
        f"Base overrides: {json.dumps(sweep.overrides) if sweep.overrides else 'none'}; "
        f"{sweep.seeds} seed(s) per point; mean ± sample std over the finished seeds.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for point, group in by_point.items():
        ok = [r for r in group if r.get("status") == "ok"]
        cells = [point, f"{len(ok)}/{len(group)}"]
        for key in columns:
            values = [r[key] * _SCALE.get(key, 1) for r in ok if r.get(key) is not None]
            fmt = METRICS.get(key, ("", "{:.2f}"))[1]
            if not values:
                cells.append("—")
                continue
            mean, std = mean_std(values)
            spread = f" ± {fmt.format(std)}" if std is not None and (std or key in _NOISY) else ""
            cells.append(fmt.format(mean) + spread)
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("status") != "ok"]
    for r in failed:
        lines.append(f"\nfailed: `{r['run']}`: {r.get('error', '')}")
    return "\n".join(lines) + "\n"
