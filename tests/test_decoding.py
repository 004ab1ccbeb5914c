"""Decoding: cache == no cache, beam 1 == greedy, sampling, a learned copy task, BLEU."""

import collections
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import LanguageModel, ModelConfig, Transformer
from flaxformer_lite.inference import constraints, decoding
from flaxformer_lite.inference.evaluation import corpus_scores
from flaxformer_lite.model.partitioning import unbox
from tests.fixtures import OPTIMIZED, Compiles

CFG = ModelConfig(
    vocab_size=40,
    d_model=32,
    num_heads=4,
    d_ff=64,
    num_encoder_layers=2,
    num_decoder_layers=2,
    max_len=32,
    embedding_dropout=0.0,
    residual_dropout=0.0,
)
SRC = jnp.array([[5, 6, 7, 8, 1, 0], [9, 10, 1, 0, 0, 0], [11, 12, 13, 14, 15, 1]])


@pytest.fixture(scope="module")
def model_params():
    model = Transformer(CFG)
    params = unbox(model.init(jax.random.key(3), SRC, SRC))["params"]
    # Sharpen the output so that EOS and ties behave like a trained model's.
    params = jax.tree.map(lambda x: x * 1.5, params)
    return model, params


def test_cached_greedy_equals_uncached(model_params):
    model, params = model_params
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    cached = decoding.sample(model, params, SRC, **kw)
    uncached = decoding.greedy_uncached(model, params, SRC, **kw)
    np.testing.assert_array_equal(cached, uncached)


def test_cached_greedy_equals_uncached_with_a_lexical_shortcut():
    """The lexical shortcut's source keys are cached at the first step like the
    cross-attention's (its output layer starts at zero: made live here)."""
    model = Transformer(dataclasses.replace(CFG, lexical_shortcut=True))
    params = unbox(model.init(jax.random.key(3), SRC, SRC))["params"]
    noise = jax.random.normal(
        jax.random.key(4), params["decoder"]["lexical"]["out"]["kernel"].shape
    )
    params["decoder"]["lexical"]["out"]["kernel"] = noise
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    cached = decoding.sample(model, params, SRC, **kw)
    np.testing.assert_array_equal(cached, decoding.greedy_uncached(model, params, SRC, **kw))
    beams, _ = decoding.beam_search(model, params, SRC, beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(beams[:, 0], cached)


def test_beam_one_equals_greedy(model_params):
    model, params = model_params
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    greedy = decoding.sample(model, params, SRC, **kw)
    beams, _ = decoding.beam_search(model, params, SRC, beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(beams[:, 0], greedy)


WIDTH = 16  # every scored sequence fits: one compiled forward pass serves them all


@functools.partial(jax.jit, static_argnums=0)
def _label_log_probs(model, params, src, labels):
    """``log p(labels[t] | src, labels[:t])`` for each position t: ``[W]``."""
    logp = jax.nn.log_softmax(model.apply({"params": params}, src[None], labels[None]))
    return jnp.take_along_axis(logp[0], labels[:, None], -1)[:, 0]


@functools.partial(jax.jit, static_argnums=0)
def _next_token_probs(model, params, src, labels):
    """``p(. | src, labels[:t])`` for each position t: ``[W, V]``."""
    return jax.nn.softmax(model.apply({"params": params}, src[None], labels[None])[0])


def _length(seq, eos_id=1):
    """Tokens of a hypothesis: up to its EOS; one that did not end (a live beam that
    fills the k-best list of a row that stopped) runs up to its padding."""
    n = next((i + 1 for i, t in enumerate(seq) if t == eos_id), None)
    return n if n is not None else next((i for i, t in enumerate(seq) if t == 0), len(seq))


def _labels(seq, eos_id=1):
    """(``seq`` up to its EOS, zero-padded to WIDTH; its length). The decoder is causal,
    so the padding after position n changes nothing at positions before it."""
    n = _length(seq, eos_id)
    labels = np.zeros(WIDTH, np.int32)
    labels[:n] = seq[:n]
    return jnp.asarray(labels), n


def _score(model, params, src, seq, alpha, eos_id=1):
    """log p(seq | src) / length penalty, by a full forward pass."""
    labels, n = _labels(seq, eos_id)
    total = float(_label_log_probs(model, params, src, labels)[:n].sum())
    return total / ((5 + n) / 6) ** alpha


def test_beams_sorted_by_penalised_score_and_end_properly(model_params):
    model, params = model_params
    beams, scores = decoding.beam_search(
        model, params, SRC, beam_size=4, alpha=0.6, max_length=10, eos_id=1, bos_id=2
    )
    assert beams.shape == (3, 4, 10) and scores.shape == (3, 4)
    s = np.asarray(scores)
    assert (np.diff(s, axis=1) <= 1e-6).all(), "hypotheses sorted best first"
    for b in range(3):
        for k in range(4):
            seq = np.asarray(beams[b, k]).tolist()
            # Each ends in EOS, or is a live beam cut where its row stopped; padding after.
            n = _length(seq)
            assert 0 not in seq[:n] and 1 not in seq[: n - 1] and not any(seq[n:])
            assert _score(model, params, SRC[b], seq, 0.6) == pytest.approx(s[b, k], abs=1e-3)


@pytest.mark.slow
def test_beam_search_with_a_sliding_window_decoder():
    """A local causal pattern decodes from a ring buffer whose slot positions are
    shared by all beams; reordering beams must move the keys, not the positions."""
    cfg = dataclasses.replace(CFG, attention_pattern="local:window=3", attention_block_size=4)
    model = Transformer(cfg)
    params = jax.tree.map(
        lambda x: x * 1.5, unbox(model.init(jax.random.key(3), SRC, SRC))["params"]
    )
    kw = dict(max_length=10, eos_id=1, bos_id=2)
    greedy = decoding.sample(model, params, SRC, **kw)
    one, _ = decoding.beam_search(model, params, SRC, beam_size=1, alpha=0.0, **kw)
    np.testing.assert_array_equal(one[:, 0], greedy)
    beams, scores = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **kw)
    for b in range(3):
        for k in range(3):
            seq = np.asarray(beams[b, k]).tolist()
            assert _score(model, params, SRC[b], seq, 0.6) == pytest.approx(
                float(scores[b, k]), abs=1e-3
            )


def test_beam_search_beats_greedy_in_score(model_params):
    model, params = model_params
    kw = dict(max_length=10, eos_id=1, bos_id=2)
    greedy = np.asarray(decoding.sample(model, params, SRC, **kw))
    beams, scores = decoding.beam_search(model, params, SRC, beam_size=4, alpha=0.6, **kw)
    for b in range(3):
        assert float(scores[b, 0]) >= _score(model, params, SRC[b], greedy[b].tolist(), 0.6) - 1e-4


def _ngrams(seq, n):
    return [tuple(seq[i : i + n]) for i in range(len(seq) - n + 1)]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_repeated_ngram_mask_matches_brute_force(n):
    rng = np.random.default_rng(n)
    seqs = rng.integers(3, 7, (5, 3, 12))  # 4 symbols: repeats are common
    for length in range(13):
        mask = np.asarray(
            constraints.repeated_ngram_mask(jnp.asarray(seqs), jnp.int32(length), n, 9)
        )
        for row in np.ndindex(5, 3):
            prefix = seqs[row][:length].tolist()
            seen = set(_ngrams(prefix, n))
            want = [
                length >= n - 1 and tuple(prefix[length - n + 1 :] + [t]) in seen for t in range(9)
            ]
            assert mask[row].tolist() == want, (row, length)


def test_beam_search_without_repeated_ngrams(model_params):
    model, params = model_params
    kw = dict(max_length=16, eos_id=1, bos_id=2)
    plain, _ = decoding.beam_search(model, params, SRC, beam_size=4, alpha=0.6, **kw)
    plain_repeats = 0
    for n in (2, 3):
        beams, scores = decoding.beam_search(
            model, params, SRC, beam_size=4, alpha=0.6, no_repeat_ngram=n, **kw
        )
        for b in range(3):
            for k in range(4):
                seq = [t for t in np.asarray(beams[b, k]).tolist() if t not in (0,)]
                grams = _ngrams(seq, n)
                assert len(grams) == len(set(grams)), (n, seq)
        for b in range(3):
            seq = [t for t in np.asarray(plain[b, 0]).tolist() if t != 0]
            plain_repeats += len(_ngrams(seq, 2)) - len(set(_ngrams(seq, 2)))
    assert plain_repeats > 0  # the rule had something to forbid


def _ended_lengths(beams):
    """Tokens before EOS for every hypothesis (the whole row if it never ends)."""
    out = np.zeros(beams.shape[:2], int)
    for idx in np.ndindex(*beams.shape[:2]):
        seq = np.asarray(beams[idx]).tolist()
        out[idx] = seq.index(1) if 1 in seq else len(seq)
    return out


def test_beam_search_length_bounds(model_params):
    model, params = model_params
    kw = dict(beam_size=4, alpha=0.6, max_length=16, eos_id=1, bos_id=2)
    free, free_scores = decoding.beam_search(model, params, SRC, **kw)
    free_len = _ended_lengths(free)  # [16, x, x]: this random model's row 0 never ends
    # Bounds that cannot bind leave the search unchanged.
    same, same_scores = decoding.beam_search(
        model,
        params,
        SRC,
        min_lengths=jnp.zeros(3, jnp.int32),
        max_lengths=jnp.full(3, 40, jnp.int32),
        **kw,
    )
    np.testing.assert_array_equal(same, free)
    np.testing.assert_allclose(same_scores, free_scores)
    # Bounds that bind: every hypothesis of row b has between lo[b] and hi[b] tokens.
    lo = np.array([5, 0, 3])
    hi = np.array([7, 2, 6])
    assert (free_len[:, 0] > hi).any() or (free_len[:, 0] < lo).any(), "bounds must bind"
    beams, scores = decoding.beam_search(
        model, params, SRC, min_lengths=jnp.asarray(lo), max_lengths=jnp.asarray(hi), **kw
    )
    got = _ended_lengths(beams)
    assert (got >= lo[:, None]).all() and (got <= hi[:, None]).all(), (got, lo, hi)
    assert (np.asarray(beams)[np.arange(3)[:, None], np.arange(4), got] == 1).all(), "EOS ends each"
    assert (np.diff(np.asarray(scores), axis=1) <= 1e-6).all()
    for b in range(3):  # scores stay the model's own (a forced EOS is not free)
        seq = np.asarray(beams[b, 0]).tolist()
        assert _score(model, params, SRC[b], seq, 0.6) == pytest.approx(
            float(scores[b, 0]), abs=1e-3
        )


def _ensemble_score(model, members, src, seq, alpha, eos_id=1):
    """log of the members' mean probability of ``seq``, token by token, by full forward
    passes; divided by the length penalty."""
    labels, n = _labels(seq, eos_id)
    per_member = [_label_log_probs(model, p, src, labels)[:n] for p in members]
    mixed = jax.nn.logsumexp(jnp.stack(per_member), axis=0) - math.log(len(members))
    return float(mixed.sum()) / ((5 + n) / 6) ** alpha


def test_an_ensemble_of_copies_is_the_model(model_params):
    model, params = model_params
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    greedy = decoding.sample(model, params, SRC, **kw)
    beams, scores = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **kw)
    # A tuple of one goes through the same members loop as a bare model (decoding.py), so
    # two copies are the case to check: the mixture of equal models is the model.
    for members in [(params, params)]:
        np.testing.assert_array_equal(decoding.sample(model, members, SRC, **kw), greedy)
        e_beams, e_scores = decoding.beam_search(model, members, SRC, beam_size=3, alpha=0.6, **kw)
        np.testing.assert_array_equal(e_beams, beams)
        np.testing.assert_allclose(e_scores, scores, atol=1e-5)


@pytest.mark.slow
def test_ensemble_greedy_and_beam_follow_the_mean_probability(model_params):
    """Two different models: greedy takes the argmax of the mean next-token
    probability at every step (checked by full forward passes), and beam scores
    are the mixture's log-probability of each hypothesis."""
    model, params = model_params
    other = jax.tree.map(
        lambda x: x * 1.5, unbox(model.init(jax.random.key(7), SRC, SRC))["params"]
    )
    members = (params, other)
    kw = dict(max_length=10, eos_id=1, bos_id=2)
    out = np.asarray(decoding.sample(model, members, SRC, **kw))
    for b in range(SRC.shape[0]):
        # Teacher-forced on the output itself: the mean probabilities at position t
        # are those greedy saw when it chose token t.
        labels, n = _labels(out[b].tolist())
        probs = sum(np.asarray(_next_token_probs(model, p, SRC[b], labels)) for p in members)
        np.testing.assert_array_equal(probs[:n].argmax(-1), out[b][:n])
    # The members disagree, so the test above is not one model's greedy in disguise.
    singles = [np.asarray(decoding.sample(model, p, SRC, **kw)) for p in members]
    assert not (singles[0] == singles[1]).all()
    beams, scores = decoding.beam_search(model, members, SRC, beam_size=3, alpha=0.6, **kw)
    for b in range(SRC.shape[0]):
        for k in range(3):
            seq = np.asarray(beams[b, k]).tolist()
            expected = _ensemble_score(model, members, SRC[b], seq, 0.6)
            assert expected == pytest.approx(float(scores[b, k]), abs=1e-3)


def test_sampling_seeds_and_zero_temperature(model_params):
    model, params = model_params
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    greedy = decoding.sample(model, params, SRC, **kw)
    cold = decoding.sample(model, params, SRC, rng=jax.random.key(0), temperature=1e-4, **kw)
    np.testing.assert_array_equal(cold, greedy)
    a = decoding.sample(model, params, SRC, rng=jax.random.key(7), temperature=1.5, **kw)
    b = decoding.sample(model, params, SRC, rng=jax.random.key(7), temperature=1.5, **kw)
    c = decoding.sample(model, params, SRC, rng=jax.random.key(8), temperature=1.5, **kw)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_inverse_cdf_matches_float64_and_skips_impossible_tokens():
    # 300 tokens in blocks of 128 (the last block padded); every third logit filtered.
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(4, 300)) * 2
    logits[:, ::3] = constraints.NEG_INF
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1) / p.sum(axis=1, keepdims=True)
    u = rng.uniform(size=(200, 4))
    u[0], u[1] = 0.0, np.nextafter(np.float32(1), np.float32(0))  # both ends of [0, 1)
    got = np.stack([np.asarray(constraints.inverse_cdf(jnp.asarray(logits, jnp.float32),
                                                       jnp.asarray(x, jnp.float32)))
                    for x in u])  # fmt: skip
    want = np.stack([[np.searchsorted(cdf[r], x[r], side="right") for r in range(4)] for x in u])
    want = np.minimum(want, 299)
    # float32 sums of ~128 terms: a u within 1e-5 of a boundary may fall either side
    gap = np.abs(cdf[np.arange(4), np.maximum(want - 1, 0)] - u)
    near = np.minimum(gap, np.abs(cdf[np.arange(4), want] - u)) < 1e-5
    assert (got == want)[~near].all() and (~near).sum() > 700
    assert (got % 3 != 0).all() and (got < 300).all()  # never a filtered token or padding


def test_draw_frequencies():
    # 20,000 draws of [.5, .3, .15, .05, 0]: each frequency within 5 standard
    # deviations sqrt(p (1 - p) / n) <= 0.0036 of its probability (binomial spread).
    probs = np.array([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = jnp.log(jnp.asarray(np.maximum(probs, 1e-30), jnp.float32))
    logits = jnp.where(jnp.asarray(probs) > 0, logits, constraints.NEG_INF)
    keys = jax.random.split(jax.random.key(3), 20_000)
    tokens = np.asarray(jax.vmap(lambda k: constraints.draw(k, logits[None], block=2)[0])(keys))
    freq = np.bincount(tokens, minlength=5) / len(tokens)
    np.testing.assert_allclose(freq, probs, atol=5 * 0.0036)
    assert freq[4] == 0


def test_filter_logits_top_k_and_top_p():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    k2 = constraints.filter_logits(logits, top_k=2)
    assert (np.asarray(k2[0, 2:]) < -1e8).all() and np.isfinite(np.asarray(k2[0, :2])).all()
    p = constraints.filter_logits(logits, top_p=0.75)  # 0.5 + 0.3 reach 0.75
    assert (np.asarray(p[0, :2]) > -1e8).all() and (np.asarray(p[0, 2:]) < -1e8).all()


def test_language_model_prefix_is_forced():
    lm = LanguageModel(CFG)
    params = unbox(lm.init(jax.random.key(0), jnp.ones((1, 8), jnp.int32)))["params"]
    prefix = jnp.array([[7, 8, 9], [10, 0, 0]])
    out = decoding.sample(lm, params, None, prefix=prefix, max_length=8, eos_id=1, bos_id=2)
    assert out[0, :3].tolist() == [7, 8, 9] and int(out[1, 0]) == 10
    greedy = decoding.sample(lm, params, None, batch_size=2, max_length=8, eos_id=1, bos_id=2)
    assert greedy.shape == (2, 8)


@pytest.mark.slow
def test_tiny_model_learns_to_copy_and_decodes_it_perfectly():
    """Trains a small Transformer on copying token sequences, then decodes held-out ones.
    Slow tier (800 steps, ~30-50 s on 2 cores); the default run's cheap form of "decoding
    reads the model the way training does" is the score checks above: every beam's
    score is the full teacher-forced forward's, and greedy equals the uncached search."""
    c = ModelConfig(
        vocab_size=16,
        d_model=64,
        num_heads=4,
        d_ff=128,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_len=16,
        embedding_dropout=0.0,
        residual_dropout=0.0,
    )
    model = Transformer(c)
    rng = np.random.default_rng(0)

    def batch(n):
        src = np.zeros((n, 8), np.int32)
        for i in range(n):
            length = rng.integers(3, 7)
            src[i, :length] = rng.integers(3, 16, length)
            src[i, length] = 1
        return jnp.asarray(src)

    params = unbox(model.init(jax.random.key(0), batch(2), batch(2)))["params"]
    # Adam at a constant 3e-3 spikes now and then (loss 0.13 at step 800 after 0.0015 at
    # 700 on one CPU), so the rate warms up and decays: the last steps settle the copy.
    tx = optax.adam(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 50, 800, 3e-5))
    opt = tx.init(params)

    @functools.partial(jax.jit, compiler_options=OPTIMIZED)  # 800 steps: run time dominates
    def step(params, opt, src):
        def loss(p):
            logits = model.apply({"params": p}, src, src)
            nll = optax.softmax_cross_entropy_with_integer_labels(logits, src)
            return (nll * (src != 0)).sum() / (src != 0).sum()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    # 400 steps (loss < 0.05) left one token in 32 sentences wrong on some CPUs: train
    # until the copy is reliable (loss ~0.0014 at 800), so the test checks decoding.
    for _ in range(800):
        params, opt, value = step(params, opt, batch(64))
    assert float(value) < 0.01
    test = batch(32)
    for out in (
        decoding.sample(model, params, test, max_length=9, eos_id=1, bos_id=2),
        decoding.beam_search(
            model, params, test, beam_size=3, alpha=0.6, max_length=9, eos_id=1, bos_id=2
        )[0][:, 0],
    ):
        want = decoding.strip(test, 1)
        assert decoding.strip(out, 1) == want


def _reference_bleu(hyps, refs):
    """BLEU-4 by the definition (Papineni et al.), whitespace tokens, no smoothing."""
    matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for h, r in zip(hyps, refs, strict=True):
        h, r = h.split(), r.split()
        hyp_len, ref_len = hyp_len + len(h), ref_len + len(r)
        for n in range(1, 5):
            hc = collections.Counter(tuple(h[i : i + n]) for i in range(len(h) - n + 1))
            rc = collections.Counter(tuple(r[i : i + n]) for i in range(len(r) - n + 1))
            matches[n - 1] += sum(min(v, rc[g]) for g, v in hc.items())
            totals[n - 1] += max(len(h) - n + 1, 0)
    log_p = sum(math.log(m / t) for m, t in zip(matches, totals, strict=True)) / 4
    bp = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * bp * math.exp(log_p)


def test_bleu_matches_the_definition_and_has_a_signature():
    hyps = ["the cat sat on the mat today", "a quick brown dog jumps over the lazy fox"]
    refs = ["the cat sat on a mat today", "the quick brown fox jumps over the lazy dog"]
    s = corpus_scores(hyps, refs)
    assert s.bleu == pytest.approx(_reference_bleu(hyps, refs), abs=1e-6)
    assert "tok:13a" in s.bleu_signature and "version:" in s.bleu_signature
    assert corpus_scores(refs, refs).bleu == pytest.approx(100.0)
    assert 0 < s.chrf < 100
    with pytest.raises(ValueError, match="must pair up"):
        corpus_scores(hyps, refs[:1])


def test_length_penalty_formula():
    assert float(decoding.length_penalty(jnp.float32(7), 0.6)) == pytest.approx((12 / 6) ** 0.6)
    assert float(decoding.length_penalty(jnp.float32(7), 0.0)) == 1.0


def test_a_traced_limit_in_a_larger_cache_gives_the_searches_at_that_length(model_params):
    """One compiled search serves every limit of its bucket: the same ids (and beam
    scores) as a search compiled for exactly that length."""
    model, params = model_params
    for limit in (5, 9):
        exact = dict(max_length=limit, eos_id=1, bos_id=2)
        bucketed = dict(max_length=16, eos_id=1, bos_id=2, limit=jnp.int32(limit))
        greedy = decoding.sample(model, params, SRC, **exact)
        np.testing.assert_array_equal(
            decoding.sample(model, params, SRC, **bucketed)[:, :limit], greedy
        )
        ids, scores = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **exact)
        ids2, scores2 = decoding.beam_search(model, params, SRC, beam_size=3, alpha=0.6, **bucketed)
        np.testing.assert_array_equal(ids2[..., :limit], ids)
        assert not np.any(ids2[..., limit:])
        # the same sums over a longer, masked cache: float32 round-off
        np.testing.assert_allclose(scores2, scores, rtol=1e-5)
    with Compiles() as compiles:
        for limit in (10, 11, 13):  # one bucket: nothing new to compile
            decoding.beam_search(
                model, params, SRC, beam_size=3, alpha=0.6, max_length=16, eos_id=1, bos_id=2,
                limit=jnp.int32(limit),
            )  # fmt: skip
    assert not compiles.threads  # compiled for limit 9 already


@pytest.mark.parametrize("alpha", [0.6, pytest.param(2.0, marks=pytest.mark.slow)])
def test_early_beam_stops_never_beat_the_exact_bound(model_params, alpha):
    """``exact`` stops only when no live beam can win, so its best score is the
    search's; ``current`` and ``finished`` stop on the same path no later than it
    can improve, so their best is at most exact's (and a real hypothesis)."""
    model, params = model_params
    kw = dict(beam_size=4, alpha=alpha, max_length=20, eos_id=1, bos_id=2)
    _, exact = decoding.beam_search(model, params, SRC, stop="exact", **kw)
    for stop in ("current", "finished"):
        ids, scores = decoding.beam_search(model, params, SRC, stop=stop, **kw)
        assert np.all(np.asarray(scores[:, 0]) <= np.asarray(exact[:, 0]) + 1e-5)
        assert np.all(np.asarray(scores[:, 0]) > decoding.NEG_INF / 2)
    with pytest.raises(ValueError, match="stop='soon'"):
        decoding.beam_search(model, params, SRC, stop="soon", **kw)


def test_padding_rows_of_a_batch_end_at_once(model_params):
    """A padding row (a limit or maximum of 0) does not keep a batch's search
    stepping: its output is empty; a row's own limit cuts it alone."""
    model, params = model_params
    kw = dict(max_length=12, eos_id=1, bos_id=2)
    ids = decoding.sample(model, params, SRC, limit=jnp.array([12, 0, 3]), **kw)
    full = decoding.sample(model, params, SRC, **kw)
    assert not np.any(ids[1])
    np.testing.assert_array_equal(ids[0], full[0])
    np.testing.assert_array_equal(ids[2, :3], full[2, :3])
    assert not np.any(ids[2, 3:])
    beams, _ = decoding.beam_search(
        model, params, SRC, beam_size=2, alpha=0.6, max_lengths=jnp.array([12, 0, 12]), **kw
    )
    assert int(beams[1, 0, 0]) == 1 and not np.any(beams[1, 0, 1:])


def test_a_short_first_cache_changes_no_output(model_params):
    """A search that starts with a short cache and grows it for the rows that outlast
    it (in parts of the shrunk size, one after the other, the last part overlapping
    the one before: 10 rows in parts of 3) gives the ids of the search with the whole
    cache from the start, and its scores to float32 round-off."""
    model, params = model_params
    rng = np.random.default_rng(1)
    src = rng.integers(3, CFG.vocab_size, size=(10, 6)).astype(np.int32)
    src[:, -1] = 1
    kw = dict(max_length=16, eos_id=1, bos_id=2)
    bound = np.array([3, 14, 5, 14, 3, 14, 9, 14, 14, 4], np.int32)
    whole = decoding.sample(model, params, src, limit=bound, shrink=0, **kw)
    assert (np.asarray(whole)[:, 2:] != 0).any(axis=1).all()  # every row outlasts 2
    for shrink, first in ((0, 4), (4, 2)):
        grown = decoding.sample(
            model, params, src, limit=bound, shrink=shrink, first_length=first, **kw
        )
        np.testing.assert_array_equal(grown, whole)
    # Each row's beams run to its bound; the limit (12) stops the rows bound at 14
    # still searching, in more than one part (the overlap's rows must not step twice).
    beam = dict(beam_size=3, alpha=0.6, stop="current", max_lengths=bound, limit=12, **kw)
    least = jnp.asarray(bound - 1)
    ids, scores = decoding.beam_search(model, params, src, min_lengths=least, shrink=0, **beam)
    for shrink, first in ((4, 2),):
        grown_ids, grown_scores = decoding.beam_search(
            model, params, src, min_lengths=least, shrink=shrink, first_length=first, **beam
        )
        np.testing.assert_array_equal(grown_ids, ids)
        np.testing.assert_allclose(grown_scores, scores, rtol=1e-5)


def test_a_shrunk_batch_decodes_its_rows_as_the_whole_batch_and_alone(model_params):
    """Once few rows of a batch still search, they step on alone (their state and
    cache rows gathered): the same ids as the whole batch stepping (shrink=0), and as
    each sentence decoded by itself; scores to float32 round-off (the matmuls run
    at other batch sizes)."""
    model, params = model_params
    rng = np.random.default_rng(0)
    pool = rng.integers(3, CFG.vocab_size, size=(40, 6)).astype(np.int32)
    pool[:, -1] = 1
    kw = dict(max_length=16, eos_id=1, bos_id=2)
    # Two sentences whose greedy output runs past 8 tokens, ten cut within 3 tokens:
    # the batch shrinks to 3 rows.
    runs_on = np.asarray(decoding.sample(model, params, pool, **kw))[:, :8].all(axis=1)
    assert runs_on.sum() >= 2
    long_rows = np.flatnonzero(runs_on)[:2]
    src = np.concatenate([np.delete(pool, long_rows, axis=0)[:10], pool[long_rows]])
    bound = np.array([2, 3] * 5 + [14, 14], np.int32)
    greedy = {s: decoding.sample(model, params, src, limit=bound, shrink=s, **kw) for s in (0, 4)}
    np.testing.assert_array_equal(greedy[4], greedy[0])
    assert np.asarray(greedy[4][-2:, 8:]).any() and not np.asarray(greedy[4][:10, 3:]).any()
    beam = dict(beam_size=3, alpha=0.6, stop="current", **kw)
    least = jnp.asarray(np.where(bound > 3, 10, 0))  # the long rows' beams run on too
    out = {
        s: decoding.beam_search(
            model, params, src, max_lengths=bound, min_lengths=least, shrink=s, **beam
        )
        for s in (0, 4)
    }
    np.testing.assert_array_equal(out[4][0], out[0][0])
    np.testing.assert_allclose(out[4][1], out[0][1], rtol=1e-5)
    for r in (0, 11):
        alone, score = decoding.beam_search(
            model, params, src[r : r + 1], max_lengths=bound[r : r + 1],
            min_lengths=least[r : r + 1], **beam,
        )  # fmt: skip
        np.testing.assert_array_equal(alone[0], out[4][0][r])
        np.testing.assert_allclose(score[0], out[4][1][r], rtol=1e-5)
        one = decoding.sample(model, params, src[r : r + 1], limit=bound[r : r + 1], **kw)
        np.testing.assert_array_equal(one[0], greedy[4][r])


def test_block_top_k_is_lax_top_k():
    """The beam's top-k among the blocks with the largest maxima: the same values and
    indices as lax.top_k, ties (which go to the lower index) and a width that is not
    a multiple of the block included."""
    from flaxformer_lite.inference.stepping import block_top_k

    rng = np.random.default_rng(0)
    for width in (4 * 8000, 4 * 1000 + 7):
        x = rng.normal(size=(5, width)).astype(np.float32)
        x[1] = np.round(x[1])  # many ties
        x[2, :] = decoding.NEG_INF  # a row with only the forced end left
        x[2, 100] = -3.0
        x[3, -40:] = 9.0  # the best in the last (padded) block
        for k in (2, 8):
            want = jax.lax.top_k(x, k)
            got = block_top_k(jnp.asarray(x), k)
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])


def test_long_beams_score_as_the_full_pass(model_params):
    """Hypotheses of 20+ tokens (their caches reordered at every step, twice past a
    16-position bucket) score as the full forward pass scores them."""
    model, params = model_params
    ids, scores = decoding.beam_search(
        model, params, SRC, beam_size=3, alpha=0.6, max_length=32, eos_id=1, bos_id=2,
        min_lengths=jnp.full((3,), 20),
    )  # fmt: skip
    for b in range(3):
        for k in range(3):
            seq = np.asarray(ids[b, k]).tolist()
            n = _length(seq)
            assert n > 20
            labels = np.zeros(32, np.int32)
            labels[:n] = seq[:n]
            total = float(_label_log_probs(model, params, SRC[b], jnp.asarray(labels))[:n].sum())
            assert total / ((5 + n) / 6) ** 0.6 == pytest.approx(float(scores[b, k]), abs=1e-3)
