"""The sweep's report against a baseline (sweep/significance.py): the per-seed paired
bootstrap over test sentences and the t-test over seeds, on rows and translation files
made here (no training): a point that translates every sentence right is significant,
one whose difference flips sign between seeds or stays inside the test set's noise is
not; a baseline that names no point is refused with the points; the figure is written.
The CLI sequence with a real sweep is test_lab_example's (slow)."""

import json
import random

import pytest
from scipy import stats

from flaxformer_lite.sweep import significance as S
from flaxformer_lite.sweep.spec import SweepError

WORDS = "the a cat dog sat ran on under mat house red blue quickly slowly".split()


def _sentences(n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) for _ in range(n)]


def _run(workdir, point, seed, refs, hyps, bleu, nll):
    folder = workdir / point / f"seed{seed}"
    folder.mkdir(parents=True)
    with open(folder / "test_translations.tsv", "w") as f:
        f.write("source\treference\thypothesis\n")
        f.writelines(f"s\t{r}\t{h}\n" for r, h in zip(refs, hyps, strict=True))
    curve = [{"step": s, "split": "validation", "nll": nll + 1 / s} for s in (10, 20, 30)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in curve))
    row = {"run": f"{point}/seed{seed}", "seed": seed, "status": "ok", "valid_nll": nll}
    return {**row, "test_bleu": bleu, "test_chrf": bleu / 2}


def _noisy(refs, keep, seed):
    """Each reference kept with probability ``keep``, else a random sentence."""
    rng = random.Random(seed)
    return [r if rng.random() < keep else _sentences(1, rng.random())[0] for r in refs]


def test_a_clear_gain_is_significant_and_a_flip_is_not(tmp_path):
    refs = _sentences(300, 0)
    rows = []
    for seed in range(3):
        base = _noisy(refs, 0.3, seed)
        rows.append(_run(tmp_path, "base", seed, refs, base, 30.0 + seed, 3.0))
        rows.append(_run(tmp_path, "good", seed, refs, _noisy(refs, 0.7, 10 + seed),
                         60.0 + seed, 2.5))  # fmt: skip
        # as good as the baseline: another draw of the same quality, a steady +0.5 in the
        # rows (so the seeds alone would call it significant): the bootstrap does not
        near = _noisy(refs, 0.3, 100 + seed)
        rows.append(_run(tmp_path, "near", seed, refs, near, 30.5 + seed, 3.0))
        # better in two seeds, worse in one
        flip = _noisy(refs, 0.5 if seed else 0.1, 20 + seed)
        rows.append(_run(tmp_path, "flip", seed, refs, flip, (45.0 if seed else 20.0) + seed, 3.0))
    main, points = S.compare(rows, "base", "test", tmp_path)
    assert main == "test_bleu"
    verdict = {p["point"]: p for p in points}
    assert verdict["good"]["significant"]
    assert all(p < 0.05 for _, _, p in verdict["good"]["per_seed"])
    assert not verdict["near"]["significant"] and verdict["near"]["p_seeds"] == 0.0
    assert all(p > 0.05 for _, _, p in verdict["near"]["per_seed"])  # 0.28-0.34
    assert not verdict["flip"]["significant"]
    text, marks = S.report(rows, "base", "test", tmp_path)
    assert marks == {"good": True, "near": False, "flip": False}
    assert "| good | +30.00 ± 0.00 |" in text and "**significant**" in text
    assert "| flip |" in text and text.count("n.s.") >= 2
    S.figure(rows, "base", "test", tmp_path, marks)
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_the_t_test_is_students():
    deltas = [1.0, 2.0, 3.0]
    assert S.t_test(deltas) == pytest.approx(stats.ttest_1samp(deltas, 0).pvalue, rel=1e-9)
    assert S.t_test([0.5]) is None


def test_a_baseline_names_a_point():
    points = [("ffn=standard", {"model.ffn": "standard"}), ("ffn=swiglu", {"model.ffn": "swiglu"})]
    assert S.find_baseline(points, "model.ffn=standard") == "ffn=standard"
    assert S.find_baseline(points, "ffn=swiglu") == "ffn=swiglu"
    with pytest.raises(SweepError, match=r"'ffn=glu' is not a point .* ffn=standard, ffn=swiglu"):
        S.find_baseline(points, "ffn=glu")
