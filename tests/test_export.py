"""Export to Hugging Face Marian: transformers' own forward on the written folder gives
our logits; what cannot map is refused before anything is written."""

import dataclasses
import json

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.exchange import export, hf_import
from flaxformer_lite.inference import decoding
from flaxformer_lite.model.transformer import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _model(**overrides):
    config = ModelConfig(
        vocab_size=60, d_model=16, num_heads=2, d_ff=24, num_encoder_layers=2,
        num_decoder_layers=2, max_len=32, layer_norm_epsilon=export.MARIAN_EPSILON,
        **overrides,
    )  # fmt: skip
    model = Transformer(config)
    tokens = jnp.ones((1, 6), jnp.int32)
    params = model.init(jax.random.key(0), tokens, tokens)["params"]
    # Every parameter random (LayerNorms and biases start at 1 and 0): a wrong axis or
    # order anywhere shows.
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys, strict=True)]
    return config, model, jax.tree_util.tree_unflatten(tree, leaves)


def _batch():
    rng = np.random.default_rng(0)
    inputs = rng.integers(4, 60, (3, 9)).astype(np.int32)
    targets = rng.integers(4, 60, (3, 7)).astype(np.int32)
    inputs[0, 6:] = 0  # padded rows
    targets[1, 4:] = 0
    inputs[:, -1][inputs[:, -1] != 0] = 1
    return inputs, targets


def _theirs(folder, inputs, targets):
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    decoder_inputs = np.concatenate([np.full((len(targets), 1), 2), targets[:, :-1]], 1)
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor(inputs, dtype=torch.long),
            attention_mask=torch.tensor(inputs != 0, dtype=torch.long),
            decoder_input_ids=torch.tensor(decoder_inputs, dtype=torch.long),
        )
    return out.logits.numpy()


@pytest.mark.parametrize(
    "activation,ln_position", [("relu", "post"), ("gelu", "post"), ("silu", "pre"), ("relu", "pre")]
)
def test_transformers_computes_our_logits(tmp_path, activation, ln_position):
    """Marian for post-LN, Pegasus for pre-LN: transformers' forward is ours."""
    config, model, params = _model(activation=activation, ln_position=ln_position)
    folder = export.write_hf(params, config, None, tmp_path / "hf")
    inputs, targets = _batch()
    ours = np.asarray(model.apply({"params": params}, inputs, targets))
    theirs = _theirs(folder, inputs, targets)
    real = targets != 0  # padded target positions are masked differently, and unused
    # float32 round-off over 2+2 layers of width 16 (epsilon 1.2e-7 times sums of a few
    # dozen terms, logits of order 10): 1e-4 is two orders above what is seen (~2e-6).
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4, rtol=1e-4)
    assert np.abs(theirs[real]).max() > 1  # not trivially small


def test_what_cannot_map_is_refused_and_nothing_written(tmp_path):
    for field, value in (
        ("positional", "learned"),
        ("attention_pattern", "local:window=4"),
        ("activation", "tanh"),
    ):
        config, _, params = _model()
        bad = dataclasses.replace(config, **{field: value})
        with pytest.raises(export.ExportError, match=f"model.{field}="):
            export.write_hf(params, bad, None, tmp_path / "hf")
        assert not list(tmp_path.iterdir())


def test_main_export_of_a_trained_run_loads_with_transformers_alone(trained_run, tmp_path):
    """`main export` on the shared :debug run: AutoTokenizer gives our ids,
    AutoModelForSeq2SeqLM our logits on the run's own tokens, CTranslate2 our
    log-probabilities, and both translate as our greedy decoding does."""
    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.inference.translate import Translator

    workdir = trained_run[0]
    out = export.export_workdir(workdir, "hf", tmp_path / "hf")
    run = Run.open(workdir)
    params, _ = run.params()
    texts = ["Guten Morgen!", "Das Haus ist groß.", "Wie spät ist es?"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    for text in texts:
        assert tokenizer(text).input_ids == run.tokenizer.encode(text).tolist()
    inputs = np.zeros((3, 20), np.int32)
    for i, text in enumerate(texts):
        ids = run.tokenizer.encode(text)
        inputs[i, : len(ids)] = ids
    targets = inputs[::-1].copy()
    ours = np.asarray(run.model().apply({"params": params}, inputs, targets))
    theirs = _theirs(out, inputs, targets)
    real = targets != 0
    # The run trained with Marian's epsilon (1e-5): float32 round-off, ~3e-6 seen on
    # random models; 1e-4 is the margin. (With our default 1e-6, each LayerNorm's output
    # moves by ~(1e-5 - 1e-6) / (2 var) relative: ~1e-4 over 2+1 layers, logits of
    # order 10; experiments/export_parity measures that gap on a trained run.)
    np.testing.assert_allclose(theirs[real], ours[real], atol=1e-4)
    # greedy translations: ours, transformers' generate and CTranslate2's
    test = ["Das Haus ist groß.", "Der Hund schläft.", "Wo ist der Bahnhof?", "Guten Tag"]
    mine = Translator.from_workdir(workdir).translate(test, beam_size=1, max_length=16)
    # and the pieces: on some CPUs the 6 steps' model writes only pieces that decode
    # to '' (its first step's arg max is a near tie), which the strings would not show
    sources = np.zeros((len(test), 20), np.int32)
    for i, text in enumerate(test):
        ids = run.tokenizer.encode(text)
        sources[i, : len(ids)] = ids
    c = run.model().config
    greedy = decoding.sample(run.model(), params, jnp.asarray(sources), max_length=16,
                             eos_id=c.eos_id, bos_id=c.bos_id)  # fmt: skip
    my_ids = decoding.strip(greedy, c.eos_id)
    assert any(my_ids)  # something to compare
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    with torch.no_grad():
        generated = model.generate(
            **tokenizer(test, return_tensors="pt", padding=True), num_beams=1,
            do_sample=False, max_new_tokens=16,
        )  # fmt: skip
    assert tokenizer.batch_decode(generated, skip_special_tokens=True) == mine
    assert decoding.strip(generated[:, 1:].numpy(), c.eos_id) == my_ids
    ctranslate2 = pytest.importorskip("ctranslate2")
    ct2 = export.export_workdir(workdir, "ctranslate2", tmp_path / "ct2")
    translator = ctranslate2.Translator(str(ct2), device="cpu")
    log_probs = np.asarray(jax.nn.log_softmax(ours))
    sp = run.tokenizer.sp
    for i in range(len(texts)):
        ids = [int(x) for x in targets[i] if x]
        source = [sp.id_to_piece(int(x)) for x in inputs[i] if x]
        got = translator.score_batch([source], [[sp.id_to_piece(x) for x in ids]])[0]
        # the same round-off bound as above, on log-probabilities
        np.testing.assert_allclose(
            got.log_probs[: len(ids)], log_probs[i, np.arange(len(ids)), ids], atol=1e-4
        )
    results = translator.translate_batch(
        [sp.encode(t, out_type=str) + ["</s>"] for t in test], beam_size=1,
        max_decoding_length=16,
    )  # fmt: skip
    assert [sp.decode_pieces(r.hypotheses[0]) for r in results] == mine
    assert [[sp.piece_to_id(x) for x in r.hypotheses[0]] for r in results] == my_ids
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ct2", "hf"]


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """A 60-piece sentencepiece model (the tiny models' vocabulary)."""
    import random

    from flaxformer_lite.data.tokenizer import train_tokenizer

    rng = random.Random(0)
    words = ["haus", "baum", "wasser", "hund", "katze", "house", "tree", "water", "dog", "cat"]
    lines = [" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(5))]
    lines += [" ".join(rng.choice(words) + str(rng.randint(0, 99)) for _ in range(5))
              for _ in range(3000)]  # fmt: skip
    return train_tokenizer(iter(lines), tmp_path_factory.mktemp("spm") / "t.model", 60)


@pytest.mark.parametrize("ln_position", ["post", "pre"])
def test_ctranslate2_scores_our_log_probabilities(tmp_path, pieces, ln_position):
    """CTranslate2's converter on the export (Marian: its decoder starts from a zero
    vector; Pegasus: from pad's embedding; both folded into position 0): its own
    teacher-forced log-probabilities are ours."""
    ctranslate2 = pytest.importorskip("ctranslate2")
    config, model, params = _model(ln_position=ln_position)
    out = export.write_ctranslate2(params, config, pieces, tmp_path / "ct2")
    assert not [p for p in tmp_path.iterdir() if p.name != "ct2"]  # no leftovers
    translator = ctranslate2.Translator(str(out), device="cpu")
    inputs, targets = _batch()
    ours = np.asarray(jax.nn.log_softmax(model.apply({"params": params}, inputs, targets)))
    for i in range(len(inputs)):
        source = [pieces.sp.id_to_piece(int(x)) for x in inputs[i] if x]
        ids = [int(x) for x in targets[i] if x]
        got = translator.score_batch([source], [[pieces.sp.id_to_piece(x) for x in ids]])[0]
        want = ours[i, np.arange(len(ids)), ids]
        # float32 in both, summed in other orders: ~1.5e-6 seen; 1e-4 is the margin
        np.testing.assert_allclose(got.log_probs[: len(ids)], want, atol=1e-4)


@pytest.mark.parametrize("ln_position", ["post", "pre"])
def test_export_then_import_restores_every_parameter(tmp_path, ln_position):
    from safetensors.numpy import load_file

    config, _, params = _model(ln_position=ln_position)
    folder = export.write_hf(params, config, None, tmp_path / "hf")
    hf_config = json.loads((folder / "config.json").read_text())
    back = hf_import.params_from_hf(load_file(folder / "model.safetensors"), config)
    assert hf_import.model_config_from_hf(hf_config) == config
    want = jax.tree_util.tree_map(np.asarray, flax.linen.meta.unbox(params))
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(want)
    jax.tree_util.tree_map(np.testing.assert_array_equal, back, want)  # exact: a permutation


@pytest.mark.parametrize("activation", ["swish", "relu"])
def test_a_locally_created_marian_model_computes_the_same_logits_here(tmp_path, activation):
    """MarianConfig -> MarianMTModel with random weights (nothing downloaded) -> ours:
    our forward gives transformers' logits."""
    hf_config = transformers.MarianConfig(
        vocab_size=60, d_model=16, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=24,
        decoder_ffn_dim=24, max_position_embeddings=32, activation_function=activation,
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=2, scale_embedding=True,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs_model = transformers.MarianMTModel(hf_config).eval()
    with torch.no_grad():  # LayerNorms and biases away from 1 and 0 too
        for p in theirs_model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        theirs_model.final_logits_bias.zero_()
    theirs_model.save_pretrained(tmp_path / "marian")
    written = json.loads((tmp_path / "marian" / "config.json").read_text())
    config = hf_import.model_config_from_hf(written)
    state = {k: v.numpy() for k, v in theirs_model.state_dict().items()}
    params = hf_import.params_from_hf(state, config)
    inputs, targets = _batch()
    ours = np.asarray(Transformer(config).apply({"params": params}, inputs, targets))
    theirs = _theirs(tmp_path / "marian", inputs, targets)
    real = targets != 0
    # float32 round-off, as in the export direction (~3e-6 seen there)
    np.testing.assert_allclose(ours[real], theirs[real], atol=1e-4, rtol=1e-4)
