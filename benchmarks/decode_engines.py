"""Translating a test set: our Translator against CTranslate2 on the same weights.

  python benchmarks/decode_engines.py --workdir=runs/ende_small [--alpha 1.0] [--limit N]
  python benchmarks/decode_engines.py --workdir=RUN --batch_sizes=1,64   # on a GPU

A trained translation run's test split, on this machine's CPU cores, in one process:

- ours: ``Translator.translate`` on the whole split, greedy and beam 4, cold (a fresh
  translator whose searches are not compiled yet: the first call of a process) and
  warm (the same call again); the compiles of each call counted from jax's caches;
  beam 4 under each stopping rule (``decode.beam_stop``): exact, current, finished;
- CTranslate2 (float32 and int8) on ``main export --format=ctranslate2`` of the same
  checkpoint: ``translate_batch``, greedy and beam 4, length_penalty = alpha
  (CTranslate2 divides by len^alpha, we by ((5 + len) / 6)^alpha: beam outputs may
  differ where the penalties rank hypotheses differently), one batch at a time on
  every core (``inter_threads=1``, the baseline the goals were set against) and two
  batches at once on half the cores each (``inter_threads=2``), as ours runs two
  (``decode.streams``);
- ours cached: the first call of a fresh process whose searches are in XLA's
  persistent compilation cache (what ``main translate``/``evaluate`` and a sweep's
  later points find, ``--compilation_cache``): tracing and loading, no compiling.
  One process fills a new cache folder, the next times its first call against its
  second (its own warm call).

With ``--batch_sizes``: the accelerator's table instead (``batch_table``), batches of
a fixed number of sentences, written to decode_batches.{json,md}.

For each row: sentences/s, output tokens/s, the share of outputs identical to ours
(beam: to ours with the exact rule) and corpus BLEU. Ours is timed warm ``--rounds``
times, each beside CTranslate2 fp32 runs of the same mode (this machine's speed
drifts within a minute): its ratios are the medians of the rounds' ratios, its
sentences/s the median time's. Cold runs compile in this process, with no
persistent compilation cache. Writes
benchmarks/results/decode_engines.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.data import sources  # noqa: E402
from flaxformer_lite.exchange import export  # noqa: E402
from flaxformer_lite.inference import decoding, programs  # noqa: E402
from flaxformer_lite.inference.ahead import default_streams  # noqa: E402
from flaxformer_lite.inference.continuous import beam_continuous, greedy_continuous  # noqa: E402
from flaxformer_lite.inference.evaluation import corpus_scores  # noqa: E402
from flaxformer_lite.inference.translate import Translator  # noqa: E402


def compiles() -> int:
    """Searches compiled so far: kept by jax.jit, or as programs (inference/programs.py)."""
    searches = (decoding.beam_search, decoding.sample, greedy_continuous, beam_continuous)
    return sum(f._cache_size() for f in searches) + programs.STATS["compiled"]


def first_calls(
    workdir: str, texts, beams: int, stop: str, alpha: float, continuous: bool = True
) -> dict:
    """This process's first and second translate call (seconds), the outputs of the
    second and the programs loaded from the persistent compilation cache."""
    hits = []
    jax.monitoring.register_event_listener(
        lambda event, **_: hits.append(1) if event.endswith("/cache_hits") else None
    )
    translator = Translator.from_workdir(workdir)
    translator.decode = translator.decode.replace(beam_stop=stop, continuous=continuous)
    options = dict(beam_size=beams, alpha=alpha, no_repeat_ngram=0)
    times, outputs = [], None
    for _ in range(2):
        started = time.perf_counter()
        outputs = translator.translate(texts, **options)
        times.append(time.perf_counter() - started)
    return {"first": times[0], "second": times[1], "outputs": outputs, "hits": len(hits),
            "loaded": programs.STATS["loaded"]}  # fmt: skip


def cached_first_call(args, beams: int, stop: str, folder: Path, continuous: bool) -> dict:
    """Two fresh processes on one new persistent cache folder: the first compiles and
    fills it, the second's first call finds its searches there. Every program is
    kept (``main`` keeps those that took 0.5 s to compile)."""
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(folder))
    env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    command = [sys.executable, __file__, f"--workdir={args.workdir}", f"--alpha={args.alpha}",
               f"--limit={args.limit}",
               f"--first_calls={beams},{stop},{int(continuous)}"]  # fmt: skip
    runs = []
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {"filling": runs[0], "cached": runs[1]}


def ctranslate2_outputs(folder, sp, texts, beams, alpha, extra, inter=1, batch=64, device="cpu"):
    """CTranslate2's outputs, seconds and output pieces; ``inter`` batches at once, each
    on cores / inter threads (on the CPU), of at most ``batch`` sentences."""
    import ctranslate2

    cores = os.cpu_count() or 1
    translator = ctranslate2.Translator(
        str(folder), device=device, inter_threads=inter, intra_threads=max(1, cores // inter)
    )
    tokens = [sp.encode(s, out_type=str) + ["</s>"] for s in texts]
    started = time.perf_counter()
    results = translator.translate_batch(
        tokens, beam_size=beams, length_penalty=alpha, max_batch_size=batch,
        max_decoding_length=max(len(t) for t in tokens) + extra,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    outputs = [r.hypotheses[0] for r in results]
    return [sp.decode_pieces(o) for o in outputs], seconds, sum(len(o) + 1 for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=str(ROOT / "runs" / "ende_small"))
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=0)
    parser.add_argument(
        "--rounds", type=int, default=3, help="warm runs of ours, each beside one of CTranslate2"
    )
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument(
        "--batch_sizes", default="",
        help="e.g. 1,64: the table at batches of that many sentences, greedy and beam 4, on "
        "jax's device (the accelerator's table); writes decode_batches.{json,md}",
    )  # fmt: skip
    # BEAMS,STOP,CONTINUOUS (1 or 0): a child process's run
    parser.add_argument("--first_calls", help=argparse.SUPPRESS)
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)  # before the measuring, not after it
    probe = Translator.from_workdir(args.workdir)
    run = probe.run
    d = run.config.data
    pairs = sources.load_texts(d.dataset, d.test_split, d.features, d.data_dir)
    pairs = pairs[: args.limit] if args.limit else pairs
    texts, refs = [p[0] for p in pairs], [p[1] for p in pairs]
    if args.first_calls:
        beams, stop, cont = args.first_calls.split(",")
        found = first_calls(args.workdir, texts, int(beams), stop, args.alpha, cont == "1")
        print(json.dumps(found))
        return
    if args.batch_sizes:
        batch_table(args, run, texts, refs)
        return
    tokenizer = run.tokenizer
    rows, reference = [], {}

    def row(system, mode, outputs, seconds, **extra):
        same = reference.get(mode)
        tokens = sum(len(tokenizer.side(1).encode(o)) for o in outputs)
        rows.append({
            "system": system, "mode": mode, "sentences_per_s": len(outputs) / seconds,
            "tokens_per_s": tokens / seconds, "seconds": seconds,
            "identical": None if same is None else
            sum(a == b for a, b in zip(outputs, same, strict=True)) / len(outputs),
            "bleu": corpus_scores(outputs, refs).bleu, **extra,
        })  # fmt: skip
        print(rows[-1], flush=True)

    # (mode, beams, beam_stop, decode.continuous): continuous batching (the default)
    # and batch by batch
    modes = [("greedy", 1, "exact", True), ("greedy", 1, "exact", False),
             ("beam 4", 4, "exact", True), ("beam 4", 4, "current", True),
             ("beam 4", 4, "current", False), ("beam 4", 4, "finished", True)]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folders = {
            fmt: export.export_workdir(args.workdir, fmt, Path(tmp) / fmt)
            for fmt in ("ctranslate2", "ctranslate2-int8")
        }

        def engine(fmt, beams, inter=1):
            return ctranslate2_outputs(
                folders[fmt], tokenizer.sp, texts, beams, args.alpha,
                run.config.decode.max_extra, inter,
            )  # fmt: skip

        engine_seconds = {}  # CTranslate2 fp32's times, measured beside ours
        pair_seconds = {}  # the same with two batches at once (inter_threads=2)
        for mode, beams, stop, cont in modes:
            # a fresh translator; its searches compile on the first call (cold)
            translator = Translator.from_workdir(args.workdir)
            options = dict(beam_size=beams, alpha=args.alpha, no_repeat_ngram=0)
            translator.decode = translator.decode.replace(beam_stop=stop, continuous=cont)
            jax.clear_caches()  # every search compiles anew: this row's first call is cold
            programs.clear()
            before = compiles()
            started = time.perf_counter()
            translator.translate(texts, **options)
            cold = time.perf_counter() - started
            compiled = compiles() - before
            # This machine's speed drifts within a minute: each round times ours, then
            # CTranslate2 fp32 on the same mode, and the ratio is the rounds' median.
            warm, ratios, pair_ratios = [], [], []
            for _ in range(args.rounds):
                started = time.perf_counter()
                outputs = translator.translate(texts, **options)
                warm.append(time.perf_counter() - started)
                engine_outputs, seconds, _ = engine("ctranslate2", beams)
                engine_seconds.setdefault(mode, ([], engine_outputs))[0].append(seconds)
                ratios.append(seconds / warm[-1])
                engine_outputs, seconds, _ = engine("ctranslate2", beams, inter=2)
                pair_seconds.setdefault(mode, ([], engine_outputs))[0].append(seconds)
                pair_ratios.append(seconds / warm[-1])
            folder = Path(tmp) / f"xla-{beams}-{stop}-{int(cont)}"
            fresh = cached_first_call(args, beams, stop, folder, cont)
            if fresh["cached"].pop("outputs") != outputs:
                raise RuntimeError(f"{mode} ({stop}): the cached programs translate otherwise")
            fresh["filling"].pop("outputs")
            parts = [stop] * (beams > 1) + ["batch by batch"] * (not cont)
            label = f"ours ({', '.join(parts)})" if parts else "ours"
            if stop == "exact" and mode not in reference:
                reference[mode] = outputs
            streams = translator.decode.streams or default_streams(translator.params)
            row(label, mode, outputs, statistics.median(warm), cold_seconds=cold,
                cached=fresh["cached"]["first"] / fresh["cached"]["second"],
                fresh_processes=fresh, compiles=compiled, vs_ct2=statistics.median(ratios),
                ratios=ratios,
                vs_ct2_pair=statistics.median(pair_ratios), pair_ratios=pair_ratios,
                streams=streams)  # fmt: skip
        for mode, beams in (("greedy", 1), ("beam 4", 4)):
            times, outputs = engine_seconds[mode]
            row("CTranslate2", mode, outputs, statistics.median(times))
            times, outputs = pair_seconds[mode]
            row("CTranslate2, 2 batches at once", mode, outputs, statistics.median(times))
            outputs, seconds, _ = engine("ctranslate2-int8", beams)
            row("CTranslate2-int8", mode, outputs, seconds)
    write(args, rows, len(texts))


def batch_table(args, run, texts, refs) -> None:
    """Ours and CTranslate2 at fixed batches of sentences (``--batch_sizes``), greedy
    and beam 4 under the run's stopping rule, on jax's default device; CTranslate2 fp32
    and int8 on CUDA where it sees a GPU, else on the CPU, and left out where it is not
    installed (its export needs transformers and torch). Ours: cold, then ``--rounds``
    warm calls (the median); one engine call each."""
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    device = "cpu"
    if ctranslate2 is not None and ctranslate2.get_cuda_device_count() > 0:
        device = "cuda"
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    tokenizer, rows = run.tokenizer, []

    def add(system, mode, batch, outputs, seconds, **extra):
        tokens = sum(len(tokenizer.side(1).encode(o)) for o in outputs)
        rows.append({
            "system": system, "mode": mode, "batch": batch, "seconds": seconds,
            "sentences_per_s": len(outputs) / seconds, "tokens_per_s": tokens / seconds,
            "bleu": corpus_scores(outputs, refs).bleu, **extra,
        })  # fmt: skip
        print(rows[-1], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        folders = {}
        if ctranslate2 is not None:
            folders = {
                fmt: export.export_workdir(args.workdir, fmt, Path(tmp) / fmt)
                for fmt in ("ctranslate2", "ctranslate2-int8")
            }
        for batch in sizes:
            # continuous batching (the default) and batch by batch
            for mode, beams, cont in (("greedy", 1, True), ("greedy", 1, False),
                                      ("beam 4", 4, True), ("beam 4", 4, False)):  # fmt: skip
                translator = Translator.from_workdir(args.workdir, batch_size=batch)
                translator.decode = translator.decode.replace(continuous=cont)
                options = dict(beam_size=beams, alpha=args.alpha, no_repeat_ngram=0)
                jax.clear_caches()  # the first call compiles: cold
                started = time.perf_counter()
                translator.translate(texts, **options)
                cold, warm = time.perf_counter() - started, []
                for _ in range(args.rounds):
                    started = time.perf_counter()
                    outputs = translator.translate(texts, **options)
                    warm.append(time.perf_counter() - started)
                add("ours" if cont else "ours (batch by batch)", mode, batch, outputs,
                    statistics.median(warm), cold_seconds=cold,
                    device=str(jax.devices()[0].platform))  # fmt: skip
                for fmt, folder in folders.items() if cont else ():
                    outputs, seconds, _ = ctranslate2_outputs(
                        folder, tokenizer.sp, texts, beams, args.alpha,
                        run.config.decode.max_extra, batch=batch, device=device,
                    )  # fmt: skip
                    system = fmt.replace("ctranslate2", "CTranslate2")
                    add(system, mode, batch, outputs, seconds, device=device)
    engines = {(r["mode"], r["batch"]): r for r in rows if r["system"] == "CTranslate2"}
    lines = [
        f"Test split of `{args.workdir}`: {len(texts)} sentences, alpha {args.alpha}, "
        f"batches of a fixed number of sentences; ours on {jax.devices()[0].device_kind}, "
        + (f"CTranslate2 on {device}:" if folders else "CTranslate2 not installed:"),
        "",
        f"    python benchmarks/decode_engines.py --workdir={args.workdir} "
        f"--alpha={args.alpha} --batch_sizes={args.batch_sizes} --rounds={args.rounds}"
        + (f" --limit={args.limit}" if args.limit else ""),
        "",
        "| system | mode | batch | sentences/s | tokens/s | vs CTranslate2 fp32 | "
        "cold / warm | BLEU |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        engine = engines.get((r["mode"], r["batch"]))
        ratio = f"{r['sentences_per_s'] / engine['sentences_per_s']:.2f}x" if engine else ""
        cold = f"{r['cold_seconds'] / r['seconds']:.2f}" if "cold_seconds" in r else ""
        lines.append(
            f"| {r['system']} | {r['mode']} | {r['batch']} | {r['sentences_per_s']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {ratio} | {cold} | {r['bleu']:.2f} |"
        )
    out = Path(args.out)
    (out / "decode_batches.json").write_text(json.dumps({"workdir": args.workdir, "rows": rows}))
    (out / "decode_batches.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def write(args, rows, sentences) -> None:
    ct2 = {r["mode"]: r["sentences_per_s"] for r in rows if r["system"] == "CTranslate2"}
    pair = {
        r["mode"]: r["sentences_per_s"]
        for r in rows
        if r["system"] == "CTranslate2, 2 batches at once"
    }
    lines = [
        f"Test split of `{args.workdir}`: {sentences} sentences, alpha {args.alpha}, "
        f"{os.cpu_count()} CPU cores, one process:",
        "",
        f"    python benchmarks/decode_engines.py --workdir={args.workdir} "
        f"--alpha={args.alpha} --rounds={args.rounds}",
        "",
        "vs CTranslate2 fp32: one batch at a time on every core (inter_threads=1); vs its "
        "2 at once: two batches at once (inter_threads=2), as ours runs two on CPU "
        "(decode.streams). Cold: the first call of this process, which compiles its "
        "searches; cached: the first call of a fresh process whose searches are in the "
        "persistent compilation cache (main's --compilation_cache), against its second.",
        "",
        "| system | mode | sentences/s | tokens/s | vs CTranslate2 fp32 | vs its 2 at once | "
        "cold / warm | cached / warm | compiles | identical | BLEU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cold = f"{r['cold_seconds'] / r['seconds']:.2f}" if "cold_seconds" in r else ""
        cached = f"{r['cached']:.2f}" if "cached" in r else ""
        same = "" if r["identical"] is None else f"{r['identical']:.1%}"
        ratio = r.get("vs_ct2", r["sentences_per_s"] / ct2[r["mode"]])
        ratio2 = r.get("vs_ct2_pair", r["sentences_per_s"] / pair[r["mode"]])
        lines.append(
            f"| {r['system']} | {r['mode']} | {r['sentences_per_s']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {ratio:.2f}x | {ratio2:.2f}x | {cold} | {cached} | "
            f"{r.get('compiles', '')} | {same} | {r['bleu']:.2f} |"
        )
    out = Path(args.out)
    (out / "decode_engines.json").write_text(
        json.dumps({"workdir": args.workdir, "alpha": args.alpha, "rows": rows}, indent=1)
    )
    (out / "decode_engines.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
