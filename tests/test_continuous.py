"""Continuous batching (inference/continuous.py): each sentence's greedy output and
beams equal the batched search's, whatever the slots and the sentences beside it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import LanguageModel, Transformer
from flaxformer_lite.inference import decoding
from flaxformer_lite.inference.continuous import beam_continuous, greedy_continuous
from flaxformer_lite.model.partitioning import unbox
from tests.test_decoding import CFG

KW = dict(max_length=12, eos_id=3, bos_id=2)  # 3: the sharpened model ends some rows


@pytest.fixture(scope="module")
def queue():
    """9 sources of 6 pieces (some padded), a rotary model (positions per row matter),
    sharpened like the decoding tests' so that EOS ends rows at different steps."""
    model = Transformer(dataclasses.replace(CFG, positional="rotary"))
    src = np.array(jax.random.randint(jax.random.key(0), (9, 6), 3, CFG.vocab_size))
    src[:, -1] = 1  # EOS
    src[[1, 4, 7], 2:] = [1, 0, 0, 0]
    src = jnp.asarray(src)
    params = unbox(model.init(jax.random.key(3), src, src))["params"]
    return model, jax.tree.map(lambda x: x * 1.5, params), src


@pytest.mark.parametrize("slots", [1, 3, 9])
def test_continuous_greedy_equals_batched(queue, slots):
    model, params, src = queue
    limits = jnp.array([12, 5, 0, 12, 3, 12, 8, 12, 1])  # a limit of 0 writes nothing
    want = decoding.sample(model, params, src, limit=limits, shrink=0, **KW)
    got, rows = greedy_continuous(
        model, params, src, slots=slots, limit=limits, count_rows=True, **KW
    )
    np.testing.assert_array_equal(got, want)
    # every sentence's steps (to its EOS or limit; one for a limit of 0), no more
    eos = np.asarray(want) == KW["eos_id"]
    assert eos.any(axis=1).sum() >= 2  # rows that end by EOS, others by their limits
    needed = np.where(eos.any(axis=1), np.argmax(eos, axis=1) + 1, np.asarray(limits))
    assert int(rows) == int(np.maximum(needed, 1).sum())


@pytest.mark.parametrize(
    ("slots", "stop", "first", "rules"),
    # 4 slots of 9 sentences: refills and the smaller last stage; 5 positions first:
    # the sentences that outgrow them searched again; each sentence its own length
    # bounds, no repeated 2-grams. The others ~4 s each.
    [pytest.param(1, "exact", 0, False, marks=pytest.mark.slow), (4, "current", 5, True),
     pytest.param(4, "current", 5, False, marks=pytest.mark.slow),
     pytest.param(9, "finished", 0, False, marks=pytest.mark.slow)],
)  # fmt: skip
def test_continuous_beams_equal_the_batched_search(queue, slots, stop, first, rules):
    """Each sentence's k hypotheses and scores are beam_search's for a batch with that
    sentence's limit (and bounds)."""
    model, params, src = queue
    limits = np.array([12, 5, 12, 12, 3, 12, 8, 12, 1])
    kw = dict(beam_size=3, alpha=0.6, stop=stop, **KW)
    if rules:
        kw |= dict(no_repeat_ngram=2, min_lengths=jnp.array([4, 2, 0, 6, 0, 3, 0, 1, 0]),
                   max_lengths=jnp.array([9, 4, 11, 12, 2, 7, 5, 10, 0]))  # fmt: skip
    ids, scores, rows = beam_continuous(
        model, params, src, slots=slots, limit=jnp.asarray(limits), count=7, count_rows=True,
        first_length=first, **kw,
    )  # fmt: skip
    ids, scores = np.asarray(ids), np.asarray(scores)
    if rules:  # the rules hold: no 2-gram twice, EOS within each sentence's bounds
        eos = ids[:7] == KW["eos_id"]
        ends = np.where(eos.any(axis=2), np.argmax(eos, axis=2), 12)
        assert np.all(ends >= np.asarray(kw["min_lengths"])[:7, None])
        assert np.all(ends <= np.asarray(kw["max_lengths"])[:7, None])
        for seq, end in zip(ids[:7].reshape(-1, 12), ends.reshape(-1), strict=True):
            pairs = list(zip(seq[:end], seq[1:end], strict=False))
            assert len(set(pairs)) == len(pairs)
    for limit in set(limits[:7]):
        want_ids, want_scores = decoding.beam_search(
            model, params, src, limit=jnp.int32(limit), shrink=0, **kw
        )
        mine = limits[:7] == limit
        np.testing.assert_array_equal(ids[:7][mine], np.asarray(want_ids)[:7][mine])
        # float32 sums over batches of other shapes round otherwise: a few ulps (1.2e-7)
        # a step, 12 steps (seen: 1.3e-6)
        np.testing.assert_allclose(scores[:7][mine], np.asarray(want_scores)[:7][mine], 1e-5)
    assert not ids[7:].any()  # beyond count: never decoded
    assert (ids[:7, :, 0] == KW["eos_id"]).sum() < 7 * 3  # real searches, not all-EOS
    # no step runs a sentence past its limit (nor, searched again, past twice it)
    assert 3 <= int(rows) <= 3 * limits[:7].sum() * (2 if first else 1)
    if first:  # some sentence outgrew the first 5 positions and was searched again
        long = (ids[:7, 0] != 0).sum(axis=1) > first
        assert long.any() and int(rows) > 3 * first * long.sum()


def test_continuous_count_leaves_the_padding_rows(queue):
    model, params, src = queue
    want = decoding.sample(model, params, src[:6], shrink=0, **KW)
    got, rows = greedy_continuous(model, params, src, slots=4, count=6, count_rows=True, **KW)
    np.testing.assert_array_equal(got[:6], want)
    assert not np.asarray(got[6:]).any()
    eos = np.asarray(want) == KW["eos_id"]
    assert int(rows) == int(np.where(eos.any(1), np.argmax(eos, 1) + 1, 12).sum())


def test_continuous_refuses_sparse_and_a_step_of_many_positions(queue):
    model, params, src = queue
    sparse = Transformer(dataclasses.replace(CFG, attention_pattern="local:window=4"))
    with pytest.raises(ValueError, match="dense self-attention"):
        greedy_continuous(sparse, params, src, slots=2, **KW)
    lm = LanguageModel(dataclasses.replace(CFG, num_encoder_layers=0))
    lm_params = unbox(lm.init(jax.random.key(0), src))["params"]
    _, cache = lm.apply({"params": lm_params}, src, decode=True, mutable=["cache"])
    per_row = jax.tree_util.tree_map_with_path(
        lambda p, x: jnp.zeros((9,), jnp.int32) if "index" in jax.tree_util.keystr(p) else x,
        cache["cache"],
    )
    with pytest.raises(ValueError, match="one step at a time"):
        lm.apply({"params": lm_params, "cache": per_row}, src[:, :2], decode=True,
                 mutable=["cache"])  # fmt: skip
