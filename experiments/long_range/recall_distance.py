"""Recall accuracy by the query's rank in its row, its distance to the pair, and the pair.

  .venv/bin/python experiments/long_range/recall_distance.py \\
      --collect experiments/long_range/runs/mqar_l128_p8      # score the runs (minutes)
  .venv/bin/python experiments/long_range/recall_distance.py  # redraw from the record

In an MQAR row (data/synthetic.py) the pairs come first and each key is queried once
later; the answer at position a (the value after the query) is a copy of the value at
2j + 1, where the queried key stands at 2j. Its distance a - (2j + 1) is what a pattern
must bridge, in one hop or two, to copy the value. Each key is asked once, so the k-th
query (k = 0, 1, ...) can also be answered by elimination: a model that knows only
which values have not been asked for yet scores 1/(P - k) on it, 34% over a row of
P = 8, without any recall; only accuracy above that curve (and at k = 0, above 1/P) is
recall. ``--collect`` scores each run of a sweep folder on the test split with the
checkpoint the sweep scored (best validation accuracy), answer by answer, and writes
the hits per distance bucket (L/8 tokens wide), per query rank and per queried pair
(the j-th of the row: whether a pattern recalls the pairs its global tokens hold and
not the others) to ``recall_distance.json`` (one row per run, sweeps side by side);
the default redraws, for each sweep in it, ``recall_<sweep>.png`` and
``recall_<sweep>.md`` (mean ± std over seeds), and for sweeps that differ only in their
number of pairs, ``recall_pairs_<family>.md`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from grid import PATTERNS  # noqa: E402

RECORD = HERE / "recall_distance.json"
# A run "recalls" when it answers the first query of a row (where elimination cannot
# help, and chance is 1/P) at least this often: runs either learn the recall circuit
# (~99% there) or stay near chance, ~50% at most (the sweeps' first-query accuracies).
RECALLS = 0.9
# Patterns by their kind where a sweep scaled the grid's specs to its row length.
KINDS = {"dense": "dense", "local": "local", "dilated": "dilated", "sparse_strided": "strided",
         "longformer": "longformer", "bigbird": "bigbird", "topk": "topk"}  # fmt: skip


def pattern_name(spec: str) -> str:
    """The grid's name of a pattern spec (grid.py), or its kind's where a sweep scaled
    the spec to its row length."""
    names = {v: k for k, v in PATTERNS.items()}
    return names.get(spec) or KINDS.get(spec.split(":")[0], spec)


def bucket_of(max_length: int) -> int:
    """Tokens per distance bucket: eight buckets over a row (16 at 128 tokens)."""
    return max(1, max_length // 8)


def answer_distances(targets: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(answer positions, their distances to the value they copy) of one MQAR row."""
    answers = np.flatnonzero(weights)
    pairs = len(answers)
    keys = targets[0 : 2 * pairs : 2]
    value_at = np.asarray([2 * int(np.flatnonzero(keys == targets[a - 1])[0]) + 1 for a in answers])
    return answers, answers - value_at


def score_run(folder: Path) -> dict:
    """Hits and answers per distance bucket of one run on its test split."""
    import jax
    import jax.numpy as jnp

    from flaxformer_lite.data import synthetic
    from flaxformer_lite.data.packing import pad_batch
    from flaxformer_lite.inference.run import Run

    run = Run.open(folder)
    d = run.config.data
    examples = synthetic.load_examples(d.dataset, "test", d.data_dir)
    params, step = run.params()
    model = run.model()

    @jax.jit
    def predict(params, tokens):
        return jnp.argmax(model.apply({"params": params}, tokens), -1)

    hits, counts, rank_hits, pair_hits = {}, {}, {}, {}
    bucket = bucket_of(d.max_length)
    size = run.config.train.batch_size
    for start in range(0, len(examples), size):
        chunk = examples[start : start + size]
        batch = pad_batch([{"targets": e["targets"]} for e in chunk], d.max_length)
        guess = np.asarray(jax.device_get(predict(params, batch["targets"])))
        for row, e in zip(guess, chunk, strict=False):
            answers, dist = answer_distances(e["targets"], e["weights"])
            for rank, (a, gap) in enumerate(zip(answers, dist, strict=True)):
                b = str(int(gap) // bucket * bucket)
                hit = int(row[a] == e["targets"][a])
                hits[b] = hits.get(b, 0) + hit
                counts[b] = counts.get(b, 0) + 1
                rank_hits[str(rank)] = rank_hits.get(str(rank), 0) + hit
                pair = str((a - gap) // 2)  # the queried pair's index: its value is at 2j + 1
                pair_hits[pair] = pair_hits.get(pair, 0) + hit
    return {"dataset": d.dataset, "checkpoint": f"{run.newest_kind()} {step}",
            "hits": hits, "answers": counts, "hits_by_rank": rank_hits,
            "hits_by_pair": pair_hits,
            "rows": len(examples), "bucket": bucket}  # fmt: skip


def collect(sweep: Path) -> None:
    """Score every finished run of a sweep folder into the record (other sweeps' rows
    kept; a run the record already holds is not scored again: a grown sweep scores its
    new runs only, and a run scored before the record kept hits by pair is scored
    again)."""
    rows = [r for r in _read() if "hits_by_pair" in r or r["sweep"] != sweep.name]
    done = {(r["sweep"], r["pattern"], r["seed"]) for r in rows}
    for line in (sweep / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        key = (sweep.name, row.get("overrides", {}).get("model.attention_pattern"), row.get("seed"))
        if row.get("status") != "ok" or key in done:
            continue
        scored = score_run(sweep / row["run"])
        pattern = row["overrides"]["model.attention_pattern"]
        rows.append({"sweep": sweep.name, "pattern": pattern, "seed": row["seed"],
                     "test_accuracy": row.get("test_accuracy"), **scored})  # fmt: skip
        print(f"{row['run']}: {sum(scored['hits'].values()) / sum(scored['answers'].values()):.3f}")
        _write(rows)  # after each run: an interrupted collect keeps what it scored


def _write(rows: list[dict]) -> None:
    tmp = RECORD.with_name(RECORD.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(RECORD)


def _read() -> list[dict]:
    return [json.loads(x) for x in RECORD.read_text().splitlines()] if RECORD.exists() else []


def by_pattern(rows: list[dict], key: str = "hits") -> dict[str, dict[int, list[float]]]:
    """pattern name -> bucket start (``hits``) or query rank (``hits_by_rank``) ->
    accuracy per seed."""
    out: dict[str, dict[int, list[float]]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        cells = out.setdefault(pattern_name(r["pattern"]), {})
        for b, hits in r[key].items():
            total = r["answers"][b] if key == "hits" else r["rows"]
            cells.setdefault(int(b), []).append(hits / total)
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _table(data: dict, columns: list[int], label) -> list[str]:
    lines = ["| pattern | " + " | ".join(label(c) for c in columns) + " |",
             "|---|" + "---|" * len(columns)]  # fmt: skip
    for name, per in data.items():
        cells = []
        for c in columns:
            if per.get(c):
                m, s = _mean_std([100 * a for a in per[c]])
                cells.append(f"{m:.1f} ± {s:.1f}")
            else:
                cells.append("—")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _curves(ax, data: dict) -> None:
    for name, per in data.items():
        xs = sorted(per)
        stats = [_mean_std([100 * a for a in per[x]]) for x in xs]
        ax.errorbar(xs, [m for m, _ in stats], yerr=[s for _, s in stats], marker="o",
                    ms=3, capsize=2, label=name)  # fmt: skip


def report() -> None:
    """Each sweep's table and figure; then, for sweeps of one length and vocabulary that
    differ in their number of pairs, recall against pairs."""
    rows = _read()
    for sweep in dict.fromkeys(r["sweep"] for r in rows):
        report_sweep(sweep, [r for r in rows if r["sweep"] == sweep])
    families: dict[str, list[dict]] = {}
    for r in rows:
        families.setdefault(_family(r["dataset"]), []).append(r)
    for family, members in families.items():
        if len({_pairs(r["dataset"]) for r in members}) > 1:
            report_pairs(family, members)


def _pairs(dataset: str) -> int:
    return int(dataset.split("_p")[-1].split("_")[0])


def _family(dataset: str) -> str:
    """``mqar/l64_p8_k16`` -> ``mqar/l64_k16``: the dataset with its pairs left out."""
    head, _, tail = dataset.partition("_p")
    rest = tail.partition("_")[2]
    return head + (f"_{rest}" if rest else "")


def report_pairs(family: str, rows: list[dict]) -> None:
    """Recall over all answers and at the first query of a row, against the number of
    pairs, per pattern: ``recall_pairs_<family>.md`` and ``.png``."""
    cells: dict[str, dict[int, dict[str, list[float]]]] = {}
    for r in sorted(rows, key=lambda r: r["seed"]):
        cell = cells.setdefault(pattern_name(r["pattern"]), {}).setdefault(_pairs(r["dataset"]), {})
        cell.setdefault("all", []).append(sum(r["hits"].values()) / sum(r["answers"].values()))
        cell.setdefault("first", []).append(r["hits_by_rank"]["0"] / r["rows"])
    counts = sorted({_pairs(r["dataset"]) for r in rows})
    specs = {pattern_name(r["pattern"]): r["pattern"] for r in rows}

    def cell(values: list[float]) -> str:
        m, s = _mean_std([100 * v for v in values])
        return f"{m:.1f} ± {s:.1f}"

    def recalled(values: list[float]) -> str:
        return f"{sum(v >= RECALLS for v in values)}/{len(values)}"

    head = " | ".join(f"P = {p}: all | first | recall" for p in counts)
    pattern_of = family.replace("_k", "_p{P}_k") if "_k" in family else family + "_p{P}"
    lines = [
        f"`{pattern_of}`, test split, the checkpoint with the best validation accuracy; "
        "recall accuracy (%), mean ± std over seeds, over all answers and at the first "
        "query of each row (where only recall beats 1/P); *recall*: the seeds whose "
        f"first-query accuracy is at least {100 * RECALLS:.0f}% (they learned recall), of "
        "the seeds run.",
        "",
        f"| pattern | spec | {head} |",
        "|---|---|" + "---|---|---|" * len(counts),
    ]
    for name, per in cells.items():
        parts = [
            f"{cell(per[p]['all'])} | {cell(per[p]['first'])} | {recalled(per[p]['first'])}"
            if p in per else "— | — | —"
            for p in counts
        ]  # fmt: skip
        lines.append(f"| {name} | `{specs[name]}` | " + " | ".join(parts) + " |")
    chance = [f"{100 * statistics.mean(1 / (p - k) for k in range(p)):.1f} | {100 / p:.1f} | "
              for p in counts]  # fmt: skip
    lines.append("| elimination alone / chance | | " + " | ".join(chance) + " |")
    lines += ["", "First-query accuracy (%) of each seed, in seed order:", "",
              "| pattern | " + " | ".join(f"P = {p}" for p in counts) + " |",
              "|---|" + "---|" * len(counts)]  # fmt: skip
    for name, per in cells.items():
        seeds = [", ".join(f"{100 * v:.0f}" for v in per[p]["first"]) if p in per else "—"
                 for p in counts]  # fmt: skip
        lines.append(f"| {name} | " + " | ".join(seeds) + " |")
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.0))
    for ax, key, title in ((axes[0], "all", "all answers"), (axes[1], "first", "first query")):
        for name, per in cells.items():  # the mean, and each seed (recall is all or nothing)
            xs = sorted(per)
            (line,) = ax.plot(xs, [100 * statistics.mean(per[x][key]) for x in xs], marker="o",
                              ms=3, label=name)  # fmt: skip
            for x in xs:
                ax.scatter([x] * len(per[x][key]), [100 * v for v in per[x][key]], s=12,
                           color=line.get_color(), alpha=0.5)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(p) for p in counts])
        ax.set_xlabel("key-value pairs in the row (P)")
        ax.set_title(title)
    axes[0].plot(counts, [100 * statistics.mean(1 / (p - k) for k in range(p)) for p in counts],
                 "k--", lw=1, label="elimination alone")  # fmt: skip
    axes[1].plot(counts, [100 / p for p in counts], "k:", lw=1, label="chance 1/P")
    axes[0].set_ylabel("test recall accuracy (%)")
    axes[1].sharey(axes[0])
    for i, (name, per) in enumerate(cells.items()):  # nudged apart: the counts coincide
        xs = sorted(per)
        share = [100 * statistics.mean(v >= RECALLS for v in per[x]["first"]) for x in xs]
        axes[2].plot([x * 1.02 ** (i - 3) for x in xs], share, marker="o", ms=4, label=name)
    axes[2].set_xscale("log", base=2)
    axes[2].set_xticks(counts, [str(p) for p in counts])
    axes[2].set_xlabel("key-value pairs in the row (P)")
    axes[2].set_ylabel(f"seeds that recall (first query ≥ {100 * RECALLS:.0f}%), %")
    axes[2].set_ylim(-5, 105)
    axes[2].set_title("seeds that learned recall")
    # The patterns once, beside the panels; each reference line in its own panel.
    axes[0].legend(handles=axes[0].get_lines()[-1:], fontsize=7, loc="lower left")
    axes[1].legend(handles=axes[1].get_lines()[-1:], fontsize=7, loc="lower left")
    fig.legend(handles=axes[2].get_lines(), fontsize=8, loc="center right")
    fig.suptitle(f"{family}: recall against the number of pairs")
    fig.tight_layout(rect=(0, 0, 0.91, 1))
    stem = "recall_pairs_" + family.replace("/", "_")
    fig.savefig(HERE / f"{stem}.png", dpi=120, metadata={"Software": None})
    (HERE / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def report_sweep(sweep: str, rows: list[dict]) -> None:
    dataset = rows[0]["dataset"]
    pairs = int(dataset.split("_p")[-1].split("_")[0])
    bucket = rows[0].get("bucket", 16)
    dist, rank = by_pattern(rows), by_pattern(rows, "hits_by_rank")
    buckets = sorted({b for v in dist.values() for b in v})
    ranks = list(range(pairs))
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        f"`{dataset}`, test split, the checkpoint with the best validation accuracy; "
        f"mean ± std over seeds {', '.join(map(str, seeds))}.",
        "",
        "Recall accuracy (%) by the query's rank in its row (k = 0: the first key asked; "
        "a model that only rules out the values already asked for scores 1/(P - k)):",
        "",
        *_table(rank, ranks, lambda k: f"k = {k}"),
        "| elimination alone | " + " | ".join(f"{100 / (pairs - k):.1f}" for k in ranks) + " |",
        "",
        "Recall accuracy (%) by the distance from the answer to the value it copies "
        f"(tokens, buckets of {bucket}):",
        "",
        *_table(dist, buckets, lambda b: f"{b}-{b + bucket - 1}"),
    ]
    by_pair = all("hits_by_pair" in r for r in rows)
    if by_pair:
        pair = by_pattern(rows, "hits_by_pair")
        lines += [
            "",
            "Recall accuracy (%) by the queried pair (j: the j-th pair of the row, its key at "
            "token 2j; a global block of the first b tokens holds pairs j < b/2):",
            "",
            *_table(pair, list(range(pairs)), lambda j: f"j = {j}"),
        ]
    fig, axes = plt.subplots(1, 3 if by_pair else 2, figsize=(15 if by_pair else 10, 4.0))
    left, right = axes[0], axes[1]
    _curves(left, rank)
    left.plot(ranks, [100 / (pairs - k) for k in ranks], "k--", lw=1,
              label="elimination alone: 1/(P - k)")  # fmt: skip
    left.axhline(100 / pairs, color="grey", ls=":", lw=1, label=f"chance 1/{pairs}")
    left.set_xlabel("rank k of the query in its row")
    left.set_ylabel("test recall accuracy (%)")
    left.set_title("by query rank")
    left.legend(fontsize=7, loc="center left")
    _curves(right, {n: {b + bucket / 2: v for b, v in per.items()} for n, per in dist.items()})
    right.axhline(100 / pairs, color="grey", ls=":", lw=1)
    right.set_xlabel("distance from the answer to the value it copies (tokens)")
    right.set_title("by distance")
    if by_pair:
        _curves(axes[2], pair)
        axes[2].axhline(100 / pairs, color="grey", ls=":", lw=1)
        axes[2].set_xlabel("queried pair j (its key at token 2j)")
        axes[2].set_title("by queried pair")
    by = "query rank, distance and pair" if by_pair else "query rank and by distance"
    fig.suptitle(f"{dataset}: recall by {by}")
    fig.tight_layout()
    fig.savefig(HERE / f"recall_{sweep}.png", dpi=120, metadata={"Software": None})
    (HERE / f"recall_{sweep}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--collect", type=Path, help="a sweep folder to score first")
    args = parser.parse_args()
    if args.collect:
        collect(args.collect)
    report()


if __name__ == "__main__":
    main()
