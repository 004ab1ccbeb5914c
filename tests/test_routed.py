"""Dynamic block-sparse attention (``moba``, ``nsa``): the routed kernel against float64
oracles written here (masked dense attention under the mask the routing chose; NSA's
three branches and gates from the paper's formula), values and gradients; the limits
that hold whatever the routing; the mutations those comparisons catch; no ``n x n``
array in the program; and the patterns in the grammar, the config and the model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ModelConfig
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.model import head_groups
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.sparse.grammar import dynamic as D
from flaxformer_lite.sparse.grammar import patterns as P
from flaxformer_lite.sparse.grammar.spec import PatternSpecError, parse_spec
from flaxformer_lite.sparse.ops.moba import xla as routed
from flaxformer_lite.sparse.ops.nsa import xla as nsa
from tests import oracles

B, N, H, DK = 8, 45, 2, 8  # 45: the last block is partial
SEGMENTS = np.array([[1] * 20 + [2] * 20 + [0] * 5, [1] * 45])  # packed, padded; plain


def _inputs(dtype=jnp.float64, seed=0):
    return oracles.random_qkvw(dtype, 2, N, H, DK, seed)


def _dense(q, k, v, mask):
    """Masked dense attention in float64 (``mask`` ``[b, h, n, n]``); empty rows give 0."""
    return oracles.dense_with_mask(q, k, v, mask, jnp)


def _grads(f, args, w):
    return jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=tuple(range(len(args))))(*args)


def _close(f, g, args, w, tol):
    """Values and every gradient of ``f`` within ``tol`` of ``g``'s (max abs)."""
    np.testing.assert_allclose(jax.jit(f)(*args), jax.jit(g)(*args), atol=tol, rtol=0)
    grads = (jax.jit(lambda *a, x=x: _grads(x, a, w))(*args) for x in (f, g))
    for a, b in zip(*map(jax.tree.leaves, grads), strict=True):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0)


# (causal, packed): the decoder's case (causal, packed) in the default run, the other
# three in the slow tier.
CASES = [(True, True)] + [
    pytest.param(c, s, marks=pytest.mark.slow)
    for c, s in ((False, False), (False, True), (True, False))
]


@pytest.mark.parametrize("causal,packed", CASES)
@pytest.mark.parametrize("top_k", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_moba_equals_dense_attention_under_the_mask_its_routing_chose(causal, packed, top_k):
    # float64 end to end: the same sums in another order, ~1e-15 (bound 1e-10).
    with jax.enable_x64(True):
        q, k, v, w = _inputs()
        seg = jnp.asarray(SEGMENTS) if packed else None
        kw = dict(block=B, causal=causal, segments=seg)
        routing = routed.moba_attention(q, k, v, top_k, routing_only=True, **kw)
        mask = routed.routed_mask(routing, B, N, causal, seg)
        if causal:  # never a future key, never a future block
            assert not np.any(np.triu(np.asarray(mask), 1))
            own = np.arange(48)[:, None] // B
            assert np.all(np.where(routing.valid, routing.table < own, True))
        share = float(mask.sum() / (2 * H * N * N))
        assert 0.05 < share < (0.6 if causal else 0.8)  # sparse, and not empty
        moba = lambda q, k, v, t=top_k, kw=kw: routed.moba_attention(q, k, v, t, **kw)
        _close(moba, lambda q, k, v, m=mask: _dense(q, k, v, m), (q, k, v), w, 1e-10)


def test_the_routing_is_the_gate_of_each_query_and_the_mean_keys():
    """MoBA's gate, recomputed plainly: query ``t`` ranks the other blocks (causal:
    earlier ones) by its scaled query . their mean key, and keeps the best ``k - 1``;
    with ``block_gate=1`` (not causal) a block's mean query decides for all of it."""
    with jax.enable_x64(True):
        q, k, v, w = _inputs()
        qn, kn = np.asarray(q) / np.sqrt(DK), np.asarray(k)
        mean = lambda x, r, h, j: x[r, j * B : (j + 1) * B, h].mean(0)
        for block_gate in (False, True):
            kw = dict(block=B, causal=not block_gate, block_gate=block_gate)
            routing = routed.moba_attention(q, k, v, 3, routing_only=True, **kw)
            for r, h, t in ((0, 0, 44), (1, 1, 30), (0, 1, 9), (1, 0, 3)):
                a = t // B
                others = [j for j in range(6) if j != a and (j < a or block_gate)]
                query = mean(qn, r, h, a) if block_gate else qn[r, t, h]
                best = sorted(others, key=lambda j: -query @ mean(kn, r, h, j))[:2]
                got = np.asarray(routing.table[r, h, t])[np.asarray(routing.valid[r, h, t])]
                assert list(got) == best, (block_gate, t)
        # The block gate computes what it chose (not causal), and refuses causality.
        routing = routed.moba_attention(q, k, v, 3, block=B, block_gate=True, routing_only=True)
        mask = routed.routed_mask(routing, B, N, False)
        moba = lambda q, k, v: routed.moba_attention(q, k, v, 3, block=B, block_gate=True)
        _close(moba, lambda q, k, v: _dense(q, k, v, mask), (q, k, v), w, 1e-10)
        with pytest.raises(ValueError, match="not causal"):
            routed.moba_attention(q, k, v, 3, block=B, block_gate=True, causal=True)
        with pytest.raises(ConfigError, match="not causal"):
            ModelConfig(vocab_size=24, d_model=16, num_heads=2, d_ff=32, max_len=32,
                        attention_dropout=0.0, attention_pattern="moba:block_gate=1")  # fmt: skip


def test_the_limits_whatever_the_routing():
    """k = 1 is block-local attention (the own block); k >= the number of blocks is
    dense attention, causal or not: neither depends on what the gate prefers."""
    with jax.enable_x64(True):
        q, k, v, w = _inputs(seed=1)
        for causal in (False, True):
            own = P.BlockLocal(B, 0).causal() if causal else P.BlockLocal(B, 0)
            full = P.Full().causal() if causal else P.Full()
            for top_k, pattern in ((1, own), (6, full), (50, full)):
                moba = lambda q, k, v, t=top_k, c=causal: routed.moba_attention(
                    q, k, v, t, block=B, causal=c
                )  # fmt: skip
                ref = lambda q, k, v, p=pattern: oracles.masked_attention(q, k, v, p)
                _close(moba, ref, (q, k, v), w, 1e-10)


@pytest.mark.parametrize("kernel", sorted(routed.XLA_KERNELS))
def test_a_dropped_or_future_block_is_caught(kernel):
    """The comparisons above fail on a kernel that loses a chosen block or reads a future
    one: each mutation moves the output away from the oracle's (both XLA kernels)."""
    with jax.enable_x64(True):
        q, k, v, _ = _inputs(seed=2)
        routing = routed.moba_attention(q, k, v, 3, block=B, causal=True, routing_only=True)
        want = _dense(q, k, v, routed.routed_mask(routing, B, N, True))
        scaled = (q / np.sqrt(DK), k, v)
        qs, ks, vs = (
            jnp.pad(jnp.swapaxes(x, 1, 2), ((0, 0),) * 2 + ((0, 3), (0, 0))) for x in scaled
        )

        def run(table, valid, causal=True):
            _, l, o = routed.XLA_KERNELS[kernel](qs, ks, vs, table, valid, B, N, causal)
            return jnp.swapaxes((o / jnp.maximum(l, 1e-300)[..., None])[:, :, :N], 1, 2)

        np.testing.assert_allclose(run(routing.table, routing.valid), want, atol=1e-10)
        dropped = routing.valid.at[:, :, 40, 0].set(False)  # query 40 loses its best pick
        assert np.abs(run(routing.table, dropped) - want).max() > 1e-3
        future = routing.table.at[:, :, 20, 0].set(4)  # query 20 (block 2) reads block 4...
        assert np.abs(run(future, routing.valid, causal=False) - want).max() > 1e-3


def _range(seg, present, r, j):
    """(least, largest) segment id of block ``j``'s present tokens in row ``r``, or None."""
    ids = seg[r, j * B : (j + 1) * B][present[r, j * B : (j + 1) * B]]
    return (ids.min(), ids.max()) if ids.size else None


def _compressed(q, k, v, params, causal, seg):
    """NSA's compressed keys and values (projected block means of the present tokens)
    and which a query sees: blocks ending at or before it, holding only its segment."""
    b, n, h, d = q.shape
    nb, i = -(-n // B), np.arange(n)
    present = seg != 0
    kc, vc, visible = [], [], np.zeros((b, n, nb), bool)
    for j in range(nb):
        sl = slice(j * B, min(n, j * B + B))
        weight = jnp.asarray(present[:, sl], q.dtype)[:, :, None, None]
        count = jnp.maximum(weight.sum(1), 1)
        kc.append((k[:, sl] * weight).sum(1) / count)
        vc.append((v[:, sl] * weight).sum(1) / count)
        for r in range(b):
            span = _range(seg, present, r, j)
            if span and span[0] == span[1]:
                visible[r, :, j] = (seg[r] == span[0]) & (((j + 1) * B - 1 <= i) | (not causal))
    kc = jnp.einsum("bjhd,hde->bjhe", jnp.stack(kc, 1), params["compress_k"])
    vc = jnp.einsum("bjhd,hde->bjhe", jnp.stack(vc, 1), params["compress_v"])
    return kc, vc, visible


def _check_selection(q, k, v, params, routing, top_k, causal, seg):
    """The selected blocks are NSA's: each query's ``top_k - 1`` candidates (another
    block, earlier where causal, holding present keys whose segment ids span the query's;
    none for padding) of the largest compressed attention probability."""
    b, n, h, d = q.shape
    nb, present = -(-n // B), seg != 0
    kc, _, visible = _compressed(q, k, v, params, causal, seg)
    s = np.einsum("bqhd,bjhd->bhqj", np.asarray(q), np.asarray(kc)) / np.sqrt(d)
    s = np.where(visible[:, None], s, -np.inf)
    p = np.exp(s - np.where(visible[:, None], s, -1e300).max(-1, keepdims=True))
    p = np.where(visible[:, None], p / np.maximum(p.sum(-1, keepdims=True), 1e-300), 0.0)
    for r in range(b):
        for hh in range(h):
            for t in range(n):
                a = t // B
                ok = [
                    j for j in range(nb)
                    if present[r, t] and j != a and (j < a or not causal)
                    and (span := _range(seg, present, r, j)) and span[0] <= seg[r, t] <= span[1]
                ]  # fmt: skip
                best = sorted(ok, key=lambda j: (-p[r, hh, t, j], j))[: top_k - 1]
                got = np.asarray(routing.table[r, hh, t])[np.asarray(routing.valid[r, hh, t])]
                assert sorted(got) == sorted(best), (r, hh, t)


def _nsa_oracle(q, k, v, params, routing, window, causal, seg):
    """NSA's formula in float64, each branch plainly: compressed, selected (under the
    routing's mask), window; sigmoid gates of the head's query."""
    n, i = q.shape[1], np.arange(q.shape[1])
    kc, vc, visible = _compressed(q, k, v, params, causal, seg)
    out_c = _dense(q, kc, vc, jnp.asarray(visible)[:, None])
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    near = (np.abs(i[:, None] - i[None]) <= window) & ((i[None] <= i[:, None]) | (not causal))
    out_w = _dense(q, k, v, jnp.asarray(near[None] & same)[:, None])
    out_s = _dense(q, k, v, routed.routed_mask(routing, B, n, causal, jnp.asarray(seg)))
    gates = jax.nn.sigmoid(jnp.einsum("bnhd,hdc->bnhc", q, params["gate_w"]) + params["gate_b"])
    return gates[..., :1] * out_c + gates[..., 1:2] * out_s + gates[..., 2:] * out_w


@pytest.mark.parametrize("causal,packed", CASES)
@pytest.mark.parametrize("window", [12, pytest.param(6, marks=pytest.mark.slow)])
def test_nsa_equals_the_papers_formula(causal, packed, window):
    # float64 end to end (bound 1e-10): each branch, the gated sum and the gradients of
    # the queries, keys, values, projections and gates. A window of 12 reaches two blocks
    # back and shares the own block's reading with the selected branch; one of 6 (< B - 1)
    # reads its own part of the own block.
    with jax.enable_x64(True):
        q, k, v, w = _inputs(seed=3)
        rng = np.random.default_rng(0)
        params = {
            "compress_k": jnp.asarray(rng.normal(size=(H, DK, DK))) / 3,
            "compress_v": jnp.asarray(rng.normal(size=(H, DK, DK))) / 3,
            "gate_w": jnp.asarray(rng.normal(size=(H, DK, 3))),
            "gate_b": jnp.asarray(rng.normal(size=(H, 3))),
        }
        seg = SEGMENTS if packed else np.ones((2, N), int)
        kw = dict(block=B, causal=causal, segments=jnp.asarray(seg) if packed else None)
        _, branches, _, routing = nsa.nsa_attention(q, k, v, params, 3, window, parts=True, **kw)
        _check_selection(q, k, v, params, routing, 3, causal, seg)
        f = lambda q, k, v, p: nsa.nsa_attention(q, k, v, p, 3, window, **kw)
        g = lambda q, k, v, p: _nsa_oracle(q, k, v, p, routing, window, causal, seg)
        _close(f, g, (q, k, v, params), w, 1e-10)
        assert all(float(jnp.abs(x).max()) > 0.1 for x in branches.values())  # all at work


def test_float32_kernels_within_float32_epsilon_of_float64():
    """The kernels in float32 against the float64 oracle (1e-5: float32's epsilon times
    the sums of a few blocks, observed ~1e-6)."""
    q64, k64, v64, w64 = _inputs(jnp.float32)
    with jax.enable_x64(True):
        q, k, v, w = (jnp.asarray(x, jnp.float64) for x in (q64, k64, v64, w64))
        routing = routed.moba_attention(q, k, v, 3, block=B, causal=True, routing_only=True)
        mask = routed.routed_mask(routing, B, N, True)
        want = _dense(q, k, v, mask)
        want_grads = _grads(lambda q, k, v: _dense(q, k, v, mask), (q, k, v), w)
    f = lambda q, k, v: routed.moba_attention(q, k, v, 3, block=B, causal=True)
    np.testing.assert_allclose(f(q64, k64, v64), want, atol=1e-5)
    for a, b in zip(_grads(f, (q64, k64, v64), w64), want_grads, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def _largest_array(fn, *args) -> int:
    """Elements of the largest array any equation of ``fn``'s program (forward and
    backward, loops and custom rules included) makes."""
    biggest = 0

    def walk(jaxpr):
        nonlocal biggest
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                biggest = max(biggest, int(np.prod(getattr(var.aval, "shape", ()))))
            for param in eqn.params.values():
                for sub in param if isinstance(param, tuple | list) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return biggest


def test_no_n_by_n_array_forward_or_backward():
    # Head size 2, so that an array's element count is its pairs' (keys gathered per
    # query are pairs too): the routing is n * n / B, a group's scores 2B x kB.
    n, block, d = 1024, 64, 2
    q, k, v, _ = oracles.random_qkvw(jnp.float32, 1, n, 1, d)
    params = nsa.init_params(1, d, d)
    for fn in (
        lambda q, k, v: routed.moba_attention(q, k, v, 3, block=block, causal=True).sum(),
        lambda q, k, v: nsa.nsa_attention(q, k, v, params, 3, 64, block=block, causal=True).sum(),
    ):
        largest = _largest_array(jax.value_and_grad(fn, argnums=(0, 1, 2)), q, k, v)
        assert largest <= n * n // 16, largest  # dense's n x n would be 16x this


def test_the_patterns_in_the_grammar_and_the_config():
    ((moba,),) = parse_spec("moba:k=5", block_size=16)
    assert moba == D.MoBA(16, 5) and moba.causal().is_causal
    ((nsa_p,),) = parse_spec("nsa:block=8,k=2,window=32")
    assert nsa_p == D.NSA(8, 2, 32)
    for bad, words in (("moba+local:window=4", "moba cannot be combined"),
                       ("moba:k=0", "k=0"), ("nsa:windows=3", "bad argument")):  # fmt: skip
        with pytest.raises(PatternSpecError, match=words):
            parse_spec(bad)
    base = dict(vocab_size=24, d_model=16, num_heads=2, d_ff=32, max_len=32,
                attention_block_size=4, attention_dropout=0.0)  # fmt: skip
    ModelConfig(**base, attention_pattern="moba:k=2;nsa:k=2,window=4")
    ModelConfig(**base, attention_pattern="moba:block=16;nsa:block=32", attention_impl="cudnn")
    for impl, pattern, words in (
        ("splash", "moba", "splash reads fixed masks"),
        ("cudnn", "moba:block=24", "block=24 is no power of two >= 16"),
        ("cudnn", "topk:k=4", "no fused GPU kernel"),
    ):
        with pytest.raises(ConfigError, match=words):
            ModelConfig(**base, attention_pattern=pattern, attention_impl=impl)


@pytest.mark.slow  # ~10 s; the cached-decoding test runs the same model in the default run
def test_a_language_model_trains_on_them_and_sows_their_weights():
    moba, nsa_spec = "moba:block=4,k=2", "nsa:block=4,k=2,window=3"
    config = ModelConfig(
        vocab_size=24, d_model=24, num_heads=3, d_ff=32, num_decoder_layers=1, max_len=32,
        attention_pattern=f"{moba};{nsa_spec};local:window=2", attention_block_size=4,
        attention_dropout=0.0, sow_attention_weights=True,
    )  # fmt: skip
    model = LanguageModel(config)
    x = jnp.array([[5, 6, 7, 8, 9, 10, 11, 12, 13, 1, 0, 0]])
    params = unbox(model.init(jax.random.key(0), x))["params"]
    layer = params["decoder"]["layer_0"]["self_attention"]
    assert {"nsa1_gate_w", "nsa1_gate_b", "nsa1_compress_k", "nsa1_compress_v"} <= set(layer)
    logits, state = model.apply({"params": params}, x, mutable=["intermediates"])
    grads = jax.grad(lambda p: model.apply({"params": p}, x).sum())(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
    nsa_grads = grads["decoder"]["layer_0"]["self_attention"]
    assert all(float(jnp.abs(nsa_grads[f"nsa1_{name}"]).max()) > 0 for name in nsa.PARAMS)
    (weights,) = state["intermediates"]["decoder"]["layer_0"]["self_attention"]["attention_weights"]
    assert not np.any(np.triu(np.asarray(weights[0]), 1))  # causal, the routed heads too
    np.testing.assert_allclose(np.asarray(weights[0, :, :10]).sum(-1), 1.0, rtol=1e-5)
    # The moba head's weights lie inside the blocks its routing chose.
    q = jnp.asarray(np.random.default_rng(0).normal(size=(1, 12, 1, 8)))
    mask = head_groups.dense_scores(q, q, [parse_spec(moba)[0][0].causal()])[1]
    routing = routed.moba_attention(q, q, q, 2, block=4, causal=True, routing_only=True)
    np.testing.assert_array_equal(mask, routed.routed_mask(routing, 4, 12, True))


_DECODING = dict(
    vocab_size=40, d_model=24, num_heads=3, d_ff=32, num_encoder_layers=1, num_decoder_layers=2,
    max_len=32, attention_block_size=4, attention_dropout=0.0, embedding_dropout=0.0,
    residual_dropout=0.0, dtype="float64", param_dtype="float64",
    attention_pattern="moba:block=4,k=2;nsa:block=4,k=2,window=3;moba:block=4,k=3",
)  # fmt: skip


def test_a_decoding_step_routes_as_the_full_forward():
    """The cheap form of the model test below: decode_routing over a cache of keys, for
    every position at once, reads exactly the pairs the full forward's routing chose."""
    with jax.enable_x64(True):
        q, k, v, _ = _inputs(seed=3)
        routing = routed.moba_attention(q, k, v, 3, block=B, causal=True, routing_only=True)
        want = routed.routed_mask(routing, B, N, True)
        ql, kl = (jnp.swapaxes(x, 1, 2) for x in (q / np.sqrt(DK), k))
        pos = jnp.arange(N)
        step = routed.decode_routing(ql, kl, pos, B, 3)
        np.testing.assert_array_equal(routed.decode_mask(step, pos, N, B), want)


@pytest.mark.slow  # ~17 s of compiling; its cheap form is the test above
def test_cached_decoding_routes_over_the_cache_as_the_full_forward():
    """A step routes its query over the cached blocks (the complete earlier ones, by
    query . mean key; NSA by its compressed probabilities) and equals the full forward:
    a language model fed a 5-token prompt, then a token at a time (float64: the same
    choices, sums in another order; 1e-10)."""
    with jax.enable_x64(True):
        config = ModelConfig(**_DECODING)
        tokens = jnp.asarray(np.random.default_rng(0).integers(3, 40, (2, 15)))
        lm = LanguageModel(config)
        params = jax.tree.map(lambda x: 2 * x, unbox(lm.init(jax.random.key(1), tokens)))
        full = lm.apply(params, tokens)
        cache = unbox(lm.init(jax.random.key(1), tokens, decode=True))["cache"]
        inputs = jnp.pad(tokens[:, :-1], ((0, 0), (1, 0)), constant_values=config.bos_id)
        step = jax.jit(lambda cache, x: lm.apply({**params, "cache": cache}, x, decode=True,
                                                 mutable=["cache"]))  # fmt: skip
        outs = []
        for lo, hi in [(0, 5)] + [(t, t + 1) for t in range(5, 15)]:
            out, mutated = step(cache, inputs[:, lo:hi])
            cache = mutated["cache"]
            outs.append(out)
        np.testing.assert_allclose(jnp.concatenate(outs, 1), full, atol=1e-10, rtol=0)


@pytest.mark.slow
def test_a_translation_decoder_decodes_them_as_its_full_forward():
    from flaxformer_lite import Transformer
    from tests.test_transformer import _cached_decode

    with jax.enable_x64(True):
        tokens = jnp.asarray(np.random.default_rng(1).integers(3, 40, (2, 15)))
        model = Transformer(ModelConfig(**_DECODING))
        src, tgt = tokens[:, :12], tokens[:, 3:14]
        params = unbox(model.init(jax.random.key(2), src, tgt))["params"]
        full = model.apply({"params": params}, src, tgt)
        np.testing.assert_allclose(_cached_decode(model, params, src, tgt), full, atol=1e-10)


def test_both_ways_of_taking_the_top_blocks_choose_the_same():
    """argmax passes (the GPU's default) and XLA's top_k give the same table and slots,
    ties (rounded scores) and rows with fewer allowed blocks than slots included."""
    # integers 1..8: many ties (and no signed zeros, which top_k's sort orders)
    scores = jnp.floor(8 * jax.random.uniform(jax.random.key(1), (3, 2, 40, 12))) + 1
    allowed = jax.random.uniform(jax.random.key(2), scores.shape) < 0.4
    a, b = (routed.top_blocks(scores, allowed, 5, by=by) for by in ("top_k", "argmax"))
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(np.where(a[1], a[0], -1), np.where(b[1], b[0], -1))
    assert not np.asarray(a[1]).all()  # some rows have empty slots
