"""A trained run as a Hugging Face model: ``transformers`` loads it with no code of
ours (``AutoModelForSeq2SeqLM`` / ``AutoTokenizer.from_pretrained``).

Post-LN runs become Marian: the paper's Transformer as the translation world ships
it (post-LN, sinusoidal positions, embeddings shared three ways and scaled by
sqrt(d_model), no final LayerNorm, biases everywhere), the layout of the OPUS-MT
models, and one CTranslate2 converts. Pre-LN runs become Pegasus: the same layers
and position table with the LayerNorm first and one after each stack, as ours (mBART,
the other pre-LN candidate, normalizes the embeddings too, which ours do not). Both
use MarianTokenizer over the run's own sentencepiece model. What differs, and how
each is closed:

- **Position table.** Ours interleaves sin and cos (the paper: sin on even
  dimensions); Marian puts every sin first and every cos second. The export
  permutes the model's width (the residual stream) by the same order in every weight
  that reads or writes it (embeddings, LayerNorms, the projections' model-side axis),
  a symmetry of the network: Marian's table then adds exactly what ours adds.
- **LayerNorm epsilon.** transformers' is fixed at 1e-5 (``nn.LayerNorm``'s default); ours
  is ``model.layer_norm_epsilon`` (1e-6 by default). The export says so when they
  differ; the effect is bounded by the ratio of the epsilons to each LayerNorm's
  input variance (parity tests: tests/test_export.py).
- **Special ids.** Ours: pad 0, EOS 1, BOS 2 (decoding starts from BOS), unknown 3.
  The config names them (``pad_token_id=0``, ``eos_token_id=1``,
  ``decoder_start_token_id=2``), so ``generate`` starts where ours does (an
  imported Marian model starts from its pad row, ``model.bos_id=0``, as it did).

What does not map is refused before anything is written (:func:`check`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
from flax import linen as nn

from flaxformer_lite.config import extensions
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data.tokenizer import EOS_ID, PAD_ID, PairTokenizer, Tokenizer
from flaxformer_lite.inference.run import Run
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.layer_layout import unrolled

MARIAN_EPSILON = 1e-5
# ours -> transformers' name (jax.nn.gelu is the tanh form, transformers' gelu_new)
ACTIVATIONS = {"relu": "relu", "gelu": "gelu_new", "silu": "swish"}


class ExportError(ValueError):
    """The run cannot be written in the asked format; the message names the option."""


# Fields whose values registries extend: (field, Marian's value, registry, why not).
REGISTERED = (
    ("ffn", "standard", "feed-forward block", "Marian's FFN is act(x W1) W2"),
    ("attention", "multihead", "attention layer", "Marian's attention is multi-head"),
    ("norm", "layer_norm", "normalisation", "Marian normalises by LayerNorm"),
    ("positional", "sinusoidal", "position encoding", "Marian adds a sinusoidal table"),
    ("score_fn", "scaled_dot", "score function", "Marian scores by scaled dot products"),
)


def _registered(kind: str, name: str) -> str:
    """``, registered by the extension lab/my_ext.py`` for a name an extension registered."""
    where = extensions.origin(kind, name)
    return f", registered by the extension {where}" if where else ""


def check(c: ModelConfig) -> list[str]:
    """Why ``c`` cannot be exported (one reason per option; empty if it can)."""
    reasons = []
    for field, marian, kind, why in REGISTERED:
        value = getattr(c, field)
        if value != marian:
            reasons.append(f"model.{field}={value!r} ({why}{_registered(kind, value)})")
    if c.tie_embeddings != "all":
        reasons.append(
            f"model.tie_embeddings={c.tie_embeddings!r} (the layout shares one table "
            "between source, target and softmax)"
        )
    if not c.scale_embeddings:
        reasons.append("model.scale_embeddings=False (Marian scales them by sqrt(d_model))")
    if c.attention_pattern != "dense":
        names = [a.partition(":")[0].strip() for a in re.split(r"[|&+]", c.attention_pattern)]
        ours = "".join(dict.fromkeys(_registered("sparse pattern", n) for n in names))
        reasons.append(f"model.attention_pattern={c.attention_pattern!r} (a sparse pattern{ours})")
    if c.activation not in ACTIVATIONS:
        reasons.append(f"model.activation={c.activation!r} (not one of {', '.join(ACTIVATIONS)})")
    if c.lexical_shortcut:
        reasons.append("model.lexical_shortcut=True (no such path in Marian or Pegasus)")
    head = c.d_model // c.num_heads
    if (c.d_k or head) != head or (c.d_v or head) != head:
        reasons.append(
            f"model.d_k/d_v={c.d_k}/{c.d_v} (Marian's heads are d_model / num_heads wide)"
        )
    if c.d_model % 2:
        reasons.append(f"model.d_model={c.d_model} is odd (the position table pairs dims)")
    if c.num_classes:
        reasons.append("model.num_classes (a classifier, not a translation model)")
    return reasons


def width_order(d_model: int) -> np.ndarray:
    """Our width index of each of Marian's: its sin half, then its cos half."""
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def layout(c: ModelConfig) -> tuple[str, str]:
    """(model_type, architecture) in transformers: Marian for post-LN, Pegasus (the
    same layers with the LayerNorm first and one after each stack) for pre-LN."""
    if c.ln_position == "pre":
        return "pegasus", "PegasusForConditionalGeneration"
    return "marian", "MarianMTModel"


def hf_config(c: ModelConfig) -> dict:
    """``config.json`` of the transformers model of ``c``."""
    model_type, architecture = layout(c)
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "decoder_vocab_size": c.vocab_size,
        "d_model": c.d_model,
        "encoder_layers": c.num_encoder_layers,
        "decoder_layers": c.num_decoder_layers,
        "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.d_ff,
        "decoder_ffn_dim": c.d_ff,
        "activation_function": ACTIVATIONS.get(c.activation, c.activation),
        "max_position_embeddings": c.max_len,
        "scale_embedding": bool(c.scale_embeddings),
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "dropout": c.residual_dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": c.ffn_dropout,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": c.bos_id,
        "decoder_start_token_id": c.bos_id,
        # ours never forces EOS (a sentence at its length limit is cut), and Marian's
        # class default (0) would force our pad: none, explicitly
        "forced_eos_token_id": None,
        "is_encoder_decoder": True,
    }


def _positions(length: int, d_model: int) -> np.ndarray:
    """Marian's table (sin half, cos half), computed as it computes it."""
    j = np.arange(d_model)
    angles = np.arange(length)[:, None] / np.power(10000, 2 * (j // 2) / d_model)[None, :]
    return np.concatenate([np.sin(angles[:, 0::2]), np.cos(angles[:, 1::2])], axis=1)


def hf_state(params, c: ModelConfig) -> dict[str, np.ndarray]:
    """The transformers state dict (numpy float32) of our parameters."""
    params = nn.meta.unbox(params)
    c, params = unrolled(c, params)  # a scanned run's layers, one by one
    p = width_order(c.d_model)
    hd = c.d_model  # heads x head width

    def arr(x) -> np.ndarray:
        return np.asarray(x, np.float32)

    def bias(x, width: int) -> np.ndarray:
        return arr(x) if x is not None else np.zeros(width, np.float32)

    def attention(prefix: str, a) -> dict[str, np.ndarray]:
        out = {}
        for ours, theirs in (("query", "q_proj"), ("key", "k_proj"), ("value", "v_proj")):
            kernel = arr(a[ours]["kernel"]).reshape(c.d_model, hd)
            out[f"{prefix}.{theirs}.weight"] = kernel[p, :].T
            out[f"{prefix}.{theirs}.bias"] = bias(a[ours].get("bias"), hd).reshape(hd)
        kernel = arr(a["out"]["kernel"]).reshape(hd, c.d_model)
        out[f"{prefix}.out_proj.weight"] = kernel[:, p].T
        out[f"{prefix}.out_proj.bias"] = bias(a["out"].get("bias"), c.d_model)[p]
        return out

    def norm(prefix: str, n) -> dict[str, np.ndarray]:
        return {f"{prefix}.weight": arr(n["scale"])[p], f"{prefix}.bias": arr(n["bias"])[p]}

    def ffn(prefix: str, f) -> dict[str, np.ndarray]:
        return {
            f"{prefix}.fc1.weight": arr(f["wi"]["kernel"])[p, :].T,
            f"{prefix}.fc1.bias": bias(f["wi"].get("bias"), c.d_ff),
            f"{prefix}.fc2.weight": arr(f["wo"]["kernel"])[:, p].T,
            f"{prefix}.fc2.bias": bias(f["wo"].get("bias"), c.d_model)[p],
        }

    table = arr(params["shared_embedding"]["embedding"])[:, p]
    positions = _positions(c.max_len, c.d_model).astype(np.float32)
    logits_bias = params["decoder"].get("logits_bias")
    state = {
        "final_logits_bias": bias(logits_bias, c.vocab_size)[None, :],
        "model.shared.weight": table,
        "model.encoder.embed_tokens.weight": table,
        "model.decoder.embed_tokens.weight": table,
        "lm_head.weight": table,
        "model.encoder.embed_positions.weight": positions,
        "model.decoder.embed_positions.weight": positions,
    }
    for i in range(c.num_encoder_layers):
        layer, at = params["encoder"][f"layer_{i}"], f"model.encoder.layers.{i}"
        state |= attention(f"{at}.self_attn", layer["self_attention"])
        state |= norm(f"{at}.self_attn_layer_norm", layer["self_attention_norm"])
        state |= ffn(at, layer["ffn"])
        state |= norm(f"{at}.final_layer_norm", layer["ffn_norm"])
    for i in range(c.num_decoder_layers):
        layer, at = params["decoder"][f"layer_{i}"], f"model.decoder.layers.{i}"
        state |= attention(f"{at}.self_attn", layer["self_attention"])
        state |= norm(f"{at}.self_attn_layer_norm", layer["self_attention_norm"])
        state |= attention(f"{at}.encoder_attn", layer["cross_attention"])
        state |= norm(f"{at}.encoder_attn_layer_norm", layer["cross_attention_norm"])
        state |= ffn(at, layer["ffn"])
        state |= norm(f"{at}.final_layer_norm", layer["ffn_norm"])
    if c.ln_position == "pre":  # Pegasus: a LayerNorm after each stack
        state |= norm("model.encoder.layer_norm", params["encoder"]["final_norm"])
        state |= norm("model.decoder.layer_norm", params["decoder"]["final_norm"])
    return {k: np.ascontiguousarray(v) for k, v in state.items()}


def _spm_files(tokenizer: Tokenizer, out: Path) -> None:
    """``source.spm`` and ``target.spm``: a joint model twice, or a pair's two."""
    if isinstance(tokenizer, PairTokenizer):
        (out / "source.spm").write_bytes(tokenizer.source_model())
        (out / "target.spm").write_bytes(tokenizer.target_model())
    else:
        for name in ("source.spm", "target.spm"):
            shutil.copyfile(tokenizer.path, out / name)


def _tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    """MarianTokenizer's files: one joint sentencepiece model as both sides (or an
    imported pair's two), the pieces as the shared vocabulary (ids unchanged)."""
    _spm_files(tokenizer, out)
    vocab = {tokenizer.id_to_piece(i): i for i in range(tokenizer.vocab_size)}
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    specials = {
        "eos_token": tokenizer.id_to_piece(EOS_ID),
        "unk_token": tokenizer.id_to_piece(tokenizer.unk_id),
        "pad_token": tokenizer.id_to_piece(PAD_ID),
    }
    (out / "special_tokens_map.json").write_text(json.dumps(specials))
    config = {"tokenizer_class": "MarianTokenizer", "model_max_length": 512, **specials}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


TIED = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight")


def _save_weights(state: dict[str, np.ndarray], folder: Path) -> None:
    """``model.safetensors`` of ``state``; the tied copies of the shared table are left
    out (transformers ties them to ``model.shared.weight`` on loading)."""
    from safetensors.numpy import save_file

    weights = {k: v for k, v in state.items() if k not in TIED}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_hf(
    params, c: ModelConfig, tokenizer: Tokenizer | None, out: str | Path, state=None
) -> Path:
    """Write the transformers folder ``out`` (atomically: a half-written folder is never
    left under that name); ``state``: weights to write instead of :func:`hf_state`'s.
    Raises ExportError naming every option that cannot map."""
    reasons = check(c)
    if reasons:
        raise ExportError(
            "cannot export to transformers: " + "; ".join(reasons) + ". Export a run "
            "trained without them"
        )
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        _save_weights(hf_state(params, c) if state is None else state, tmp)
        (tmp / "config.json").write_text(json.dumps(hf_config(c), indent=1))
        generation = {
            "decoder_start_token_id": c.bos_id,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
            "forced_eos_token_id": None,
            "max_length": c.max_len,
        }
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
        if tokenizer is not None:
            _tokenizer_files(tokenizer, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


FORMATS = ("hf", "ctranslate2", "ctranslate2-int8")


def export_workdir(workdir, fmt: str, out: str | None):
    """``main export``: the parameters ``translate`` would use (averaged, else best,
    else last) written as ``fmt`` to ``out`` (default: ``workdir/export_<fmt>``):
    ``hf`` (transformers), ``ctranslate2`` (float32) or ``ctranslate2-int8``."""
    if fmt not in FORMATS:
        raise ExportError(f"--format={fmt!r}; choose one of {', '.join(FORMATS)}")
    run = Run.open(workdir)
    if run.is_lm:
        raise ExportError(
            f"{workdir} is a language model; the Marian layout holds translation models"
        )
    c = run.model_config
    reasons = check(c)  # before any checkpoint is read
    if reasons:
        raise ExportError("cannot export to transformers: " + "; ".join(reasons))
    out = location.check(out, "--out") if out else run.workdir / f"export_{fmt}"
    params, kind, step = run.newest_params()
    name = layout(c)[1]
    with tempfile.TemporaryDirectory(prefix="flaxformer-export-") as staging:
        # the libraries write local files: a bucket's export is written here, then copied
        folder = Path(staging) / out.name if location.is_remote(out) else Path(location.local(out))
        if fmt == "hf":
            write_hf(params, c, run.tokenizer, folder)
            what = f"transformers' {name}"
        else:
            quantization = fmt.partition("-")[2]
            write_ctranslate2(params, c, run.tokenizer, folder, quantization)
            what = f"a CTranslate2 model ({quantization or 'float32'}, from {name})"
        if location.is_remote(out):
            storage.replace_folder(location.path(str(folder)), out)
    print(f"wrote {out}: the {kind} checkpoint of step {step} as {what}")
    if c.layer_norm_epsilon != MARIAN_EPSILON:
        print(
            f"note: LayerNorm epsilon {c.layer_norm_epsilon:g} here, {MARIAN_EPSILON:g} in "
            "transformers' Marian (fixed): logits differ by round-off-sized amounts"
        )
    return out


def _ctranslate2_state(params, c: ModelConfig) -> dict[str, np.ndarray]:
    """The transformers state that CTranslate2's converter turns into our model.

    Two of its rules are closed here. Its decoder starts from a fixed embedding, not
    from BOS's: a zero vector for Marian (``start_from_zero_embedding``), the pad
    token's for Pegasus. The first decoder position is the first step and no other,
    so adding sqrt(d_model) * (BOS's embedding - that start) to row 0 of the decoder's
    position table makes its first step ours exactly. And for Marian it drops the
    vocabulary's last row (the pad row transformers appends); an extra row is added
    for it to drop.
    """
    c, params = unrolled(c, params)
    state = hf_state(params, c)
    table = state["model.shared.weight"]
    start = np.zeros_like(table[0]) if c.ln_position == "post" else table[PAD_ID]
    positions = state["model.decoder.embed_positions.weight"].copy()
    positions[0] += np.float32(np.sqrt(c.d_model)) * (table[c.bos_id] - start)
    state["model.decoder.embed_positions.weight"] = positions
    if c.ln_position == "post":
        wider = np.concatenate([table, np.zeros_like(table[:1])])
        state["model.shared.weight"] = wider
        bias = state["final_logits_bias"]
        state["final_logits_bias"] = np.concatenate([bias, np.zeros_like(bias[:, :1])], axis=1)
    return state


def write_ctranslate2(
    params, c: ModelConfig, tokenizer: Tokenizer, out: str | Path, quantization: str = ""
) -> Path:
    """A CTranslate2 model folder, made by CTranslate2's own converter from a
    transformers folder of this run (:func:`_ctranslate2_state`); ``quantization``:
    '' (float32) or one of CTranslate2's (int8, int8_float32, ...)."""
    from ctranslate2.converters import TransformersConverter

    reasons = check(c)
    if reasons:
        raise ExportError("cannot export to CTranslate2: " + "; ".join(reasons))
    out = Path(out)
    hf = out.with_name(f"{out.name}.hf-{os.getpid()}")
    try:
        write_hf(params, c, tokenizer, hf, state=_ctranslate2_state(params, c))
        config = json.loads((hf / "config.json").read_text())
        # what CTranslate2's Bart-family converter reads of Pegasus (transformers keeps
        # unknown fields): the LayerNorm first, none on the embeddings
        config |= {"normalize_before": c.ln_position == "pre", "normalize_embedding": False}
        (hf / "config.json").write_text(json.dumps(config, indent=1))
        if c.ln_position == "post":  # the extra row, named as the converter expects
            config["vocab_size"] = config["decoder_vocab_size"] = c.vocab_size + 1
            (hf / "config.json").write_text(json.dumps(config, indent=1))
            vocab = json.loads((hf / "vocab.json").read_text())
            vocab = {(k if v != PAD_ID else "<pad_id_0>"): v for k, v in vocab.items()}
            vocab["<pad>"] = c.vocab_size
            (hf / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        TransformersConverter(str(hf)).convert(str(tmp), quantization=quantization or None)
        if isinstance(tokenizer, PairTokenizer):  # its pieces are the model's tokens
            _spm_files(tokenizer, tmp)
        else:
            shutil.copyfile(tokenizer.path, tmp / "sentencepiece.model")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(hf, ignore_errors=True)
        shutil.rmtree(out.with_name(f"{out.name}.tmp-{os.getpid()}"), ignore_errors=True)
    return out
