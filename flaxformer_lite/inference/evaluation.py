"""Translation quality as the field reports it: corpus BLEU and chrF with sacrebleu.

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
from pathlib import Path

import sacrebleu

from flaxformer_lite.config.experiment import DecodeConfig
from flaxformer_lite.data.sources import load_texts
from flaxformer_lite.inference.translate import Translator


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


def evaluate_workdir(
    workdir,
    split: str = "test",
    *,
    num_examples: int = 5,
    limit: int = 0,
    ensemble: Sequence[str] = (),
    **options,
) -> Scores:
    """Translate a split of the run's dataset, score it, write the translations.

    ``options``: beam_size, alpha, no_repeat_ngram, min_length_ratio,
    max_length_ratio as in ``Translator.translate``; one left out (or None) takes
    the run's ``decode`` section. Writes ``<workdir>/<split>_translations.tsv``
    (source, reference, hypothesis) and ``<workdir>/<split>_scores.json`` (the
    scores with the options used); prints the scores with their signatures and
    ``num_examples`` example translations.
    """
    workdir = Path(workdir)
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
    with open(workdir / f"{split}_translations.tsv", "w", encoding="utf-8") as f:
        f.write("source\treference\thypothesis\n")
        for row in zip(sources, references, hypotheses, strict=True):
            f.write("\t".join(x.replace("\t", " ") for x in row) + "\n")
    (workdir / f"{split}_scores.json").write_text(
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
        )
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
    for src, ref, hyp in list(zip(sources, references, hypotheses, strict=True))[:num_examples]:
        print(f"  source:    {src}\n  reference: {ref}\n  output:    {hyp}")
    return scores
