"""Config validation, presets (parameter counts), the ml_collections files."""

import json
import pathlib

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite import PRESETS, ConfigError, LanguageModel, ModelConfig, Transformer
from flaxformer_lite.config.files import load_config
from flaxformer_lite.config.model import get_preset, model_config_from
from flaxformer_lite.model.partitioning import unbox

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _param_shapes(model, *args):
    shapes = jax.eval_shape(lambda: unbox(model.init(jax.random.key(0), *args)))["params"]
    return {
        "/".join(k.key for k in path): list(v.shape)
        for path, v in jax.tree_util.tree_flatten_with_path(shapes)[0]
    }


def _count(config, lm=False):
    ids = jnp.ones((1, 8), jnp.int32)
    shapes = (
        _param_shapes(LanguageModel(config), ids)
        if lm
        else _param_shapes(Transformer(config), ids, ids)
    )
    total = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def test_paper_parameter_counts():
    # Paper (Table 3): base 65M, big 213M, with a ~37k shared vocabulary.
    assert _count(PRESETS["paper_base"]) == 63_082_496
    assert _count(PRESETS["paper_big"]) == 214_245_376


def test_paper_base_count_by_hand():
    v, m, f, n = 37000, 512, 2048, 6
    attention = 4 * (m * m + m)
    ffn = m * f + f + f * m + m
    encoder_layer = attention + ffn + 2 * 2 * m
    decoder_layer = 2 * attention + ffn + 3 * 2 * m
    assert _count(PRESETS["paper_base"]) == v * m + n * encoder_layer + n * decoder_layer


def test_lm_count_is_decoder_without_cross_attention():
    c = ModelConfig(vocab_size=1000, d_model=64, num_heads=4, d_ff=128, num_decoder_layers=2)
    m = 64
    layer = 4 * (m * m + m) + (m * 128 + 128 + 128 * m + m) + 2 * 2 * m
    assert _count(c, lm=True) == 1000 * m + 2 * layer


def test_paper_base_parameter_tree_snapshot():
    """Catches accidental renames or reshapes of parameters (checkpoints depend on them)."""
    ids = jnp.ones((1, 8), jnp.int32)
    got = _param_shapes(Transformer(PRESETS["paper_base"]), ids, ids)
    want = json.loads((ROOT / "tests/snapshots/paper_base_param_shapes.json").read_text())
    assert got == want


def test_paper_defaults():
    c = PRESETS["paper_base"]
    assert (c.d_model, c.num_heads, c.head_dim_qk, c.head_dim_v, c.d_ff) == (512, 8, 64, 64, 2048)
    assert (c.num_encoder_layers, c.num_decoder_layers) == (6, 6)
    assert (c.embedding_dropout, c.residual_dropout) == (0.1, 0.1)
    assert c.ln_position == "post" and c.positional == "sinusoidal" and c.score_fn == "scaled_dot"
    assert c.tie_embeddings == "all" and c.scale_embeddings and c.activation == "relu"
    big = PRESETS["paper_big"]
    assert (big.d_model, big.num_heads, big.d_ff, big.residual_dropout) == (1024, 16, 4096, 0.3)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("score_fn", "cosine", r"model.score_fn='cosine' is not allowed; choose one of scaled_dot"),
        ("ln_position", "middle", r"model.ln_position='middle' .* post, pre"),
        ("positional", "alibi", r"model.positional='alibi' .* sinusoidal, learned, rotary, none"),
        ("tie_embeddings", "yes", r"model.tie_embeddings='yes' .* none, src_tgt, tgt_softmax, all"),
        ("activation", "swish", r"model.activation='swish' .* relu"),
        ("dtype", "float8", r"model.dtype='float8' .* float32"),
        ("vocab_size", 0, r"model.vocab_size=0 must be > 0"),
        ("d_model", -512, r"model.d_model=-512 must be > 0"),
        ("num_heads", 0, r"model.num_heads=0 must be > 0"),
        ("d_ff", 2.5, r"model.d_ff=2.5 must be of type int"),
        ("max_len", True, r"model.max_len=True must be of type int"),
        ("num_encoder_layers", -1, r"model.num_encoder_layers=-1 must be >= 0"),
        ("d_k", 0, r"model.d_k=0 must be > 0, or None"),
        ("residual_dropout", 1.0, r"model.residual_dropout=1.0 must be in \[0, 1\)"),
        ("embedding_dropout", -0.1, r"model.embedding_dropout=-0.1 must be in \[0, 1\)"),
        ("attention_dropout", 1.5, r"model.attention_dropout=1.5 must be in \[0, 1\)"),
        ("source_token_dropout", 1.0, r"model.source_token_dropout=1.0 must be in \[0, 1\)"),
        ("ffn_dropout", "0.1", r"model.ffn_dropout='0.1' must be of type float"),
        ("layer_norm_epsilon", 0.0, r"model.layer_norm_epsilon=0.0 must be > 0"),
        ("dropout_bits", 4, r"model.dropout_bits=4 is not allowed; choose one of 8, 16, 32"),
        ("eos_id", 0, r"model.eos_id=0 equals model.pad_id"),
        ("bos_id", 37000, r"model.bos_id=37000 must be a token id in \[0, vocab_size=37000\)"),
    ],
)
def test_validation_errors_name_field_and_fix(field, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{field: value})


def test_heads_must_divide_d_model():
    with pytest.raises(ConfigError, match=r"d_model=512 is not divisible by model.num_heads=7"):
        ModelConfig(num_heads=7)
    # Explicit per-head sizes make it legal (d_k, d_v need not be d_model / h).
    assert ModelConfig(num_heads=7, d_k=64, d_v=32).head_dim_v == 32


def test_sinusoidal_needs_even_width():
    with pytest.raises(ConfigError, match="must be even for sinusoidal"):
        ModelConfig(d_model=33, num_heads=3, positional="sinusoidal")
    ModelConfig(d_model=33, num_heads=3, positional="learned")


def test_unknown_fields_rejected():
    with pytest.raises(ConfigError, match=r"config.model: unknown fields \['num_layers'\]"):
        ModelConfig.from_dict({"num_layers": 3})
    with pytest.raises(ConfigError, match="config.model: unknown fields"):
        PRESETS["paper_base"].replace(hidden=3)
    with pytest.raises(ConfigError, match="unknown preset 'paper_huge'"):
        get_preset("paper_huge")


def test_config_is_frozen_and_replace_validates():
    c = PRESETS["paper_base"]
    with pytest.raises(AttributeError):
        c.d_model = 3
    with pytest.raises(ConfigError):
        c.replace(num_heads=5)
    assert c.replace(ln_position="pre").ln_position == "pre" and c.ln_position == "post"


def _load_config_file(name):
    return load_config(str(ROOT / "configs" / f"{name}.py"))


@pytest.mark.parametrize("name", ["paper_base", "paper_big"])
def test_config_files_build_the_presets(name):
    config = _load_config_file(name)
    assert model_config_from(config) == PRESETS[name]


def test_config_file_overrides_and_locking():
    config = _load_config_file("paper_base")
    config.model.d_k = 32  # an Optional field is still overridable (typed placeholder)
    config.model.ln_position = "pre"
    c = model_config_from(config)
    assert c.head_dim_qk == 32 and c.ln_position == "pre"
    with pytest.raises(AttributeError):
        config.model.num_layers = 3  # locked: typos fail at once
    config.model.score_fn = "cosine"
    with pytest.raises(ConfigError, match="score_fn='cosine'"):
        model_config_from(config)


def test_registries_check_the_config_in_a_fresh_process():
    """The score-function registry and the sparse-spec grammar check a ModelConfig even
    when nothing but flaxformer_lite.config.model was imported (the package imports them)."""
    import subprocess
    import sys

    code = (
        "from flaxformer_lite.config.model import ConfigError, ModelConfig\n"
        "for bad in (dict(score_fn='cosine'), dict(attention_pattern='nope')):\n"
        "    try:\n"
        "        ModelConfig(**bad)\n"
        "    except ConfigError as e:\n"
        "        print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.splitlines()
    assert len(out) == 2
    assert out[0].startswith("model.score_fn='cosine' is not allowed")
    assert out[1].startswith("model.attention_pattern='nope': unknown sparse pattern 'nope'")
