"""The accelerator path measured: train step (tokens/s, MFU), attention kernels, decoding.

  python benchmarks/accelerator.py --out DIR             # on a GPU: ~5 min on an H200
  python benchmarks/accelerator.py --out DIR --tiny      # dry run on CPU: same code, tiny sizes
  python benchmarks/accelerator.py --out DIR --only attention,decode

Sections (each writes ``DIR/accelerator.{json,md}`` as soon as it is done, so a run
stopped by a time limit keeps what it measured; ``--minutes`` caps each section and
the rows it did not reach are listed as such):

* ``env``: device, driver, cuDNN and package versions; the bf16 matmul peak measured
  here (best of ten chains of ten 8192^3 products) beside the datasheet's dense bf16 peak.
* ``train``: our train step for paper_base (packed rows, and rows of one example each,
  where cuDNN takes its plain layout; a 4x batch), paper_big and ende_small (a GPU-sized
  batch and the recipe's), bfloat16 compute with float32 parameters, attention by
  cuDNN and by XLA's plain dense kernel; flax's examples/wmt (benchmarks/peer.py) on
  the same shapes, dtype and batch in the same process. Rows run in one priority list
  (``train_cases``), so a section cut short keeps the first; ``--rows`` picks some.
  Attention dropout is 0 on both sides (cuDNN's kernel has none); other dropout 0.1.
  Tokens/s counts real target tokens; MFU = the analytic model FLOPs
  (training/flops.py, every slot of the rows) per second over the measured matmul peak
  and over the datasheet's. Batches are synthetic rows already on the device.
* ``attention``: forward+backward time, achieved TFLOP/s and XLA's peak buffer size of
  the kernels at 1k-64k tokens (``--lengths``; B*n = 64k tokens, 8 heads of 64,
  bfloat16): cuDNN dense, causal and causal local (window 256); tokamax's Mosaic-GPU
  kernel (where the bundle installed it) dense, causal, causal local and two-sided
  local, each checked against its reference (cuDNN, or the blocked kernel for the
  two-sided window) on the same inputs: the largest relative difference of dq, dk, dv;
  the blocked causal and two-sided local and BigBird kernels, chunked dense (causal
  and not), and XLA's plain dense kernel up to 16k. FLOPs count only the (query, key)
  pairs the pattern allows, 4 d per pair forward, x3.5 for forward+backward
  (FlashAttention-2's count: the backward pass is 2.5 forwards). Ratios: each
  kernel's time over its reference's for the same pattern. The project's block-skipping
  band kernel (sparse/ops/band/pallas_triton.py: causal and two-sided window, causal and dense), and
  forward-only rows ("... fwd", FLOPs x1) of the causal window for cuDNN, tokamax and
  the band kernel, which tell whether a kernel's forward or backward fails to skip.
  The fused block-sparse kernel (sparse/ops/block_sparse/pallas_triton.py) on BigBird, Longformer,
  the Sparse Transformer's strided and fixed (causal, stride 128), dilated and the
  two-sided window, each against cuDNN's dense (or causal) kernel. Dynamic block
  routing (8 blocks of 64 per query, routing included): MoBA's per-query choice on the
  gather kernel (sparse/ops/chosen_blocks/pallas_triton_gather.py), on the tile kernel
  (sparse/ops/chosen_blocks/pallas_triton_tiles.py)
  and on XLA's (the CPU path), its block gate on the tile kernel, the routing alone,
  and NSA (window 256; its compressed branch fused, sparse/ops/nsa/compressed_triton.py, and in
  XLA) against cuDNN's causal (dense) kernel.
  ``--kernels`` picks rows by name.
* ``decode``: cached greedy and beam-4 new tokens/s at batch 1 and 64 (source 32, 64
  new tokens, EOS never emitted so every row does the full work), ende_small and
  paper_base shapes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16, SXM, TFLOP/s x 1e12
SECTIONS = ("env", "train", "attention", "decode")


# Helpers -------------------------------------------------------------------------------


def _datasheet_peak(kind: str) -> float | None:
    return next((v for k, v in DATASHEET_BF16.items() if k in kind), None)


def _timed_blocks(run, blocks: int, per_block: int) -> float:
    """Median over ``blocks`` of (seconds for ``per_block`` calls) / per_block: calls are
    dispatched back to back and waited for at the end of each block."""
    times = []
    for _ in range(blocks):
        t = time.perf_counter()
        out = None
        for _ in range(per_block):
            out = run()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / per_block)
    return statistics.median(times)


class Budget:
    """A section's wall-clock allowance: rows after it runs out are listed as not reached.
    0 minutes: no allowance (a dry run that must reach every row, however busy the machine)."""

    def __init__(self, minutes: float):
        self.end = time.monotonic() + 60 * minutes if minutes > 0 else float("inf")

    def left(self) -> bool:
        return time.monotonic() < self.end


def _write(out: Path, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "accelerator.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "accelerator.md").write_text(report(result))


# env -----------------------------------------------------------------------------------


def environment(tiny: bool) -> dict:
    import flax
    import optax

    from flaxformer_lite.training.flops import matmul_peak_flops

    dev = jax.devices()[0]
    info = {
        "device": dev.device_kind,
        "platform": jax.default_backend(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "flax": flax.__version__,
        "optax": optax.__version__,
    }
    try:
        from jax._src.lib import cuda_versions

        info["cudnn"] = cuda_versions.cudnn_get_version() if cuda_versions else None
    except Exception:  # noqa: BLE001 - a version string is optional
        info["cudnn"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    n = 256 if tiny else 8192
    info["matmul_peak_tflops"] = matmul_peak_flops(n, 10, jnp.bfloat16, chain=10) / 1e12
    info["matmul_peak_shape"] = f"{n}^3 bf16"
    sheet = _datasheet_peak(dev.device_kind)
    info["datasheet_peak_tflops"] = None if sheet is None else sheet / 1e12
    return info


# train ---------------------------------------------------------------------------------


def train_cases(tiny: bool):
    """The train-step runs in the order measured (a section cut short by --minutes keeps
    the first): (label, ModelConfig, batch rows, row length, attention, layout), where
    attention None is the flax examples/wmt peer and layout is "packed" (synthetic rows of
    ~14-token examples) or "whole" (one example filling each row, no segment ids)."""
    from flaxformer_lite.config.files import load_config
    from flaxformer_lite.config.model import PRESETS, ModelConfig, model_config_from

    ende = model_config_from(load_config(str(ROOT / "configs" / "ende_small.py")))
    if tiny:
        small = ModelConfig(
            vocab_size=400, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
            num_decoder_layers=1, max_len=64,
        )  # fmt: skip
        small = ende.replace(**_shape(small))
        runs = [("cudnn", "packed"), ("blocked", "packed"), ("cudnn", "whole"),
                ("blocked", "whole"), (None, "packed")]  # fmt: skip
        return [("ende_small", small, 4, 32, impl, layout) for impl, layout in runs]
    base = PRESETS["paper_base"].replace(vocab_size=37000)
    big = PRESETS["paper_big"].replace(vocab_size=37000)
    return [  # the goal's rows first, then the other models, then what was measured before
        ("paper_base", base, 200, 128, "blocked", "packed"),
        ("paper_base", base, 200, 128, "cudnn", "whole"),
        ("paper_base", base, 200, 128, "blocked", "whole"),
        ("paper_base", base, 200, 128, None, "packed"),
        ("paper_big", big, 200, 128, "blocked", "packed"),
        ("paper_base", base, 800, 128, "blocked", "packed"),
        ("ende_small", ende, 512, 64, "blocked", "packed"),
        ("ende_small", ende, 512, 64, None, "packed"),
        ("paper_big", big, 200, 128, "cudnn", "whole"),
        ("paper_big", big, 200, 128, None, "packed"),
        ("ende_small (recipe batch)", ende, 32, 64, "blocked", "packed"),
        ("paper_base", base, 200, 128, "cudnn", "packed"),
        ("ende_small", ende, 512, 64, "cudnn", "packed"),
    ]


def _shape(c) -> dict:
    names = ("vocab_size", "d_model", "num_heads", "d_ff", "num_encoder_layers")
    return {n: getattr(c, n) for n in (*names, "num_decoder_layers", "max_len")}


def _bf16(c, impl: str):
    """The config as measured: bfloat16 compute, float32 parameters, dropout 0.1 except
    on the attention weights (cuDNN's kernel has none)."""
    return c.replace(
        dtype="bfloat16", param_dtype="float32", attention_impl=impl, attention_dropout=0.0,
        embedding_dropout=0.1, residual_dropout=0.1, ffn_dropout=0.0,
    )  # fmt: skip


def _our_step(config, length: int):
    from flaxformer_lite.config.experiment import OptimizerConfig
    from flaxformer_lite.model.transformer import Transformer
    from flaxformer_lite.training import steps
    from flaxformer_lite.training.state import create_train_state, make_optimizer

    model = Transformer(config)
    tx, schedule = make_optimizer(OptimizerConfig(warmup_steps=1000), config, 10_000)
    state = create_train_state(model, tx, 0, length)
    fn = jax.jit(
        functools.partial(
            steps.train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1
        ),
        donate_argnums=(0,),
    )
    return lambda s, b: fn(s, b), state


def _peer_step(config, length: int):
    import peer

    fn, state, rng = peer.compiled_train_step(config, length, dropout=0.1, attention_dropout=0.0)
    return lambda s, b: fn(s, b, rng), state


def measure_train(
    tiny: bool, budget: Budget, peak: float, sheet: float | None, only: list[str] | None = None
) -> list[dict]:
    """The train-step rows; ``only``: keep the rows whose "model batch run" contains one
    of these strings (e.g. ["paper_big", "examples/wmt", "800x128"])."""
    from flaxformer_lite.data import pipeline
    from flaxformer_lite.training import flops

    rows = []
    blocks, per_block = (2, 2) if tiny else (3, 10)
    batches = {}  # (rows, length, vocab, layout) -> host batch, shared by the runs on it
    for label, base, batch, length, impl, layout in train_cases(tiny):
        shape = (batch, length, base.vocab_size, layout)
        if shape not in batches:
            whole = {"mean_length": length} if layout == "whole" else {}
            host = pipeline.synthetic_batch(batch, length, base.vocab_size, **whole)
            if layout == "whole":  # one example per row: no segment ids, cuDNN's plain layout
                host = {k: v for k, v in host.items() if "segment" not in k}
            batches[shape] = host
        host = batches[shape]
        step_flops = flops.train_step_flops(base, batch, length, length)
        who = "ours" if impl else "flax examples/wmt"
        data = {k: jnp.asarray(v) for k, v in host.items()}
        tokens = int((host["targets"] != 0).sum())
        name = f"{who} ({'cuDNN' if impl == 'cudnn' else 'XLA dense'})" if impl else who
        if layout == "whole":
            name += ", one example per row"
        row = {"model": label, "batch": f"{batch}x{length}", "run": name}
        if only and not any(o in f"{label} {row['batch']} {name}" for o in only):
            continue
        if not budget.left():
            rows.append({**row, "status": "not reached (time budget)"})
            continue
        try:
            config = _bf16(base, impl or "blocked")
            make = _peer_step if impl is None else _our_step
            step, state = make(config, length)
            holder = {"state": state}

            def run(step=step, holder=holder, data=data):
                holder["state"], metrics = step(holder["state"], data)
                return metrics["loss"]

            t0 = time.perf_counter()
            jax.block_until_ready(run())
            compile_s = time.perf_counter() - t0
            jax.block_until_ready(run())
            seconds = _timed_blocks(run, blocks, per_block)
            row.update(
                status="ok",
                step_ms=1e3 * seconds,
                compile_s=compile_s,
                target_tokens_per_s=tokens / seconds,
                model_tflops_per_s=step_flops / seconds / 1e12,
                mfu_measured_peak=step_flops / seconds / peak,
                mfu_datasheet=None if sheet is None else step_flops / seconds / sheet,
            )
            del holder, state
        except Exception as e:  # noqa: BLE001 - a failing row is a result to report
            row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
        rows.append(row)
        print(_train_line(row), flush=True)
    return rows


# attention -----------------------------------------------------------------------------

HEADS, HEAD_DIM, TOKENS, WINDOW = 8, 64, 65536, 256
STRIDE = 128  # the Sparse Transformer's strided and fixed patterns
DYNAMIC_BLOCK, DYNAMIC_K = 64, 8  # moba/nsa rows: 8 blocks of 64 (512 keys) per query


def _import_tokamax():
    """tokamax (Mosaic-GPU flash attention with per-row key ranges, which skips the key
    blocks outside a band), or None where it is not installed (the accelerator bundle
    brings it: benchmarks/gpu/bundle.sh). Its package imports xprof for its own
    benchmarking helpers only; where xprof is absent an empty stand-in takes its place,
    since the attention kernels never call it."""
    import types

    try:
        import xprof.cli.tools  # noqa: F401
    except ImportError:
        for name in ("xprof", "xprof.cli", "xprof.cli.tools"):
            sys.modules.setdefault(name, types.ModuleType(name))
        sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None
    try:
        import tokamax
    except Exception:  # noqa: BLE001 - absent, or built for another jax
        return None
    return tokamax


def attention_kernels():
    """name: (fn(q, k, v), pattern for FLOP counting, the row to compare with). Rows whose
    reference is a fused kernel are checked against it (values and gradients) too."""
    from flaxformer_lite.model import kernels
    from flaxformer_lite.model.attention import dot_product_attention
    from flaxformer_lite.model.chunked import chunked_attention
    from flaxformer_lite.sparse.grammar import patterns as P
    from flaxformer_lite.sparse.ops.block_sparse.xla import sparse_attention

    local = P.Local(WINDOW).causal()
    band = P.Local(WINDOW)  # two-sided: keys i-w..i+w, an encoder's window
    bigbird = P.bigbird(block_size=64, window_blocks=3, global_blocks=2, random_blocks=3)
    out = {
        "cudnn dense": (lambda q, k, v: kernels.cudnn_attention(q, k, v), P.Full(), None),
        "cudnn causal": (
            lambda q, k, v: kernels.cudnn_attention(q, k, v, causal=True),
            P.Full().causal(),
            None,
        ),
        "cudnn local (causal)": (
            lambda q, k, v: kernels.cudnn_attention(q, k, v, pattern=local),
            local,
            None,
        ),
    }
    tokamax = _import_tokamax()
    if tokamax is not None:
        impl = "mosaic" if jax.default_backend() == "gpu" else "xla"

        def tk(**kw):
            return lambda q, k, v: tokamax.dot_product_attention(q, k, v, implementation=impl, **kw)

        out.update({
            "tokamax local (causal)": (
                tk(is_causal=True, local_window_size=(WINDOW, 0)), local, "cudnn local (causal)"
            ),
            "tokamax dense": (tk(), P.Full(), "cudnn dense"),
            "tokamax causal": (tk(is_causal=True), P.Full().causal(), "cudnn causal"),
        })  # fmt: skip
    out["blocked local (causal)"] = (
        lambda q, k, v: sparse_attention(q, k, v, local, block_size=128),
        local,
        "cudnn local (causal)",
    )
    out["blocked local (two-sided)"] = (
        lambda q, k, v: sparse_attention(q, k, v, band, block_size=128),
        band,
        None,
    )
    if tokamax is not None:
        out["tokamax local (two-sided)"] = (
            tk(local_window_size=(WINDOW, WINDOW)), band, "blocked local (two-sided)"
        )  # fmt: skip
    # The block-skipping band kernel of our own (sparse/ops/band/pallas_triton.py, Triton on a GPU):
    # each pattern against cuDNN where cuDNN computes it, the two-sided window against
    # the blocked kernel (cuDNN has no such window).
    out.update(
        {
            f"band {name}": (_band(pattern), pattern, ref)
            for name, pattern, ref in (
                ("local (causal)", local, "cudnn local (causal)"),
                ("local (two-sided)", band, "blocked local (two-sided)"),
                ("causal", P.Full().causal(), "cudnn causal"),
                ("dense", P.Full(), "cudnn dense"),
            )
        }
    )
    # Forward passes alone, to tell which pass of a kernel skips the window's blocks.
    out["cudnn local (causal) fwd"] = (out["cudnn local (causal)"][0], local, None)
    out["band local (causal) fwd"] = (
        out["band local (causal)"][0],
        local,
        "cudnn local (causal) fwd",
    )
    if tokamax is not None:
        out["tokamax local (causal) fwd"] = (
            out["tokamax local (causal)"][0], local, "cudnn local (causal) fwd"
        )  # fmt: skip
    out.update({
        "blocked bigbird": (
            lambda q, k, v: sparse_attention(q, k, v, bigbird, block_size=64),
            bigbird,
            "cudnn dense",
        ),
        "chunked dense": (lambda q, k, v: chunked_attention(q, k, v), P.Full(), "cudnn dense"),
        "chunked causal": (
            lambda q, k, v: chunked_attention(q, k, v, causal=True),
            P.Full().causal(),
            "cudnn causal",
        ),
        "xla dense": (lambda q, k, v: dot_product_attention(q, k, v), P.Full(), "cudnn dense"),
    })  # fmt: skip
    # The fused block-sparse kernel (sparse/ops/block_sparse/pallas_triton.py) on every other
    # pattern,
    # against cuDNN's dense kernel (a causal pattern: its causal kernel); its two-sided
    # window beside the band kernel's.
    for name, pattern in {
        "bigbird": bigbird,
        "longformer": P.longformer(WINDOW, (0,)),
        "strided (causal)": P.sparse_transformer_strided(STRIDE).causal(),
        "fixed (causal)": P.Fixed(STRIDE, 8).causal(),
        "dilated": P.Dilated(WINDOW // 8, 8),
        "local (two-sided)": band,
    }.items():
        ref = "cudnn causal" if pattern.is_causal else "cudnn dense"
        out[f"block-sparse {name}"] = (_block_sparse(pattern), pattern, ref)
    out.update(_dynamic_kernels())
    return out


def _dynamic_kernels():
    """Dynamic block routing (MoBA, NSA) on the fused routed kernels, routing included:
    a choice per query on the gather kernel (key block by key block; routed by the fused
    routing kernel on a GPU, and by XLA's scores and top blocks), the same routing
    on the tile kernel (query tiles over their queries' union) and on XLA's gather
    kernel (the CPU path), and a choice per query block on the tile kernel."""
    from flaxformer_lite.sparse.grammar import dynamic as D
    from flaxformer_lite.sparse.ops.chosen_blocks.pallas_triton_tiles import routed_block_attention
    from flaxformer_lite.sparse.ops.moba.xla import moba_attention
    from flaxformer_lite.sparse.ops.nsa.xla import init_params, nsa_attention

    B, K = DYNAMIC_BLOCK, DYNAMIC_K
    causal = D.MoBA(B, K).causal()
    gate = D.MoBA(B, K, block_gate=True)
    nsa = D.NSA(B, K, WINDOW).causal()
    params = init_params(HEADS, HEAD_DIM, HEAD_DIM)

    def moba(kernel, **kw):
        return lambda q, k, v: moba_attention(q, k, v, K, block=B, kernel=kernel, **kw)

    def moba_tiles(q, k, v):
        r = moba_attention(q, k, v, K, block=B, causal=True, routing_only=True)
        return routed_block_attention(q, k, v, r.table, r.valid, block=B, causal=True)

    return {
        f"moba k={K} causal (gather)": (moba("triton", causal=True), causal, "cudnn causal"),
        f"moba k={K} causal (gather; xla routing)": (
            moba("triton", causal=True, route="xla"), causal, "cudnn causal"
        ),
        f"moba k={K} causal (tiles)": (moba_tiles, causal, "cudnn causal"),
        f"moba k={K} causal (xla)": (moba("xla", causal=True), causal, "cudnn causal"),
        f"moba k={K} block gate (tiles)": (
            moba("triton", block_gate=True), gate, "cudnn dense"
        ),
        **{f"moba k={K} routing (causal{how}) fwd": (
            lambda q, k, v, route=route: moba_attention(
                q, k, v, K, block=B, causal=True, routing_only=True, route=route
            ).table.astype(q.dtype)[..., :1].swapaxes(1, 2) * q[..., :1],
            causal, None,
        ) for route, how in ((None, ""), ("xla", "; xla"))},
        f"nsa k={K} w={WINDOW} (causal)": (
            lambda q, k, v: nsa_attention(q, k, v, params, K, WINDOW, block=B, causal=True,
                                          kernel="triton"),
            nsa, "cudnn causal",
        ),
        f"nsa k={K} w={WINDOW} (causal; xla compressed)": (
            lambda q, k, v: nsa_attention(q, k, v, params, K, WINDOW, block=B, causal=True,
                                          kernel="triton", route="xla"),
            nsa, "cudnn causal",
        ),
    }  # fmt: skip


def _dynamic_pairs(pattern, n: int) -> float:
    """The (query, key) pairs a dynamic pattern reads at length n, where every earlier
    block is a candidate (no packing): MoBA's own block (causal part) and min(k - 1,
    earlier blocks) chosen ones; a block gate's k blocks; NSA's selected pairs plus its
    window and the compressed blocks each query sees."""
    import numpy as np

    from flaxformer_lite.sparse.grammar import dynamic as D

    i = np.arange(n, dtype=np.float64)
    B, nb = pattern.block, -(-n // pattern.block)
    if getattr(pattern, "block_gate", False):
        return float(n) * min(pattern.k, nb) * B
    a = i // B
    pairs = np.minimum(pattern.k - 1, a) * B + (i % B + 1 if pattern.is_causal else B)
    if isinstance(pattern, D.NSA):
        pairs += np.minimum(i, pattern.window) + 1 + (i + 1) // B
    return float(pairs.sum())


def _block_sparse(pattern):
    from flaxformer_lite.sparse.ops.block_sparse.pallas_triton import block_sparse_attention

    return lambda q, k, v: block_sparse_attention(q, k, v, pattern)


def _band(pattern):
    from flaxformer_lite.sparse.ops.band.pallas_triton import band_attention, band_of

    left, right = band_of(pattern)
    return lambda q, k, v: band_attention(q, k, v, left=left, right=right)


def _allowed_pairs(pattern, n: int) -> float:
    """(query, key) pairs the pattern allows at length n, exactly (the tile plan counts
    them tile by tile, without an n x n array)."""
    from flaxformer_lite.sparse.grammar.tiles import tile_plan

    if type(pattern).__name__ == "Full":
        return n * (n + 1) / 2 if pattern.is_causal else float(n) * n
    if type(pattern).__name__ in ("MoBA", "NSA"):
        return _dynamic_pairs(pattern, n)
    return float(tile_plan(pattern, n, 64, 64).pairs)


def _rel_diff(mine, ref) -> float:
    """The largest of max|a - b| / max|b| over dq, dk, dv (the gradients of a random
    projection of the output, so they test the attention weights and the output)."""
    return max(
        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
        / float(jnp.max(jnp.abs(b.astype(jnp.float32))))
        for a, b in zip(mine[1], ref[1], strict=True)
    )


def measure_attention(
    tiny: bool,
    budget: Budget,
    max_len: int,
    lengths: list[int] | None = None,
    only: list[str] | None = None,
) -> list[dict]:
    """The attention rows; ``only``: the kernels named exactly so (default all)."""
    lengths = lengths or ([256, 512] if tiny else [1024, 4096, 16384, 65536])
    lengths = [n for n in lengths if n <= max_len]
    tokens = 1024 if tiny else TOKENS
    kernels = attention_kernels()
    if only:
        unknown = sorted(set(only) - set(kernels))
        if unknown:  # e.g. tokamax's rows where it is not installed: the others still run
            print(f"warning: --kernels {unknown} not here; kernels are {sorted(kernels)}")
        kernels = {name: kernels[name] for name in kernels if name in only}
    refs = {ref for _, _, ref in kernels.values() if ref}
    rows = []
    for n in lengths:
        b = max(1, tokens // n)
        keys = jax.random.split(jax.random.key(n), 4)
        q, k, v, w = (jax.random.normal(x, (b, n, HEADS, HEAD_DIM), jnp.bfloat16) for x in keys)
        results = {}  # the reference kernels' (loss, grads) at this length
        for name, (fn, pattern, ref) in kernels.items():
            row = {"kernel": name, "length": n, "batch": b}
            if name == "xla dense" and n > (512 if tiny else 16384):
                rows.append({**row, "status": "skipped (n x n weights)"})
                continue
            if not budget.left():
                rows.append({**row, "status": "not reached (time budget)"})
                continue
            try:
                loss = lambda q, k, v, fn=fn, w=w: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)  # noqa: E731
                forward_only = name.endswith(" fwd")
                step = jax.jit(
                    loss if forward_only else jax.value_and_grad(loss, argnums=(0, 1, 2))
                )
                compiled = step.lower(q, k, v).compile()
                mem = compiled.memory_analysis()
                call = functools.partial(compiled, q, k, v)
                res = jax.block_until_ready(call())
                if name in refs:
                    results[name] = res
                if name.startswith(("tokamax", "band")) and ref in results and not forward_only:
                    row["max_rel_diff"] = _rel_diff(res, results[ref])
                seconds = _timed_blocks(call, *((1, 1) if tiny else (3, 3)))
                passes = 1.0 if forward_only else 3.5
                useful = passes * 4 * HEAD_DIM * HEADS * b * _allowed_pairs(pattern, n)
                peak_bytes = None
                if mem is not None:
                    peak_bytes = (
                        mem.temp_size_in_bytes + mem.argument_size_in_bytes
                        + mem.output_size_in_bytes
                    )  # fmt: skip
                row.update(
                    status="ok", fwd_bwd_ms=1e3 * seconds, tflops_per_s=useful / seconds / 1e12,
                    peak_mib=None if peak_bytes is None else peak_bytes / 2**20,
                )  # fmt: skip
            except Exception as e:  # noqa: BLE001
                row.update(status=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            rows.append(row)
            print(_attention_line(row), flush=True)
    _attention_ratios(rows)
    return rows


def _attention_ratios(rows: list[dict]) -> None:
    """Each row's time over its reference's (cuDNN for the same pattern where cuDNN can
    compute it) at the same length."""
    kernels = {name: ref for name, (_, _, ref) in attention_kernels().items()}
    ms = {(r["kernel"], r["length"]): r.get("fwd_bwd_ms") for r in rows}
    for r in rows:
        ref = kernels.get(r["kernel"])
        mine, theirs = r.get("fwd_bwd_ms"), ms.get((ref, r["length"]))
        if ref and mine and theirs:
            r["vs_cudnn"] = f"{mine / theirs:.2f}x {ref}"


# decode --------------------------------------------------------------------------------


def measure_decode(tiny: bool, budget: Budget) -> list[dict]:
    from flaxformer_lite.config.model import PRESETS
    from flaxformer_lite.inference import decoding
    from flaxformer_lite.model.transformer import Transformer

    source, new = (8, 8) if tiny else (32, 64)
    ende = next(c for label, c, *_ in train_cases(tiny) if label == "ende_small")
    cases = [("ende_small", ende)]
    if not tiny:
        cases.append(("paper_base", PRESETS["paper_base"].replace(vocab_size=37000)))
    rows = []
    for label, base in cases:
        config = base.replace(dtype="bfloat16", param_dtype="float32")
        model = Transformer(config)
        params = jax.jit(model.init)(
            jax.random.key(0), jnp.ones((1, source), jnp.int32), jnp.ones((1, source), jnp.int32)
        )["params"]
        kw = dict(max_length=new, eos_id=-1, bos_id=config.bos_id)  # EOS never emitted
        methods = {
            "greedy": jax.jit(lambda p, x, kw=kw, m=model: decoding.sample(m, p, x, **kw)),
            "beam 4": jax.jit(
                lambda p, x, kw=kw, m=model: decoding.beam_search(
                    m, p, x, beam_size=4, alpha=0.6, **kw
                )
            ),
        }
        for batch in (1, 64):
            key = jax.random.key(batch)
            inputs = jax.random.randint(key, (batch, source), 3, config.vocab_size)
            for method, fn in methods.items():
                row = {"model": label, "method": method, "batch": batch}
                if not budget.left():
                    rows.append({**row, "status": "not reached (time budget)"})
                    continue
                try:
                    jax.block_until_ready(fn(params, inputs))
                    seconds = _timed_blocks(functools.partial(fn, params, inputs), 3, 1)
                    row.update(status="ok", seconds=seconds, new_tokens_per_s=batch * new / seconds)
                except Exception as e:  # noqa: BLE001
                    row.update(status=f"failed: {type(e).__name__}: {str(e)[:300]}")
                rows.append(row)
                print(_decode_line(row), flush=True)
    return rows


# report --------------------------------------------------------------------------------


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def _train_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"| {r['model']} | {r['batch']} | {r['run']} | {r.get('status')} | | | |"
    return (
        f"| {r['model']} | {r['batch']} | {r['run']} | {r['step_ms']:.2f} | "
        f"{r['target_tokens_per_s']:,.0f} | {100 * r['mfu_measured_peak']:.1f}% | "
        + (f"{100 * r['mfu_datasheet']:.1f}% |" if r["mfu_datasheet"] is not None else "- |")
    )


def _attention_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"| {r['kernel']} | {r['length']} | {r['batch']} | {r.get('status')} | | | | |"
    return (
        f"| {r['kernel']} | {r['length']} | {r['batch']} | {r['fwd_bwd_ms']:.2f} | "
        f"{r['tflops_per_s']:.3g} | {_fmt(r['peak_mib'], '.0f')} | {r.get('vs_cudnn', '')} | "
        f"{_fmt(r.get('max_rel_diff'), '.4f')} |"
    )


def _decode_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"| {r['model']} | {r['method']} | {r['batch']} | {r.get('status')} | |"
    return (
        f"| {r['model']} | {r['method']} | {r['batch']} | {r['seconds']:.4f} | "
        f"{r['new_tokens_per_s']:,.0f} |"
    )


def report(result: dict) -> str:
    env = result.get("env", {})
    lines = [f"`{result['command']}`", ""]
    if env:
        lines += [
            f"{env['device']} ({env['platform']}; {env.get('nvidia_smi') or 'no nvidia-smi'}); "
            f"cuDNN {env.get('cudnn')}; jax {env['jax']}, flax {env['flax']}, "
            f"Python {env['python']}. Matmul peak measured here: "
            f"{env['matmul_peak_tflops']:.3g} TFLOP/s ({env['matmul_peak_shape']}); datasheet "
            f"dense bf16: {_fmt(env.get('datasheet_peak_tflops'), '.0f')} TFLOP/s.",
            "",
        ]
    if "train" in result:
        lines += [
            "## Train step (bfloat16 compute, float32 parameters)",
            "",
            "| model | batch | run | step (ms) | target tokens/s | MFU (measured peak) "
            "| MFU (datasheet) |",
            "|---|---|---|---|---|---|---|",
            *(_train_line(r) for r in result["train"]),
            "",
        ]
    if "attention" in result:
        lines += [
            "## Attention, forward + backward (bfloat16, 8 heads of 64, B*n = 64k tokens)",
            "",
            "| kernel | length | batch | fwd+bwd (ms) | TFLOP/s | peak MiB | vs reference "
            "| gradients' max rel. diff to it |",
            "|---|---|---|---|---|---|---|---|",
            *(_attention_line(r) for r in result["attention"]),
            "",
        ]
    if "decode" in result:
        lines += [
            "## Cached decoding (source 32, 64 new tokens per row)",
            "",
            "| model | method | batch | seconds | new tokens/s |",
            "|---|---|---|---|---|",
            *(_decode_line(r) for r in result["decode"]),
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for accelerator.{json,md}")
    parser.add_argument("--tiny", action="store_true", help="dry run: tiny sizes (CPU)")
    parser.add_argument("--only", default=",".join(SECTIONS), help="sections, comma-separated")
    parser.add_argument("--minutes", type=float, default=2.0, help="cap per section (0: none)")
    parser.add_argument("--max_len", type=int, default=65536, help="longest attention length")
    parser.add_argument(
        "--rows",
        default="",
        help='train rows whose "model batch run" contains one of these, comma-separated '
        "(e.g. paper_big,examples/wmt,800x128; default all)",
    )
    parser.add_argument(
        "--lengths", default="", help="attention lengths, comma-separated (default 1k,4k,16k,64k)"
    )
    parser.add_argument(
        "--kernels",
        default="",
        help='attention kernels by name, comma-separated (e.g. "cudnn dense,band dense"; '
        "default all)",
    )
    args = parser.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"error: --only {','.join(unknown)}: sections are {', '.join(SECTIONS)}")
    if jax.default_backend() != "gpu":
        if not args.tiny:
            raise SystemExit(
                "error: no GPU here (JAX sees "
                f"{jax.default_backend()}); run on a GPU, or add --tiny for a CPU dry run"
            )
        os.environ["FLAXFORMER_FUSED_ON_CPU"] = "1"  # cuDNN rows through XLA, same code
    out = Path(args.out)
    result = {"command": "python benchmarks/accelerator.py " + " ".join(sys.argv[1:])}
    result["env"] = environment(args.tiny)
    _write(out, result)
    peak = result["env"]["matmul_peak_tflops"] * 1e12
    sheet = result["env"]["datasheet_peak_tflops"]
    sheet = None if sheet is None else sheet * 1e12
    if "train" in only:
        rows = [x for x in args.rows.split(",") if x] or None
        result["train"] = measure_train(args.tiny, Budget(args.minutes), peak, sheet, rows)
        _write(out, result)
    if "attention" in only:
        lengths = [int(x) for x in args.lengths.split(",") if x] if args.lengths else None
        kernels = [x for x in args.kernels.split(",") if x] or None
        result["attention"] = measure_attention(
            args.tiny, Budget(args.minutes), args.max_len, lengths, kernels
        )
        _write(out, result)
    if "decode" in only:
        result["decode"] = measure_decode(args.tiny, Budget(args.minutes))
        _write(out, result)
    print(report(result))


if __name__ == "__main__":
    main()
