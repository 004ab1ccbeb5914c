"""Scores of a trained run: BLEU and chrF of translations, accuracy of generated tasks.

Scores come with sacrebleu's signature (tokenizer, smoothing, version), so a
number can be compared with another only when the signatures match. BLEU is
sacrebleu's default (13a tokenization, mixed case, exponential smoothing).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import sacrebleu

from flaxformer_lite.config.experiment import DecodeConfig
from flaxformer_lite.data import synthetic
from flaxformer_lite.data.packing import pad_batch
from flaxformer_lite.data.sources import load_texts
from flaxformer_lite.inference.run import Run
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.tracker import WandbRun


@dataclasses.dataclass(frozen=True)
class Scores:
    """Corpus BLEU and chrF with sacrebleu's signatures (compare numbers only when
    the signatures match)."""

    bleu: float
    chrf: float
    bleu_signature: str
    chrf_signature: str
    num_sentences: int

    def line(self) -> str:
        return (
            f"BLEU {self.bleu:.2f} ({self.bleu_signature}); chrF {self.chrf:.2f} "
            f"({self.chrf_signature}); {self.num_sentences} sentences"
        )


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str]) -> Scores:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each."""
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{len(hypotheses)} hypotheses but {len(references)} references; they must pair up"
        )
    if not hypotheses:
        raise ValueError("no sentences to score")
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    refs = [list(references)]
    return Scores(
        bleu=bleu.corpus_score(list(hypotheses), refs).score,
        chrf=chrf.corpus_score(list(hypotheses), refs).score,
        bleu_signature=str(bleu.get_signature()),
        chrf_signature=str(chrf.get_signature()),
        num_sentences=len(hypotheses),
    )


def perplexity(nll: float) -> float:
    """exp of a mean per-token negative log-likelihood (nats)."""
    return math.exp(nll)


def evaluate_accuracy(run: Run, split: str = "test", *, limit: int = 0) -> dict[str, Any]:
    """Accuracy of a generated task's run on a split: of the answers (recall) or the
    labels (classify), overall and by ``group`` where the task has one (the needle's
    distance). Writes ``<workdir>/<split>_scores.json`` and prints it."""
    d = run.config.data
    examples = synthetic.load_examples(d.dataset, split, d.data_dir)[: limit or None]
    params, step = run.params()
    model = run.model()
    classify = run.task == "classify"
    batch_size = run.config.train.batch_size

    @jax.jit
    def correct(params, batch):  # per row: answers right, answers scored
        if classify:
            logits = model.apply({"params": params}, batch["inputs"])
            targets, weights = batch["targets"][:, :1], batch["weights"][:, :1]
        else:
            logits = model.apply({"params": params}, batch["targets"])
            targets, weights = batch["targets"], batch["weights"]
        hits = (jnp.argmax(logits, -1) == targets) * weights
        return hits.sum(-1), weights.sum(-1)

    hits, counts, groups = [], [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = pad_batch([{k: v for k, v in e.items() if k != "group"} for e in chunk],
                          d.max_length)  # fmt: skip
        h, n = jax.device_get(correct(params, batch))
        hits += list(h)
        counts += list(n)
        groups += [int(e["group"][0]) if "group" in e else None for e in chunk]
    hits, counts = np.asarray(hits, np.float64), np.asarray(counts, np.float64)
    scores: dict[str, Any] = {
        "split": split, "accuracy": float(hits.sum() / counts.sum()), "examples": len(examples),
        "answers": int(counts.sum()), "checkpoint": f"{run.newest_kind()} {step}",
    }  # fmt: skip
    if any(g is not None for g in groups):
        by = {}
        for g in sorted({g for g in groups if g is not None}):
            rows = np.asarray([x == g for x in groups])
            by[str(g)] = float(hits[rows].sum() / counts[rows].sum())
        scores["accuracy_by_group"] = by
    storage.write_atomic(run.workdir / f"{split}_scores.json", json.dumps(scores, indent=2))
    print(
        f"{d.dataset} {split} ({scores['checkpoint']}): accuracy {scores['accuracy']:.4f} "
        f"over {scores['answers']} answers"
        + (f"; by group: {scores['accuracy_by_group']}" if "accuracy_by_group" in scores else "")
    )
    return scores


def evaluate_workdir(
    workdir,
    split: str = "test",
    *,
    num_examples: int = 5,
    limit: int = 0,
    ensemble: Sequence[str] = (),
    **options,
) -> Scores | dict[str, Any]:
    """Translate a split of the run's dataset, score it, write the translations (for a
    generated task: its accuracy, :func:`evaluate_accuracy`).

    ``options``: beam_size, alpha, no_repeat_ngram, min_length_ratio,
    max_length_ratio as in ``Translator.translate``; one left out (or None) takes
    the run's ``decode`` section. Writes ``<workdir>/<split>_translations.tsv``
    (source, reference, hypothesis) and ``<workdir>/<split>_scores.json`` (the
    scores with the options used); prints the scores with their signatures and
    ``num_examples`` example translations.
    """
    workdir = location.path(workdir)
    run = Run.open(workdir)
    if run.task in ("recall", "classify"):
        return evaluate_accuracy(run, split, limit=limit)
    translator = Translator.from_workdir(workdir, ensemble=ensemble)
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(DecodeConfig)})
    if unknown:
        raise TypeError(f"evaluate_workdir() got unknown decoding options {unknown}")
    used = {k: v for k, v in options.items() if v is not None}
    decode = translator.decode.replace(**used)  # checked like the config's
    d = translator.run_config.data
    pairs = load_texts(d.dataset, split, (d.source_lang, d.target_lang), d.data_dir)
    if limit:
        pairs = pairs[:limit]
    sources, references = [p[0] for p in pairs], [p[1] for p in pairs]
    start = time.perf_counter()
    beam_size, alpha, no_repeat_ngram = decode.beam_size, decode.alpha, decode.no_repeat_ngram
    min_length_ratio, max_length_ratio = decode.min_length_ratio, decode.max_length_ratio
    bounds = {"min_length_ratio": min_length_ratio, "max_length_ratio": max_length_ratio}
    hypotheses = translator.translate(
        sources, beam_size=beam_size, alpha=alpha, no_repeat_ngram=no_repeat_ngram, **bounds
    )
    seconds = time.perf_counter() - start
    scores = corpus_scores(hypotheses, references)
    rows = ["source\treference\thypothesis\n"] + [
        "\t".join(x.replace("\t", " ") for x in row) + "\n"
        for row in zip(sources, references, hypotheses, strict=True)
    ]
    storage.write_atomic(workdir / f"{split}_translations.tsv", "".join(rows))
    storage.write_atomic(
        workdir / f"{split}_scores.json",
        json.dumps(
            {
                **dataclasses.asdict(scores),
                "split": split,
                "beam_size": beam_size,
                "alpha": alpha,
                "no_repeat_ngram": no_repeat_ngram,
                **bounds,
                "checkpoint": translator.checkpoint,
                "seconds": seconds,
            },
            indent=2,
        ),
    )
    print(
        f"{d.dataset} {split} ({d.source_lang}->{d.target_lang}, beam {beam_size}, "
        f"alpha {alpha}"
        + (f", no repeated {no_repeat_ngram}-grams" if no_repeat_ngram else "")
        + (f", min length {min_length_ratio} x source" if min_length_ratio else "")
        + (f", max length {max_length_ratio} x source + 5" if max_length_ratio else "")
        + f", {translator.checkpoint}, {seconds:.0f} s):"
    )
    print(f"  {scores.line()}")
    project = translator.run_config.train.wandb_project
    if project and jax.process_index() == 0:  # the scores join the run's W&B summary
        tracker = WandbRun(workdir, project)
        tracker.summary({f"{split}/{k}": v for k, v in dataclasses.asdict(scores).items()
                         if isinstance(v, int | float)})  # fmt: skip
        tracker.close()
    for src, ref, hyp in list(zip(sources, references, hypotheses, strict=True))[:num_examples]:
        print(f"  source:    {src}\n  reference: {ref}\n  output:    {hyp}")
    return scores


def validation_bleu(config, model, params, data) -> float | None:
    """Training's greedy BLEU on the first ``train.eval_bleu_sentences`` validation
    sentences of ``data`` (the assembly's TrainingData); None where not measured."""
    n = config.train.eval_bleu_sentences
    if not n or config.data.task != "translation" or jax.process_count() > 1:
        return None  # several processes: translate the checkpoints afterwards
    translator = Translator(model, params, data.tokenizer)
    pairs = data.validation_texts[:n]
    hypotheses = translator.translate([p[0] for p in pairs], beam_size=1)
    return corpus_scores(hypotheses, [p[1] for p in pairs]).bleu
