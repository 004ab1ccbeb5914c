"""Packing invisible to sparse attention: every sequence of a packed row attends as it
does alone in a padded row of the row's length, for every pattern name of the grammar
(registered ones too), causal or not. float64, outputs and the gradients of q, k and v,
through the model's head-group dispatch.

The oracle is the definition: each sequence alone at position 0 of its own row (a batch
of them, one call), under the kernels' unpacked path (``packed=False``), which the
exactness tests hold to the float64 dense reference. The packed rows mix sequences
shorter than a block, one block plus a token, long ones, starts on and off block
boundaries, and a batch whose sequences only fit the larger aligned layout (so both
layouts of :func:`~flaxformer_lite.sparse.ops.packing.in_sequences` run). Counting from
the row's start (``packed=False`` on the packed rows: the mutation) fails the same
comparison for every name that is not offset-invariant.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.model import head_groups
from flaxformer_lite.sparse.grammar import spec
from flaxformer_lite.sparse.ops import packing
from flaxformer_lite.sparse.ops.nsa import xla as nsa

B, N, H, D = 8, 64, 2, 8
# Each name with arguments that make it sparse at this length (the defaults are sized
# for rows of thousands); a registered name is tried with its defaults.
ARGS = {
    "local": "window=5", "dilated": "window=4,dilation=2", "strided": "stride=8",
    "sparse_strided": "stride=8", "fixed": "stride=8", "global": "first=2",
    "random": "blocks=2", "bigbird": "window=3,global=1,random=1",
    "longformer": "window=6,global=1", "etc": "window=6,global=2", "topk": "k=6",
    "moba": "k=2", "nsa": "k=2,window=6",
}  # fmt: skip
# Counted from the sequence's start (blocks, chunks, global tokens, random blocks,
# MoBA's and NSA's key blocks): on the unpacked path a packed row would differ.
ROW_ANCHORED = {"fixed", "global", "random", "block_local", "bigbird", "longformer", "etc",
                "moba", "nsa"}  # fmt: skip
# The default tier (the rest in the slow tier): the blocked kernel's every part
# (blocks, global keys and queries, random blocks) in both layouts.
DEFAULT = {("bigbird", False)}
# Sequence lengths of the rows (N tokens each, 0 = padding to the end). Row 0: starts
# at 0, 3, 8 (a block boundary), 25, 26, 35, 60; lengths 1..25, B + 1 among them. Row
# 1: sequences of B + 1 tokens take two blocks each, more than the tight layout holds.
ROWS = ((3, 5, 17, 1, 9, 25, 4), (9,) * 7)

# The gradients of float64 runs that compute the same sum in another order agree to a
# few hundred float64 epsilons (2.2e-16); 1e-9 leaves that margin many times over and
# is still far below any pattern difference (> 1e-2 where a key set differs).
TOL = 1e-9
# float32 runs (the Triton kernels' tiles) of the same sums in another order: outputs
# and gradients of size ~1 here agree to a few float32 epsilons (1.2e-7; measured 1-2);
# 1e-5 is ~80 of them, and still far below a pattern difference.
TOL32 = 1e-5


def _segments(rows):
    seg = np.zeros((len(rows), N), np.int32)
    spans = []  # (row, start, length) of each sequence
    for r, lengths in enumerate(rows):
        t = 0
        for i, length in enumerate(lengths):
            seg[r, t : t + length] = i + 1
            spans.append((r, t, length))
            t += length
    return seg, spans


def _cases():
    for name in spec.pattern_names():
        text = f"{name}:{ARGS[name]}" if name in ARGS else name
        for causal in (False, True):
            marks = [] if (name, causal) in DEFAULT else [pytest.mark.slow]
            kind = "causal" if causal else "encoder"
            yield pytest.param(text, causal, id=f"{name}-{kind}", marks=marks)


@pytest.fixture(scope="module")
def qkv():
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        return tuple(jnp.asarray(rng.normal(size=(len(ROWS), N, H, D))) for _ in range(4))


def _attend(pattern, q, k, v, segments, packed, impl="blocked"):
    params = {0: nsa.init_params(H, D, D)}
    params[0]["gate_w"] = 0.3 * jnp.asarray(np.random.default_rng(1).normal(size=(H, D, 3)))
    return head_groups.multihead_sparse_attention(
        q, k, v, [pattern], impl=impl, block_size=B, segments=segments, packed=packed,
        nsa_params=params,
    )  # fmt: skip


def _errors(pattern, qkv, impl="blocked", mutate=False):
    """Max |packed - alone| over outputs and q/k/v gradients, per sequence."""
    q, k, v, w = qkv
    seg, spans = _segments(ROWS)

    @functools.partial(jax.jit, static_argnames="packed")
    def run(segments, weights, q, k, v, packed):
        def loss(q, k, v):
            out = _attend(pattern, q, k, v, segments, packed, impl)
            return jnp.sum(out * weights), out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
        return out, grads

    got = run(jnp.asarray(seg), w, q, k, v, packed=not mutate)
    # Each sequence alone at position 0 of its own row of N tokens.
    alone_seg = np.zeros((len(spans), N), np.int32)
    gather = np.zeros((len(spans), N, 2), np.int32)
    for s, (r, t, length) in enumerate(spans):
        alone_seg[s, :length] = 1
        gather[s, :, 0] = r
        gather[s, :length, 1] = np.arange(t, t + length)
    take = lambda x: jnp.where(  # noqa: E731
        jnp.asarray(alone_seg != 0)[..., None, None], x[gather[..., 0], gather[..., 1]], 0
    ).astype(x.dtype)
    want = run(jnp.asarray(alone_seg), take(w), take(q), take(k), take(v), packed=False)
    errors = []
    for a, b in zip([got[0], *got[1]], [want[0], *want[1]], strict=True):
        for s, (r, t, length) in enumerate(spans):
            errors.append(float(jnp.max(jnp.abs(a[r, t : t + length] - b[s, :length]))))
    return max(errors)


@pytest.mark.parametrize(("text", "causal"), list(_cases()))
def test_every_packed_sequence_attends_as_it_does_alone(text, causal, qkv):
    with jax.enable_x64(True):
        (pattern,) = spec.parse_spec(text, B)[0]
        pattern = pattern.causal() if causal else pattern
        assert _errors(pattern, qkv) < TOL, text


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ROW_ANCHORED))
def test_counting_from_the_row_fails_the_comparison(name, qkv):
    """The mutation: the same rows on the unpacked path (blocks, global tokens, random
    blocks counted from the row's start) differ from each sequence alone."""
    with jax.enable_x64(True):
        text = f"{name}:{ARGS[name]}" if name in ARGS else name
        (pattern,) = spec.parse_spec(text, B)[0]
        for p in (pattern, pattern.causal()):
            assert _errors(p, qkv, mutate=True) > 1e-3, (name, p.is_causal)


def test_the_packed_reference_attends_as_alone(qkv):
    """``attention_impl=reference``: the dense mask of :func:`head_groups.pattern_mask`."""
    with jax.enable_x64(True):
        for text in ("bigbird:window=3,global=1,random=1", "fixed:stride=8"):
            (pattern,) = spec.parse_spec(text, B)[0]
            for p in (pattern, pattern.causal()):
                assert _errors(p, qkv, impl="reference") < TOL, (text, p.is_causal)


@pytest.mark.slow
@pytest.mark.parametrize("text", ["moba:block=16,k=2", "nsa:block=16,k=2,window=6",
                                  "bigbird:window=3,global=1,random=1"])  # fmt: skip
def test_the_gpu_kernels_attend_as_alone(text, qkv, monkeypatch):
    """``attention_impl=cudnn`` off a GPU: the Triton kernels in Pallas' interpreter (a
    static pattern's block-sparse group runs the blocked XLA kernel on packed rows), in
    float32, their tiles' dtype."""
    monkeypatch.setenv("FLAXFORMER_FUSED_ON_CPU", "1")
    with jax.enable_x64(True):
        (pattern,) = spec.parse_spec(text, B)[0]
        single = tuple(x.astype(jnp.float32) for x in qkv)
        for p in (pattern, pattern.causal()):
            assert _errors(p, single, impl="cudnn") < TOL32, (text, p.is_causal)


def test_aligned_layout_keeps_every_sequence_whole_and_apart():
    """Random rows (1..N sequences of random lengths, padding at the end): the
    guaranteed layout always fits; a sequence longer than the block starts on a block
    boundary and shares none of its blocks; a shorter one lies inside one block; the
    tokens go there and back unchanged; the tight layout fits where its blocks suffice."""
    rng = np.random.default_rng(0)
    rows = []
    for _ in range(200):
        cuts = np.sort(rng.choice(np.arange(1, N), size=rng.integers(0, N // 2), replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [rng.integers(max(cuts, default=1), N + 1)]]))
        rows.append(tuple(int(x) for x in lengths if x > 0))
    seg, _ = _segments(rows)
    seq = jax.jit(packing.sequences)(jnp.asarray(seg))
    layout_of = jax.jit(packing.aligned_layout, static_argnums=(1, 2))
    for block in (4, 8, 12):
        layout = layout_of(seq, block)
        assert bool(layout.fits)
        run, length = np.asarray(layout.run), np.asarray(layout.length)
        pos, long = np.asarray(layout.pos), np.asarray(layout.long)
        np.testing.assert_array_equal(long, (run > 0) & (length > block))
        slot = np.arange(run.shape[1])
        # A long sequence starts on a block boundary; a short one stays in one block.
        first_slot = slot - pos
        assert np.all(first_slot[long] % block == 0)
        short = (run > 0) & ~long
        assert np.all((first_slot // block == slot // block)[short])
        # A long sequence's blocks hold nothing else.
        blocks = run.reshape(len(rows), -1, block)
        owner = np.where(long.reshape(blocks.shape)[..., :1], blocks[..., :1], -1)
        assert np.all((blocks == owner) | (blocks == 0) | (owner == -1))
        x = jnp.asarray(rng.normal(size=(len(rows), N, 3)))
        back = packing.from_aligned(packing.to_aligned(x, layout, 1), layout, 1)
        np.testing.assert_array_equal(np.where(seg[..., None] > 0, x, 0), back)
        tight = layout_of(seq, block, packing.tight_blocks(N, block))
        need = [
            sum(-(-n // block) for n in lengths if n > block) for lengths in rows
        ]  # long ones alone: a lower bound of what the tight layout needs
        if max(need) > packing.tight_blocks(N, block):
            assert not bool(tight.fits)


def test_splash_refuses_packed_rows_it_would_count_from_the_row():
    from flaxformer_lite.config.experiment import ConfigError, ExperimentConfig

    with pytest.raises(ConfigError, match=r"splash.*bigbird.*attention_impl=blocked"):
        ExperimentConfig.from_config({
            "model": dict(attention_pattern="local:window=8;bigbird", attention_impl="splash",
                          attention_block_size=16, max_len=256),
            "data": dict(pack=True, max_length=256),
        })  # fmt: skip
    q = jnp.zeros((1, 128, 2, 8))
    (pattern,) = spec.parse_spec("fixed:stride=8", B)[0]
    with pytest.raises(ValueError, match="splash on packed rows"):
        head_groups.multihead_sparse_attention(
            q, q, q, [pattern], impl="splash", segments=jnp.ones((1, 128), jnp.int32),
            packed=True,
        )  # fmt: skip


def test_each_name_says_whether_packing_moves_it():
    """``Pattern.offset_invariant`` (whether the kernels may skip moving the sequences
    apart) is what the mutation above measures: false exactly for the names whose packed
    sequences differ when counted from the row's start."""
    for name in spec.pattern_names():
        text = f"{name}:{ARGS[name]}" if name in ARGS else name
        (pattern,) = spec.parse_spec(text, B)[0]
        assert pattern.offset_invariant == (name not in ROW_ANCHORED), name
        assert pattern.causal().offset_invariant == pattern.offset_invariant, name


def test_the_dense_weights_of_packed_rows_are_what_the_kernels_read(qkv):
    """``dense_scores`` (the sown weights' mask, pictures) on packed rows: dense attention
    under it equals the kernels' packed output, MoBA's routing and a static pattern."""
    q, k, v, _ = qkv
    seg = jnp.asarray(_segments(ROWS)[0])
    with jax.enable_x64(True):
        for text, causal in (("moba:k=2", True), ("bigbird:window=3,global=1,random=1", False)):
            (p,) = spec.parse_spec(text, B)[0]
            p = p.causal() if causal else p

            @jax.jit
            def both(q, k, v, seg, p=p):
                scores, mask = head_groups.dense_scores(q, k, [p], segments=seg, packed=True)
                weights = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
                dense = jnp.einsum("bhqk,bkhd->bqhd", jnp.nan_to_num(weights), v)
                return _attend(p, q, k, v, seg, packed=True), dense

            got, dense = both(q, k, v, seg)
            assert float(jnp.max(jnp.abs(got - dense))) < TOL, (text, causal)
