"""Model FLOPs of a training step, and the peaks to divide them by (MFU): a datasheet
table of accelerators' dense bfloat16 peaks, and a measured matmul peak.

Counted analytically for the encoder-decoder (multiply-adds x 2; training =
forward x 3), over every slot of the padded/packed batch, since that is
what the hardware computes:

per source token, per encoder layer:  8 d^2 (Q,K,V,O) + 4 L_s d_k h (scores, AV) + 4 d d_ff
per target token, per decoder layer:  8 d^2 + 4 L_t d_k h   (self-attention)
                                     + 4 d^2 + 4 L_s d_k h   (cross: Q, O, scores, AV)
                                     + 4 d d_ff
per source token, per decoder layer:  4 d^2                  (cross-attention K, V)
per target token:                     2 d V                  (output projection)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from flaxformer_lite.config.model import ModelConfig


def forward_flops(c: ModelConfig, batch: int, source_len: int, target_len: int) -> float:
    d, f, h = c.d_model, c.d_ff, c.num_heads
    qk, v = c.head_dim_qk, c.head_dim_v
    proj = 2 * d * h * (2 * qk + v) + 2 * h * v * d  # Q, K, V, O for one token
    attn_self_t = 2 * target_len * h * (qk + v)
    attn_enc = 2 * source_len * h * (qk + v)
    attn_cross = 2 * source_len * h * (qk + v)
    ffn = 4 * d * f
    enc_token = proj + attn_enc + ffn
    cross_q_o = 2 * d * h * qk + 2 * h * v * d
    cross_k_v = 2 * d * h * (qk + v)
    dec_token = proj + attn_self_t + cross_q_o + attn_cross + ffn
    src_tokens, tgt_tokens = batch * source_len, batch * target_len
    total = c.num_encoder_layers * src_tokens * enc_token
    total += c.num_decoder_layers * (tgt_tokens * dec_token + src_tokens * cross_k_v)
    total += tgt_tokens * 2 * d * c.vocab_size
    return float(total)


def lm_forward_flops(c: ModelConfig, batch: int, length: int) -> float:
    """Decoder-only LM: per token and layer, projections + causal attention + FFN."""
    d, f, h = c.d_model, c.d_ff, c.num_heads
    qk, v = c.head_dim_qk, c.head_dim_v
    per_token = 2 * d * h * (2 * qk + v) + 2 * h * v * d + 2 * length * h * (qk + v) + 4 * d * f
    tokens = batch * length
    return float(c.num_decoder_layers * tokens * per_token + tokens * 2 * d * c.vocab_size)


def train_step_flops(
    c: ModelConfig, batch: int, source_len: int, target_len: int, task: str = "translation"
) -> float:
    """Forward + backward (= 3 x forward)."""
    if task in ("lm", "recall"):
        return 3.0 * lm_forward_flops(c, batch, target_len)
    if task == "classify":  # the encoder alone (the head is negligible)
        return 3.0 * forward_flops(c.replace(num_decoder_layers=0), batch, source_len, 0)
    return 3.0 * forward_flops(c, batch, source_len, target_len)


# Dense bfloat16 peak FLOP/s per device, from the vendors' datasheets (SXM / the
# chip's own figure, without sparsity), by a substring of ``device.device_kind``; the
# most specific name first.
DATASHEET_BF16 = (
    ("H200", 989e12), ("H100", 989e12), ("GH200", 989e12), ("A100", 312e12),
    ("L40S", 362e12), ("L4", 121e12), ("A10", 125e12), ("V100", 125e12),
    ("TPU v6", 918e12), ("TPU v5p", 459e12), ("TPU v5", 197e12), ("TPU v4", 275e12),
)  # fmt: skip


def device_peak_flops(device) -> float | None:
    """The datasheet's dense bfloat16 peak of ``device`` (FLOP/s), None where the
    table has none (CPUs: the MFU of a CPU run is not reported)."""
    kind = getattr(device, "device_kind", "")
    return next((peak for name, peak in DATASHEET_BF16 if name in kind), None)


def peak_flops(devices) -> float | None:
    """The datasheet peak of ``devices`` together (all of one kind), or None."""
    peak = device_peak_flops(devices[0])
    return peak * len(devices) if peak else None


def matmul_peak_flops(n: int = 2048, repeats: int = 10, dtype=jnp.float32, chain: int = 1) -> float:
    """Best observed FLOP/s of an ``n x n`` matmul on the default device (this process),
    over ``repeats`` timings of ``chain`` products dispatched back to back. On an
    accelerator use a chain (e.g. 10): one product of 8192^3 takes ~1.4 ms on an H200,
    and timing each with the host's wait read 613 TFLOP/s there, where other timings of
    the same product (CUDA events, many products) read 769-798."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    b = jax.random.normal(jax.random.key(1), (n, n), dtype)
    f = jax.jit(jnp.dot)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        outs = [f(a, b) for _ in range(chain)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t) / chain)
    return 2.0 * n**3 / best
