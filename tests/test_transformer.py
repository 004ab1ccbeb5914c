"""The encoder-decoder and the LM: causality, padding, caching, packing, tying."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, Transformer
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.model.dropout import Dropout
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.model.transformer import shift_right

SRC = jnp.array([[5, 6, 7, 8, 9, 0, 0], [11, 12, 13, 14, 15, 16, 17]])
TGT = jnp.array([[20, 21, 22, 23, 24, 1], [25, 26, 27, 28, 1, 0]])


def _init(model, *args, **kw):
    return unbox(model.init(jax.random.key(0), *args, **kw))["params"]


def test_shift_right_plain_and_packed():
    t = jnp.array([[7, 8, 9, 1]])
    np.testing.assert_array_equal(shift_right(t, 2), [[2, 7, 8, 9]])
    packed = jnp.array([[7, 8, 1, 5, 1, 0]])
    pos = jnp.array([[0, 1, 2, 0, 1, 0]])
    np.testing.assert_array_equal(shift_right(packed, 2, pos), [[2, 7, 8, 2, 5, 2]])


@pytest.mark.parametrize("ln_position", ["post", "pre"])
def test_decoder_is_causal(tiny_config, ln_position):
    c = tiny_config.replace(ln_position=ln_position)
    model = Transformer(c)
    params = _init(model, SRC, TGT)
    base = model.apply({"params": params}, SRC, TGT)
    t = 3
    changed = TGT.at[:, t:].set(jnp.array([[30, 31, 32], [33, 34, 35]]))
    other = model.apply({"params": params}, SRC, changed)
    # logits at positions <= t only see targets < t; targets >= t are the future.
    np.testing.assert_allclose(other[:, : t + 1], base[:, : t + 1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(other[:, t + 1 :], base[:, t + 1 :])


def test_no_gradient_from_future_tokens(tiny_config):
    """d logits[t] / d embedding(token) == 0 for tokens that appear only after t."""
    c = tiny_config.replace(tie_embeddings="none")  # decoder's own table, untied softmax
    model = Transformer(c)
    src = jnp.array([[5, 6, 7]])
    tgt = jnp.array([[40, 41, 42, 43, 44]])  # decoder inputs: BOS 40 41 42 43
    params = _init(model, src, tgt)
    t = 2  # depends on BOS, 40, 41
    g = jax.jit(jax.grad(lambda p: model.apply({"params": p}, src, tgt)[0, t].sum()))(params)
    rows = np.abs(np.asarray(g["decoder"]["embed"]["embedding"])).sum(-1)
    assert rows[40] > 0 and rows[41] > 0 and rows[c.bos_id] > 0
    assert rows[42] == 0.0 and rows[43] == 0.0 and rows[44] == 0.0


@pytest.mark.parametrize("ln_position", ["post", "pre"])
def test_padding_does_not_change_real_positions(tiny_config, ln_position):
    c = tiny_config.replace(ln_position=ln_position)
    model = Transformer(c)
    src = jnp.array([[5, 6, 7, 8]])
    tgt = jnp.array([[20, 21, 1]])
    params = _init(model, src, tgt)
    enc = model.apply({"params": params}, src, method=Transformer.encode)
    logits = model.apply({"params": params}, src, tgt)
    for pad in (1, 5):
        src_p = jnp.pad(src, ((0, 0), (0, pad)))
        tgt_p = jnp.pad(tgt, ((0, 0), (0, pad + 1)))
        enc_p = model.apply({"params": params}, src_p, method=Transformer.encode)
        np.testing.assert_allclose(enc_p[:, :4], enc, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(
            model.apply({"params": params}, src_p, tgt_p)[:, :3], logits, rtol=1e-5, atol=1e-5
        )
    # A padded neighbour in the batch changes nothing either.
    batch = jnp.concatenate([jnp.pad(src, ((0, 0), (0, 3))), jnp.array([[9, 9, 9, 9, 9, 9, 9]])])
    enc_b = model.apply({"params": params}, batch, method=Transformer.encode)
    np.testing.assert_allclose(enc_b[:1, :4], enc, rtol=1e-5, atol=1e-5)


def _cached_decode(model, params, src, tgt):
    """Feed BOS, tgt[0], ... one token at a time through the cache; stack logits."""
    c = model.config
    cache = unbox(model.init(jax.random.key(0), src, tgt, decode=True))["cache"]
    encoded = model.apply({"params": params}, src, method=Transformer.encode)
    dec_in = shift_right(tgt, c.bos_id)
    steps = []
    for i in range(tgt.shape[1]):
        logits, mutated = model.apply(
            {"params": params, "cache": cache},
            encoded if i == 0 else None,
            src,
            dec_in[:, i : i + 1],
            decode=True,
            mutable=["cache"],
            method=Transformer.decode,
        )
        cache = mutated["cache"]
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize(
    "overrides",
    [
        {"ln_position": "post"},
        {"ln_position": "pre"},
        {"positional": "learned", "tie_embeddings": "none"},
        {"score_fn": "bilinear", "tie_embeddings": "src_tgt"},
        {"positional": "rotary"},  # the cache holds keys turned by their own positions
    ],
)
def test_cached_decoding_equals_full_forward(tiny_config, overrides):
    c = tiny_config.replace(**overrides)
    model = Transformer(c)
    params = _init(model, SRC, TGT)
    full = model.apply({"params": params}, SRC, TGT)
    cached = _cached_decode(model, params, SRC, TGT)
    real = np.asarray(TGT != 0)  # a padding target is masked in the full pass only
    assert real.sum() == 11
    np.testing.assert_allclose(
        np.asarray(cached)[real], np.asarray(full)[real], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("ln_position", ["post", "pre", "pre-rotary"])
def test_lm_cached_decoding_equals_full_forward(tiny_config, ln_position):
    rotary = ln_position.endswith("-rotary")
    c = tiny_config.replace(
        ln_position=ln_position.removesuffix("-rotary"),
        positional="rotary" if rotary else tiny_config.positional,
    )
    lm = LanguageModel(c)
    tokens = jnp.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    params = _init(lm, tokens)
    full = lm.apply({"params": params}, tokens)
    cache = unbox(lm.init(jax.random.key(0), tokens, decode=True))["cache"]
    inputs = shift_right(tokens, c.bos_id)
    outs = []
    for lo, hi in [(0, 3), (3, 4), (4, 5), (5, 6)]:  # a 3-token prompt, then single steps
        out, mutated = lm.apply(
            {"params": params, "cache": cache}, inputs[:, lo:hi], decode=True, mutable=["cache"]
        )
        cache = mutated["cache"]
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=1e-5, atol=1e-5)


def test_lm_is_causal(tiny_config):
    lm = LanguageModel(tiny_config)
    tokens = jnp.array([[5, 6, 7, 8, 9, 10]])
    params = _init(lm, tokens)
    a = lm.apply({"params": params}, tokens)
    b = lm.apply({"params": params}, tokens.at[:, 3:].set(40))
    np.testing.assert_allclose(a[:, :4], b[:, :4], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_packed_equals_padded(tiny_config, positional):
    model = Transformer(tiny_config.replace(positional=positional))
    s1, t1 = [5, 6, 7, 1], [20, 21, 1]
    s2, t2 = [8, 9, 1], [22, 23, 24, 1]
    src = jnp.array([s1 + s2 + [0]])
    tgt = jnp.array([t1 + t2 + [0]])
    src_seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    tgt_seg = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]])
    src_pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]])
    tgt_pos = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])
    params = _init(model, src, tgt)
    packed = model.apply(
        {"params": params},
        src,
        tgt,
        inputs_positions=src_pos,
        targets_positions=tgt_pos,
        inputs_segmentation=src_seg,
        targets_segmentation=tgt_seg,
    )
    padded = model.apply({"params": params}, jnp.array([s1, s2 + [0]]), jnp.array([t1 + [0], t2]))
    np.testing.assert_allclose(packed[0, :3], padded[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:7], padded[1, :4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("positional", ["sinusoidal", "rotary"])
def test_lm_packed_equals_padded(tiny_config, positional):
    lm = LanguageModel(tiny_config.replace(positional=positional))
    a, b = [5, 6, 7, 1], [8, 9, 1]
    packed_tokens = jnp.array([a + b + [0]])
    seg = jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]])
    pos = jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]])
    params = _init(lm, packed_tokens)
    packed = lm.apply({"params": params}, packed_tokens, positions=pos, segmentation=seg)
    padded = lm.apply({"params": params}, jnp.array([a, b + [0]]))
    np.testing.assert_allclose(packed[0, :4], padded[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 4:7], padded[1, :3], rtol=1e-5, atol=1e-5)


def test_sparse_packed_equals_padded(tiny_config):
    """A pattern counted from each sequence's start (BigBird's blocks, global block and
    random block; blocks of 2 tokens) in the encoder and the causal decoder: the second
    sequences start on a block boundary (inputs) and off one (targets). The kernels'
    own tests hold every pattern to it; this checks that the model says its rows are
    packed."""
    config = tiny_config.replace(
        attention_pattern="bigbird:window=1,global=1,random=1", attention_block_size=2,
        num_encoder_layers=1, num_decoder_layers=1,
    )  # fmt: skip
    model = Transformer(config)
    s1, t1, s2, t2 = [5, 6, 7, 1], [20, 21, 1], [8, 9, 4, 1], [22, 23, 24, 25, 1]
    src, tgt = jnp.array([s1 + s2]), jnp.array([t1 + t2])
    src_seg, tgt_seg = jnp.array([[1] * 4 + [2] * 4]), jnp.array([[1] * 3 + [2] * 5])
    src_pos, tgt_pos = jnp.array([[0, 1, 2, 3] * 2]), jnp.array([[0, 1, 2, 0, 1, 2, 3, 4]])
    params = unbox(jax.jit(model.init)(jax.random.key(0), src, tgt))["params"]
    apply = jax.jit(model.apply)
    packed = apply(
        {"params": params}, src, tgt, inputs_positions=src_pos, targets_positions=tgt_pos,
        inputs_segmentation=src_seg, targets_segmentation=tgt_seg,
    )  # fmt: skip
    padded = apply({"params": params}, jnp.array([s1, s2]), jnp.array([t1 + [0, 0], t2]))
    np.testing.assert_allclose(packed[0, :3], padded[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:], padded[1], rtol=1e-5, atol=1e-5)


def _param_names(params):
    return {
        "/".join(k.key for k in path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }


@pytest.mark.parametrize(
    "tie, present, absent",
    [
        (
            "all",
            {"shared_embedding/embedding"},
            {"decoder/logits/kernel", "encoder/embed/embedding"},
        ),
        (
            "src_tgt",
            {"shared_embedding/embedding", "decoder/logits/kernel"},
            {"decoder/embed/embedding"},
        ),
        (
            "tgt_softmax",
            {"encoder/embed/embedding", "decoder/embed/embedding"},
            {"decoder/logits/kernel", "shared_embedding/embedding"},
        ),
        (
            "none",
            {"encoder/embed/embedding", "decoder/embed/embedding", "decoder/logits/kernel"},
            {"shared_embedding/embedding"},
        ),
    ],
)
def test_embedding_tying_options(tiny_config, tie, present, absent):
    names = _param_names(_init(Transformer(tiny_config.replace(tie_embeddings=tie)), SRC, TGT))
    assert present <= names and not (absent & names)


def test_dropout_active_only_when_not_deterministic(tiny_config):
    c = tiny_config.replace(residual_dropout=0.3, embedding_dropout=0.3)
    model = Transformer(c)
    params = _init(model, SRC, TGT)
    det = model.apply({"params": params}, SRC, TGT)
    np.testing.assert_array_equal(det, model.apply({"params": params}, SRC, TGT))
    d1 = model.apply(
        {"params": params},
        SRC,
        TGT,
        deterministic=False,
        rngs={"dropout": jax.random.key(1)},
    )
    d2 = model.apply(
        {"params": params},
        SRC,
        TGT,
        deterministic=False,
        rngs={"dropout": jax.random.key(2)},
    )
    assert not np.allclose(d1, det) and not np.allclose(d1, d2)


def test_token_dropout_zeros_whole_vectors_without_rescaling():
    x = jax.random.normal(jax.random.key(0), (4, 50, 8))
    layer = Dropout(0.25, bits=32, whole_tokens=True)
    np.testing.assert_array_equal(layer.apply({}, x, deterministic=True), x)
    y = np.asarray(layer.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)}))
    dropped = (y == 0).all(-1)
    kept = (y == np.asarray(x)).all(-1)
    assert (dropped | kept).all()  # each token vector is whole or zero, never rescaled
    assert 0.15 < dropped.mean() < 0.35


def test_source_token_dropout_reads_as_a_zero_embedding(tiny_config):
    """Training with source word dropout == evaluating with the dropped source tokens
    replaced by a token whose embedding is zero (all 2^7 drop sets enumerated)."""
    c = tiny_config.replace(source_token_dropout=0.4)
    model = Transformer(c)
    src, tgt = SRC[1:], TGT[1:]
    params = _init(model, src, tgt)
    zero_id = 49
    table = params["shared_embedding"]["embedding"]
    params["shared_embedding"]["embedding"] = table.at[zero_id].set(0.0)
    # Evaluation ignores the setting: same output as the model without it.
    evaluate = jax.jit(model.apply)  # one compile per shape instead of op-by-op dispatch
    plain = jax.jit(Transformer(tiny_config).apply)({"params": params}, src, tgt)
    np.testing.assert_array_equal(evaluate({"params": params}, src, tgt), plain)
    n = src.shape[1]
    masks = (np.arange(2**n)[:, None] >> np.arange(n)) & 1  # 1 = dropped
    variants = jnp.where(masks == 1, zero_id, src)
    expected = evaluate({"params": params}, variants, jnp.repeat(tgt, 2**n, 0))
    seen = set()
    train = jax.jit(
        lambda key: model.apply(
            {"params": params}, src, tgt, deterministic=False, rngs={"dropout": key}
        )
    )
    for k in range(12):
        out = train(jax.random.key(k))
        err = np.abs(np.asarray(expected) - np.asarray(out)).max(axis=(1, 2))
        assert err.min() < 1e-5, err.min()
        seen.add(int(err.argmin()))
    assert len(seen) > 3  # different keys drop different tokens


def test_target_token_dropout_changes_training_only(tiny_config):
    c = tiny_config.replace(target_token_dropout=0.4)
    model = Transformer(c)
    params = _init(model, SRC, TGT)
    det = model.apply({"params": params}, SRC, TGT)
    np.testing.assert_array_equal(det, Transformer(tiny_config).apply({"params": params}, SRC, TGT))
    train = model.apply(
        {"params": params}, SRC, TGT, deterministic=False, rngs={"dropout": jax.random.key(0)}
    )
    assert not np.allclose(train, det)


def test_attention_weights_are_observable(tiny_config):
    model = Transformer(tiny_config.replace(sow_attention_weights=True))
    params = _init(model, SRC, TGT)
    _, state = model.apply({"params": params}, SRC, TGT, mutable=["intermediates"])
    inter = state["intermediates"]
    w = inter["decoder"]["layer_1"]["cross_attention"]["attention_weights"][0]
    assert w.shape == (2, 4, 6, 7)  # [b, h, target, source]
    np.testing.assert_allclose(np.asarray(w)[0, :, :, 5:], 0.0)  # source padding gets nothing


def test_too_long_input_is_a_clear_error(tiny_config):
    model = Transformer(tiny_config.replace(max_len=8))
    with pytest.raises(ValueError, match=r"source length 9 exceeds model.max_len=8"):
        unbox(
            model.init(jax.random.key(0), jnp.ones((1, 9), jnp.int32), jnp.ones((1, 4), jnp.int32))
        )


def test_packing_needs_both_segmentations(tiny_config):
    model = Transformer(tiny_config)
    params = _init(model, SRC, TGT)
    with pytest.raises(ValueError, match="both inputs_segmentation and targets_segmentation"):
        model.apply({"params": params}, SRC, TGT, inputs_segmentation=jnp.ones_like(SRC))


def _with_live_shortcut(params):
    """The lexical shortcut's output map starts at zero; give it weights to test."""
    lexical = params["decoder"]["lexical"]
    live = jax.tree.map(lambda x: jax.random.normal(jax.random.key(7), x.shape) * 0.3, lexical)
    return {**params, "decoder": {**params["decoder"], "lexical": live}}


def test_lexical_shortcut_starts_as_the_model_without_it(tiny_config):
    plain = Transformer(tiny_config.replace(ln_position="pre"))
    lexical = Transformer(tiny_config.replace(ln_position="pre", lexical_shortcut=True))
    params = _init(lexical, SRC, TGT)
    assert set(params["decoder"]["lexical"]) == {"query", "key", "out"}
    without = {**params, "decoder": {k: v for k, v in params["decoder"].items() if k != "lexical"}}
    np.testing.assert_array_equal(
        lexical.apply({"params": params}, SRC, TGT), plain.apply({"params": without}, SRC, TGT)
    )
    # Once it has weights, the logits depend on the source tokens' embeddings through it.
    live = _with_live_shortcut(params)
    assert not np.allclose(
        lexical.apply({"params": live}, SRC, TGT), plain.apply({"params": without}, SRC, TGT)
    )
    with pytest.raises(ConfigError, match="lexical_shortcut reads the shared source embeddings"):
        tiny_config.replace(lexical_shortcut=True, tie_embeddings="tgt_softmax")


@pytest.mark.parametrize("ln_position", ["post", "pre"])
def test_lexical_shortcut_cached_equals_full_and_packed_equals_padded(tiny_config, ln_position):
    model = Transformer(tiny_config.replace(ln_position=ln_position, lexical_shortcut=True))
    params = _with_live_shortcut(_init(model, SRC, TGT))
    full = model.apply({"params": params}, SRC, TGT)
    cached = _cached_decode(model, params, SRC, TGT)
    real = np.asarray(TGT != 0)
    np.testing.assert_allclose(
        np.asarray(cached)[real], np.asarray(full)[real], rtol=1e-5, atol=1e-5
    )
    s1, t1, s2, t2 = [5, 6, 7, 1], [20, 21, 1], [8, 9, 1], [22, 23, 24, 1]
    packed = model.apply(
        {"params": params},
        jnp.array([s1 + s2 + [0]]),
        jnp.array([t1 + t2 + [0]]),
        inputs_positions=jnp.array([[0, 1, 2, 3, 0, 1, 2, 0]]),
        targets_positions=jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]]),
        inputs_segmentation=jnp.array([[1, 1, 1, 1, 2, 2, 2, 0]]),
        targets_segmentation=jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
    )
    padded = model.apply({"params": params}, jnp.array([s1, s2 + [0]]), jnp.array([t1 + [0], t2]))
    np.testing.assert_allclose(packed[0, :3], padded[0, :3], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[0, 3:7], padded[1, :4], rtol=1e-5, atol=1e-5)
