"""A transformers Marian (post-LN) or Pegasus (pre-LN) model as ours: its config and
weights read into our ModelConfig and parameters, the inverse of
:mod:`~flaxformer_lite.exchange.export` (the same width permutation, undone), so
that an export read back is the run's parameters exactly, and a Marian model made
elsewhere (OPUS-MT's layout) computes its own logits in our Transformer.

An OPUS-MT model numbers its vocabulary its own way (EOS 0, unknown 1, pad last,
decoding starting from the pad row). Ours keeps pad 0 and EOS 1 everywhere, so the
vocabulary is renumbered (:func:`vocab_order`: pad, EOS, then every other id in its
order), the embedding rows and the logits bias with it, and ``model.bos_id`` names
the row decoding starts from: the same softmax over the same rows, reordered. Its
two sentencepiece models and shared vocabulary become a
:class:`~flaxformer_lite.data.tokenizer.PairTokenizer` in the same numbering.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from flaxformer_lite.config import trust
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data.tokenizer import PairTokenizer
from flaxformer_lite.exchange.export import MARIAN_EPSILON, ExportError, width_order

# The model fields an import sets; the run's config keeps every other one (dropout,
# attention pattern, precision, ...).
IMPORTED_FIELDS = (
    "vocab_size", "d_model", "num_heads", "d_k", "d_v", "d_ff", "num_encoder_layers",
    "num_decoder_layers", "max_len", "ln_position", "positional", "tie_embeddings",
    "scale_embeddings", "activation", "use_bias", "layer_norm_epsilon", "logits_bias",
    "score_fn", "lexical_shortcut", "pad_id", "eos_id", "bos_id",
)  # fmt: skip

FROM_ACTIVATIONS = {"relu": "relu", "gelu_new": "gelu", "swish": "silu", "silu": "silu"}


def vocab_order(config: dict) -> np.ndarray:
    """Their id of each of our ids: pad, EOS, then the rest in their order (the
    identity for a model this codebase exported)."""
    vocab, pad, eos = config["vocab_size"], config.get("pad_token_id"), config.get("eos_token_id")
    for name, value in (("pad_token_id", pad), ("eos_token_id", eos)):
        if not isinstance(value, int) or not 0 <= value < vocab:
            raise ExportError(f"{name}={value!r} is not an id of the {vocab}-entry vocabulary")
    if pad == eos:
        raise ExportError(f"pad_token_id equals eos_token_id ({pad}); ours keeps them apart")
    rest = [i for i in range(vocab) if i not in (pad, eos)]
    return np.asarray([pad, eos, *rest], np.int64)


def model_config_from_hf(config: dict, logits_bias: bool = False) -> ModelConfig:
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
    start = config.get("decoder_start_token_id", config.get("pad_token_id"))
    ours = {int(their): i for i, their in enumerate(vocab_order(config))}
    if start not in ours:
        raise ExportError(f"decoder_start_token_id={start!r} is not an id of the vocabulary")
    return ModelConfig(
        bos_id=ours[start],
        logits_bias=logits_bias,
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


def params_from_hf(
    state: dict[str, np.ndarray], c: ModelConfig, order: np.ndarray | None = None
) -> dict:
    """Our parameters from a transformers state dict (:func:`hf_state` inverted);
    ``order``: their vocabulary id of each of ours (:func:`vocab_order`)."""
    back = np.argsort(width_order(c.d_model))  # our width index -> theirs
    heads, head = c.num_heads, c.d_model // c.num_heads
    order = np.arange(c.vocab_size) if order is None else order
    bias = state.get("final_logits_bias")
    if bias is not None and np.any(np.asarray(bias) != 0) and not c.logits_bias:
        raise ExportError("a non-zero final_logits_bias; set model.logits_bias=True to hold it")

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
    table = np.asarray(table, np.float32)[order][:, back]
    params: dict = {"shared_embedding": {"embedding": table}}
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
    if c.logits_bias:
        values = np.zeros(len(order), np.float32) if bias is None else np.asarray(bias)
        decoder["logits_bias"] = np.asarray(values, np.float32).reshape(-1)[order]
    params["encoder"], params["decoder"] = encoder, decoder
    return params


@dataclasses.dataclass
class Imported:
    """A transformers folder read as ours: the model fields it sets, its parameters
    (numpy, our layout) and its tokenizer (None where the folder has none)."""

    config: ModelConfig
    params: dict
    tokenizer: PairTokenizer | None


def read_weights(folder: Path) -> dict[str, np.ndarray]:
    """The state dict of ``model.safetensors`` (sharded or not), else of
    ``pytorch_model.bin`` (that one needs torch: the ``export`` extra)."""
    from safetensors.numpy import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        state = {}
        for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
            if not isinstance(shard, str) or shard != Path(shard).name or shard in ("..", "."):
                raise ExportError(
                    f"{index} names the shard {shard!r}, not a file of {folder}; a model "
                    "folder's index only names its own files"
                )
            state |= load_file(str(folder / shard))
        return state
    if (folder / "model.safetensors").is_file():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError:
            raise ExportError(
                f"{folder} holds pytorch_model.bin, which needs torch: pip install -e "
                "'.[export]' (or save the model with safetensors)"
            ) from None
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state.items()}
    raise ExportError(f"{folder} has no model.safetensors or pytorch_model.bin")


def read_tokenizer(folder: Path, config: dict, order: np.ndarray) -> PairTokenizer | None:
    """MarianTokenizer's files (source.spm, target.spm, vocab.json) renumbered as ours."""
    if not (folder / "vocab.json").is_file():
        return None
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    if settings.get("separate_vocabs"):
        raise ExportError(
            "separate_vocabs=True (a target vocabulary of its own); ours shares one table"
        )
    for name in ("source.spm", "target.spm"):
        if not (folder / name).is_file():
            raise ExportError(f"{folder} has vocab.json but no {name}")
    their_piece = {int(i): p for p, i in json.loads((folder / "vocab.json").read_text()).items()}
    pieces = [their_piece.get(int(t), f"<unused_{int(t)}>") for t in order]
    unk = str(settings.get("unk_token", "<unk>"))
    if isinstance(settings.get("unk_token"), dict):
        unk = settings["unk_token"]["content"]
    if unk not in pieces:
        raise ExportError(f"vocab.json has no {unk!r} (the unknown piece)")
    source, target = (folder / "source.spm").read_bytes(), (folder / "target.spm").read_bytes()
    return PairTokenizer(source, target, pieces, pieces.index(unk))


def read_marian(folder: str | Path) -> Imported:
    """A transformers Marian (OPUS-MT) or Pegasus folder as ours; what cannot map is
    refused (:class:`ExportError`) before anything is written."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ExportError(
            f"{folder} is not a transformers model folder (no config.json); download one "
            "first, e.g. huggingface-cli download Helsinki-NLP/opus-mt-en-de --local-dir DIR"
        )
    try:
        config = json.loads((folder / "config.json").read_text())
        if not isinstance(config, dict):
            raise ValueError(f"config.json holds {type(config).__name__}, not an object")
        _no_code_of_its_own(folder, config)
        model_config_from_hf(config)  # refusals before the weights are read
        state = read_weights(folder)
        bias = state.get("final_logits_bias")
        c = model_config_from_hf(config, logits_bias=bias is not None and bool(np.any(bias != 0)))
        order = vocab_order(config)
        params = params_from_hf(state, c, order)
        return Imported(c, params, read_tokenizer(folder, config, order))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, ExportError):
            raise
        raise ExportError(
            f"{folder} is not a model folder this import can read ({type(e).__name__}: "
            f"{str(e)[:200]}); save the model again with transformers' save_pretrained"
        ) from None


def _no_code_of_its_own(folder: Path, config: dict) -> None:
    """A folder that asks for its own code (``auto_map``: transformers runs it only with
    ``trust_remote_code=True``) is refused unless the user trusts it: this import runs
    no code of a folder's, so such a model is not the architecture read here either."""
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
    files = (("config.json", config), ("tokenizer_config.json", settings))
    asks = [name for name, holds in files if isinstance(holds, dict) and holds.get("auto_map")]
    if asks and not trust.trusting_all():
        raise ExportError(
            f"{folder} asks for code of its own ({' and '.join(asks)} hold auto_map), which "
            "this import never runs and may not read right; import a Marian or Pegasus folder "
            "without it, or pass --trust_extensions to read its weights as Marian's anyway"
        )
