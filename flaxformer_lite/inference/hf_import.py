"""A transformers Marian (post-LN) or Pegasus (pre-LN) model as ours: its config and
weights read into our ModelConfig and parameters, the inverse of
:mod:`~flaxformer_lite.inference.export` (the same width permutation, undone), so
that an export read back is the run's parameters exactly, and a Marian model made
elsewhere (OPUS-MT's layout) computes its own logits in our Transformer.
"""

from __future__ import annotations

import numpy as np

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.inference.export import MARIAN_EPSILON, ExportError, width_order

FROM_ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu", "swish": "silu", "silu": "silu"}


def model_config_from_hf(config: dict) -> ModelConfig:
    """Our ModelConfig of a transformers Marian or Pegasus ``config.json``; what our
    Transformer cannot hold is refused, naming the field."""
    kind = config.get("model_type")
    if kind not in ("marian", "pegasus"):
        raise ExportError(f"model_type={kind!r}: only marian and pegasus models are read")
    pairs = [
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ]
    for a, b in pairs:
        if config[a] != config[b]:
            raise ExportError(f"{a}={config[a]} but {b}={config[b]}; ours shares one value")
    vocab = config["vocab_size"]
    if config.get("decoder_vocab_size", vocab) != vocab or not config.get(
        "share_encoder_decoder_embeddings", True
    ):
        raise ExportError("separate source and target vocabularies; ours shares one table")
    activation = config.get("activation_function", "relu")
    if activation not in FROM_ACTIVATIONS:
        raise ExportError(f"activation_function={activation!r} (ours: relu, gelu_new, swish)")
    return ModelConfig(
        vocab_size=vocab,
        d_model=config["d_model"],
        num_heads=config["encoder_attention_heads"],
        d_ff=config["encoder_ffn_dim"],
        num_encoder_layers=config["encoder_layers"],
        num_decoder_layers=config["decoder_layers"],
        max_len=config["max_position_embeddings"],
        ln_position="pre" if kind == "pegasus" else "post",
        activation=FROM_ACTIVATIONS[activation],
        scale_embeddings=bool(config.get("scale_embedding", False)),
        layer_norm_epsilon=MARIAN_EPSILON,
    )


def params_from_hf(state: dict[str, np.ndarray], c: ModelConfig) -> dict:
    """Our parameters from a transformers state dict (:func:`hf_state` inverted)."""
    back = np.argsort(width_order(c.d_model))  # our width index -> theirs
    heads, head = c.num_heads, c.d_model // c.num_heads
    bias = state.get("final_logits_bias")
    if bias is not None and np.any(np.asarray(bias) != 0):
        raise ExportError("a non-zero final_logits_bias; our softmax layer has no bias")

    def get(name: str) -> np.ndarray:
        return np.asarray(state[name], np.float32)

    def attention(prefix: str) -> dict:
        out = {}
        for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            kernel = get(f"{prefix}.{theirs}.weight").T[back, :]
            out[ours] = {
                "kernel": kernel.reshape(c.d_model, heads, head),
                "bias": get(f"{prefix}.{theirs}.bias").reshape(heads, head),
            }
        kernel = get(f"{prefix}.out_proj.weight").T[:, back]
        out["out"] = {
            "kernel": kernel.reshape(heads, head, c.d_model),
            "bias": get(f"{prefix}.out_proj.bias")[back],
        }
        return out

    def norm(prefix: str) -> dict:
        return {"scale": get(f"{prefix}.weight")[back], "bias": get(f"{prefix}.bias")[back]}

    def ffn(prefix: str) -> dict:
        return {
            "wi": {
                "kernel": get(f"{prefix}.fc1.weight").T[back, :],
                "bias": get(f"{prefix}.fc1.bias"),
            },
            "wo": {
                "kernel": get(f"{prefix}.fc2.weight").T[:, back],
                "bias": get(f"{prefix}.fc2.bias")[back],
            },
        }

    table = state.get("model.shared.weight", state.get("model.encoder.embed_tokens.weight"))
    params: dict = {"shared_embedding": {"embedding": np.asarray(table, np.float32)[:, back]}}
    encoder, decoder = {}, {}
    for i in range(c.num_encoder_layers):
        at = f"model.encoder.layers.{i}"
        encoder[f"layer_{i}"] = {
            "self_attention": attention(f"{at}.self_attn"),
            "self_attention_norm": norm(f"{at}.self_attn_layer_norm"),
            "ffn": ffn(at),
            "ffn_norm": norm(f"{at}.final_layer_norm"),
        }
    for i in range(c.num_decoder_layers):
        at = f"model.decoder.layers.{i}"
        decoder[f"layer_{i}"] = {
            "self_attention": attention(f"{at}.self_attn"),
            "self_attention_norm": norm(f"{at}.self_attn_layer_norm"),
            "cross_attention": attention(f"{at}.encoder_attn"),
            "cross_attention_norm": norm(f"{at}.encoder_attn_layer_norm"),
            "ffn": ffn(at),
            "ffn_norm": norm(f"{at}.final_layer_norm"),
        }
    if c.ln_position == "pre":
        encoder["final_norm"] = norm("model.encoder.layer_norm")
        decoder["final_norm"] = norm("model.decoder.layer_norm")
    params["encoder"], params["decoder"] = encoder, decoder
    return params
