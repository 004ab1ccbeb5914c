"""Averaging the end of a run: what `average` gives at the step counts machines reach.

  .venv/bin/python experiments/translation_recipe/averaging.py train --seeds=0,1,2
  .venv/bin/python experiments/translation_recipe/averaging.py score --seeds=0,1,2
  .venv/bin/python experiments/translation_recipe/averaging.py report

`train` trains the demo's recipe (configs/ende_small.py) at fixed step counts, so that
the machine's speed does not move them: one run per seed, stopped and resumed at each
budget of BUDGETS (noam does not depend on the step count and a resume continues bit
for bit, so the run's first N steps are the N-step run's), each command writing the
final checkpoints (`train.final_checkpoints`) its budget gets, and every checkpoint
kept. `score` translates the test split (beam 4, alpha 1.0, no repeated 3-grams, as
`make demo`) with, per seed and budget:

- `window`: the mean of the last 4 checkpoints of the budget's last quarter (the rule
  of `average`, on the checkpoints the N-step run wrote);
- `old` (600 and 1,560 only): the mean of the last 4 checkpoints the code before the
  rule wrote (every `checkpoint_every`=200 steps and the last), wherever they were;
- `last`: the last checkpoint alone (its moving average);
- `best` (1,560 only): the checkpoint of the lowest validation loss.

Scores go to averaging.json as they come (a rerun scores only what is missing);
`report` prints the tables of the record.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RESULTS = HERE / "averaging.json"
BUDGETS = (300, 600, 1000, 1560)
COMPARED = (600, 1560)  # the budgets where every variant is scored
OLD_EVERY, NUM = 200, 4
DECODE = {"beam_size": 4, "alpha": 1.0, "no_repeat_ngram": 3}


def workdir(seed: int) -> Path:
    return ROOT / "runs" / "averaging" / f"seed{seed}"


def train(seeds: list[int]) -> None:
    for seed in seeds:
        for budget in BUDGETS:
            cmd = [
                sys.executable, "-m", "flaxformer_lite.main", "--config=configs/ende_small.py",
                f"--workdir={workdir(seed)}", "--config.train.max_minutes=0",
                f"--config.train.num_steps={budget}", f"--config.train.seed={seed}",
                "--config.train.keep_checkpoints=100",
            ]  # fmt: skip
            print(" ".join(cmd), flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True)


def variants(kept: list[int], budget: int) -> dict[str, list[int] | str]:
    """The checkpoint steps each variant averages at ``budget`` ('best': the best dir)."""
    from flaxformer_lite.inference.average import choose_steps

    upto = [s for s in kept if s <= budget]
    out: dict[str, list[int] | str] = {"window": choose_steps(upto, NUM, 0.25)[0]}
    out["last"] = [budget]
    if budget in COMPARED:
        out["old"] = [s for s in upto if s % OLD_EVERY == 0 or s == budget][-NUM:]
    if budget == BUDGETS[-1]:
        out["best"] = "best"
    return out


def score(seeds: list[int]) -> None:
    from flaxformer_lite.data.sources import load_texts
    from flaxformer_lite.inference.average import average_params, validation_nll
    from flaxformer_lite.inference.evaluation import corpus_scores
    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.inference.translate import Translator

    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = {seed: Run.open(workdir(seed)) for seed in seeds}
    d = runs[seeds[0]].config.data
    pairs = load_texts(d.dataset, "test", (d.source_lang, d.target_lang), d.data_dir)

    def save() -> None:
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")

    def params_of(run, steps):
        if steps == "best":
            params, step = run.params("best")
            return params, [step]
        return average_params(run, steps), steps

    # The comparison (600 and 1,560 steps) for every seed first, then the curve's points.
    for budget in sorted(BUDGETS, key=lambda b: b not in COMPARED):
        for seed, run in runs.items():
            if budget not in run.steps("last"):
                continue  # not trained that far yet
            # The validation nll of each variant (seconds), as `average` measures it ...
            named = variants(run.steps("last"), budget)
            for name, steps in named.items():
                entry = results.setdefault(f"seed{seed}/{budget}/{name}", {})
                if "val_nll" not in entry:
                    params, steps = params_of(run, steps)
                    entry.update(steps=steps, val_nll=validation_nll(run, [params])[0])
                    save()
            # ... which picks what `average` keeps: the window's mean, or the last alone.
            window, last = (results[f"seed{seed}/{budget}/{n}"] for n in ("window", "last"))
            kept = "last" if last["val_nll"] < window["val_nll"] else "window"
            results[f"seed{seed}/{budget}/average"] = {"of": kept}
            # Test BLEU: of every variant where the rule is compared, else of the kept one.
            for name in named if budget in COMPARED else [kept]:
                entry = results[f"seed{seed}/{budget}/{name}"]
                if name == "best" and entry["steps"] == [budget]:  # the last: scored above
                    entry.update({k: last[k] for k in ("bleu", "chrf")})
                if "bleu" in entry:
                    continue
                params, _ = params_of(run, named[name])
                translator = Translator(
                    run.model(), params, run.tokenizer, decode=run.config.decode
                )  # as `evaluate` decodes: the run's decode section, then DECODE
                hyps = translator.translate([p[0] for p in pairs], **DECODE)
                scores = corpus_scores(hyps, [p[1] for p in pairs])
                entry.update(bleu=scores.bleu, chrf=scores.chrf)
                print(f"seed{seed}/{budget}/{name}", entry, flush=True)
                save()
    save()


def report() -> None:
    """The record's tables: test BLEU and validation nll per seed, mean ± std."""
    results = json.loads(RESULTS.read_text())
    seeds = sorted({k.split("/")[0] for k in results})
    for metric, digits in (("bleu", 2), ("val_nll", 3)):
        print(f"\n| steps | checkpoints | {' | '.join(seeds)} | mean ± std |")
        print("|---|---|" + "---:|" * (len(seeds) + 1))
        for budget in BUDGETS:
            for name in ("old", "window", "last", "best", "average"):
                row = [_entry(results, s, budget, name) for s in seeds]
                got = [r[metric] for r in row if r and metric in r]
                if not got:
                    continue
                cells = [
                    f"{r[metric]:.{digits}f} ({_span(r['steps'])})" if r and metric in r else "—"
                    for r in row
                ]
                mean = (
                    f"{statistics.fmean(got):.{digits}f} ± {statistics.stdev(got):.{digits}f}"
                    if len(got) > 1
                    else "(one seed)"
                )
                print(f"| {budget:,} | {name} | {' | '.join(cells)} | {mean} |")


def _entry(results: dict, seed: str, budget: int, name: str) -> dict | None:
    """A variant's entry; for 'average', the one `average` kept."""
    entry = results.get(f"{seed}/{budget}/{name}")
    if name == "average" and entry:
        entry = results.get(f"{seed}/{budget}/{entry['of']}")
    return entry


def _span(steps: list[int]) -> str:
    return f"{steps[0]:,}" if len(steps) == 1 else f"{steps[0]:,}–{steps[-1]:,}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("train", "score", "report"))
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    {"train": train, "score": score, "report": lambda _: report()}[args.phase](seeds)


if __name__ == "__main__":
    main()
