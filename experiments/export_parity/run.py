"""A trained run out to transformers and CTranslate2: the same translations, measured by
those libraries themselves, and CTranslate2's speed against ours.

  python experiments/export_parity/run.py --workdir=runs/demo [--limit N] [--tag NAME]

Translates the run's test split with our ``Translator`` (greedy and its beam), with
``transformers``' ``generate`` on ``main export --format=hf`` (greedy and beam 4), and
with CTranslate2 on ``--format=ctranslate2`` (float32) and ``ctranslate2-int8`` (greedy
and beam 4), all on this machine's CPU cores in one process. For each: the share of
outputs identical to ours in the same mode, corpus BLEU, and sentences per second
(ours: a second, warm call; the first compiles). Beam search: ours divides by the
GNMT penalty ((5 + len) / 6)^alpha, transformers and CTranslate2 by len^alpha (their
``length_penalty``, set to our alpha), so beam outputs may differ where the penalties
rank hypotheses differently; greedy has no penalty and should agree wherever the
logits do. Each sentence's output limit is its own source length + ``decode.max_extra``
in every system (theirs batch sentences of one source length), so a sentence that
never emits EOS is cut at the same length everywhere. First, teacher-forced on the
test split's references, the largest gap between transformers' logits (and
log-probabilities) and ours. Writes results.json and
table.md next to it (``--tag NAME``: results_NAME.json, table_NAME.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.data import sources  # noqa: E402
from flaxformer_lite.exchange import export  # noqa: E402
from flaxformer_lite.inference.evaluation import corpus_scores  # noqa: E402
from flaxformer_lite.inference.translate import Translator  # noqa: E402

HERE = Path(__file__).parent


def _timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def _batches(lengths, size):
    """Indices by length, in batches of equal source length (at most ``size``), so
    that a batch's length limit (source + extra) is each sentence's own, as ours."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, start = [], 0
    while start < len(order):
        stop = start
        while stop < len(order) and stop - start < size:
            if lengths[order[stop]] != lengths[order[start]]:
                break
            stop += 1
        out.append(order[start:stop])
        start = stop
    return out


def transformers_outputs(folder, sources_, beams, alpha, extra, batch=32):
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    ids = [tokenizer(s).input_ids for s in sources_]
    out = [""] * len(ids)
    for chunk in _batches([len(x) for x in ids], batch):
        width = max(len(ids[i]) for i in chunk)
        x = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, i in enumerate(chunk):
            x[r, : len(ids[i])] = torch.tensor(ids[i])
            mask[r, : len(ids[i])] = 1
        with torch.no_grad():
            got = model.generate(
                input_ids=x, attention_mask=mask, num_beams=beams, do_sample=False,
                length_penalty=alpha, max_new_tokens=width + extra, early_stopping=True,
            )  # fmt: skip
        for r, i in enumerate(chunk):
            out[i] = tokenizer.decode(got[r], skip_special_tokens=True)
    return out


def logit_gap(folder, ours, pairs, batch=64):
    """Largest |theirs - ours| over the real target positions, of the logits and of
    the log-probabilities, teacher-forced on ``pairs`` (source, reference)."""
    import jax
    import numpy as np
    import torch
    import transformers

    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    c, tokenizer = ours.config, ours.tokenizer
    params = ours.params[0] if isinstance(ours.params, tuple) else ours.params
    forward = jax.jit(lambda p, x, y: ours.model.apply({"params": p}, x, y))
    gap_logits = gap_logp = 0.0
    for start in range(0, len(pairs), batch):
        chunk = pairs[start : start + batch]
        xs = [tokenizer.encode(s)[: c.max_len] for s, _ in chunk]
        ys = [tokenizer.side(1).encode(t)[: c.max_len] for _, t in chunk]
        x = np.zeros((len(chunk), max(map(len, xs))), np.int32)
        y = np.zeros((len(chunk), max(map(len, ys))), np.int32)
        for i, (a, b) in enumerate(zip(xs, ys, strict=True)):
            x[i, : len(a)], y[i, : len(b)] = a, b
        mine = np.asarray(forward(params, x, y))
        start_ids = np.full((len(chunk), 1), c.bos_id)
        with torch.no_grad():
            theirs = model(
                input_ids=torch.tensor(x, dtype=torch.long),
                attention_mask=torch.tensor(x != 0, dtype=torch.long),
                decoder_input_ids=torch.tensor(np.concatenate([start_ids, y[:, :-1]], 1)),
            ).logits.numpy()
        real = y != 0
        gap_logits = max(gap_logits, float(np.abs(theirs - mine)[real].max()))
        logp = np.asarray(jax.nn.log_softmax(mine)), np.asarray(jax.nn.log_softmax(theirs))
        gap_logp = max(gap_logp, float(np.abs(logp[0] - logp[1])[real].max()))
    return gap_logits, gap_logp


def ctranslate2_outputs(folder, sp, sources_, beams, alpha, extra, batch=64):
    import ctranslate2

    translator = ctranslate2.Translator(
        str(folder), device="cpu", inter_threads=1, intra_threads=os.cpu_count() or 1
    )
    tokens = [sp.encode(s, out_type=str) + ["</s>"] for s in sources_]
    out = [""] * len(tokens)
    for chunk in _batches([len(t) for t in tokens], batch):
        results = translator.translate_batch(
            [tokens[i] for i in chunk], beam_size=beams, length_penalty=alpha,
            max_batch_size=batch, max_decoding_length=len(tokens[chunk[0]]) + extra,
        )  # fmt: skip
        for i, r in zip(chunk, results, strict=True):
            out[i] = sp.decode_pieces(r.hypotheses[0])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    suffix = f"_{args.tag}" if args.tag else ""
    ours = Translator.from_workdir(args.workdir)
    run = ours.run
    d, decode = run.config.data, run.config.decode
    pairs = sources.load_texts(d.dataset, d.test_split, d.features, d.data_dir)
    pairs = pairs[: args.limit] if args.limit else pairs
    srcs, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    alpha, extra = decode.alpha, decode.max_extra
    rows = []

    def row(system, mode, outputs, seconds, reference_outputs):
        same = sum(a == b for a, b in zip(outputs, reference_outputs, strict=True))
        rows.append({
            "system": system, "mode": mode, "bleu": corpus_scores(outputs, refs).bleu,
            "identical_to_ours": same / len(outputs), "sentences_per_s": len(outputs) / seconds,
        })  # fmt: skip
        print(rows[-1], flush=True)

    mine = {}
    for mode, beams in (("greedy", 1), ("beam 4", 4)):
        kw = {"beam_size": beams, "no_repeat_ngram": 0}
        ours.translate(srcs, **kw)  # the compiling call
        mine[mode], seconds = _timed(lambda kw=kw: ours.translate(srcs, **kw))
        row("ours (warm)", mode, mine[mode], seconds, mine[mode])
    with tempfile.TemporaryDirectory() as tmp:
        hf = export.export_workdir(args.workdir, "hf", Path(tmp) / "hf")
        gaps = logit_gap(hf, ours, pairs)
        print(f"teacher-forced gap to transformers: logits {gaps[0]:.2e}, log-probs {gaps[1]:.2e}")
        for mode, beams in (("greedy", 1), ("beam 4", 4)):
            outs, seconds = _timed(lambda b=beams: transformers_outputs(hf, srcs, b, alpha, extra))
            row("transformers", mode, outs, seconds, mine[mode])
        for fmt in ("ctranslate2", "ctranslate2-int8"):
            folder = export.export_workdir(args.workdir, fmt, Path(tmp) / fmt)
            for mode, beams in (("greedy", 1), ("beam 4", 4)):
                outs, seconds = _timed(
                    lambda b=beams, f=folder: ctranslate2_outputs(
                        f, run.tokenizer.sp, srcs, b, alpha, extra
                    )
                )
                row(fmt.replace("ctranslate2", "CTranslate2"), mode, outs, seconds, mine[mode])
    result = {
        "workdir": str(args.workdir), "sentences": len(srcs), "alpha": alpha,
        "cores": os.cpu_count(), "rows": rows,
        "layer_norm_epsilon": run.model_config.layer_norm_epsilon,
        "max_logit_gap": gaps[0], "max_log_prob_gap": gaps[1],
    }  # fmt: skip
    (HERE / f"results{suffix}.json").write_text(json.dumps(result, indent=1))
    ours_speed = {r["mode"]: r["sentences_per_s"] for r in rows if r["system"] == "ours (warm)"}
    lines = [
        "| system | mode | identical to ours | BLEU | sentences/s | vs ours |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['system']} | {r['mode']} | {r['identical_to_ours']:.1%} | {r['bleu']:.2f} | "
            f"{r['sentences_per_s']:.1f} | {r['sentences_per_s'] / ours_speed[r['mode']]:.2f}x |"
        )
    print("\n".join(lines))
    (HERE / f"table{suffix}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
