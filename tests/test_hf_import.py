"""Import from Hugging Face Marian (OPUS-MT's layout: EOS 0, unknown 1, pad last,
decoding from the pad row, a logits bias, two sentencepiece models over one shared
vocabulary): locally created models, nothing downloaded. transformers' own forward,
generate and MarianTokenizer are the references."""

import json
import random

import jax
import numpy as np
import pytest

from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.exchange import export, hf_import
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.model.transformer import Transformer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

GERMAN = ["das", "haus", "ist", "groß", "der", "hund", "und", "katze", "wasser", "baum"]
ENGLISH = ["the", "house", "is", "big", "dog", "and", "cat", "water", "tree", "a"]


def _spm(path, words, seed):
    import sentencepiece as spm

    rng = random.Random(seed)
    lines = [" ".join(rng.choice(words) for _ in range(6)) for _ in range(2000)]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(path), vocab_size=40,
        model_type="unigram", minloglevel=2, hard_vocab_limit=False,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_file=f"{path}.model")


def opus_like(folder, *, d_model=16, heads=2, ffn=24, layers=(2, 2), activation="swish", seed=0):
    """A random MarianMTModel numbered as OPUS-MT models are, with MarianTokenizer's
    files, saved by transformers into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    source = _spm(folder / "src", GERMAN, seed)
    target = _spm(folder / "tgt", ENGLISH, seed + 1)
    found = {sp.id_to_piece(i) for sp in (source, target) for i in range(sp.get_piece_size())}
    pieces = ["</s>", "<unk>", ">>de<<", *sorted(found - {"<unk>", "<s>", "</s>"}), "<pad>"]
    (folder / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}))
    pad = len(pieces) - 1
    config = transformers.MarianConfig(
        vocab_size=len(pieces), d_model=d_model, encoder_layers=layers[0],
        decoder_layers=layers[1], encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=ffn, decoder_ffn_dim=ffn, max_position_embeddings=64,
        activation_function=activation, pad_token_id=pad, eos_token_id=0,
        decoder_start_token_id=pad, forced_eos_token_id=0, scale_embedding=True,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    with torch.no_grad():  # every weight random, the bias too; the pad row stays zero
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
        model.model.shared.weight[pad].zero_()
        model.final_logits_bias.copy_(0.5 * torch.randn_like(model.final_logits_bias))
        model.final_logits_bias[0, pad] = -30.0  # OPUS-MT never emits pad (bad_words_ids)
        model.final_logits_bias[0, 0] += 1.0  # EOS a little likelier: short outputs
    model.save_pretrained(folder)
    tokenizer = transformers.MarianTokenizer(
        str(folder / "src.model"), str(folder / "tgt.model"), str(folder / "vocab.json")
    )
    tokenizer.save_pretrained(folder)
    # the reference is the model as saved (its position table is rebuilt on loading)
    return transformers.MarianMTModel.from_pretrained(folder).eval(), tokenizer


@pytest.fixture(scope="module")
def opus(tmp_path_factory):
    folder = tmp_path_factory.mktemp("opus") / "opus-mt-de-en"
    model, tokenizer = opus_like(folder)
    return folder, model, tokenizer


TEXTS = ["das haus ist groß", "der hund und die katze", "wasser", ">>de<< baum und haus ist"]


def test_the_pair_tokenizer_gives_marian_tokenizer_ids(opus, tmp_path):
    folder, _, theirs = opus
    imported = hf_import.read_marian(folder)
    ours = imported.tokenizer
    order = hf_import.vocab_order(json.loads((folder / "config.json").read_text()))
    for text in TEXTS:
        want = [int(np.flatnonzero(order == i)[0]) for i in theirs(text).input_ids]
        assert ours.encode(text).tolist() == want
        target = theirs(text_target=text.replace("haus", "house")).input_ids
        mapped = [int(np.flatnonzero(order == i)[0]) for i in target]
        assert ours.side(1).encode(text.replace("haus", "house")).tolist() == mapped
        assert ours.decode(mapped) == theirs.decode(target, skip_special_tokens=True)
    # stored in the workdir as one file, read back as the same tokenizer
    (tmp_path / "tokenizer.model").write_bytes(ours.to_bytes())
    back = Tokenizer.load(tmp_path / "tokenizer.model")
    assert back.encode(TEXTS[0]).tolist() == ours.encode(TEXTS[0]).tolist()
    assert back.to_bytes() == ours.to_bytes()


@pytest.mark.parametrize(
    "shape",
    [
        {"activation": "swish"},
        pytest.param(  # ~9 s: the slow tier
            {"d_model": 24, "heads": 4, "ffn": 40, "layers": (1, 3), "activation": "relu"},
            marks=pytest.mark.slow,
        ),
    ],
)
def test_an_opus_like_model_computes_their_logits_and_greedy_outputs_here(tmp_path, shape):
    theirs_model, theirs_tok = opus_like(tmp_path / "m", seed=3, **shape)
    imported = hf_import.read_marian(tmp_path / "m")
    c, tok = imported.config, imported.tokenizer
    assert c.logits_bias and c.bos_id == 0 and c.layer_norm_epsilon == export.MARIAN_EPSILON
    order = hf_import.vocab_order(json.loads((tmp_path / "m" / "config.json").read_text()))
    batch = theirs_tok(TEXTS, text_target=TEXTS[::-1], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = theirs_model(**batch).logits.numpy()
    ours_ids = np.argsort(order)  # their id -> ours
    inputs = np.where(batch.attention_mask.numpy() > 0, ours_ids[batch.input_ids.numpy()], 0)
    labels = batch.labels.numpy()
    targets = np.where(labels >= 0, ours_ids[np.maximum(labels, 0)], 0).astype(np.int32)
    ours = np.asarray(Transformer(c).apply({"params": imported.params}, inputs, targets))
    real = targets != 0
    # float32 round-off (the same sums in other orders): ~1e-6 seen, 1e-4 the margin
    np.testing.assert_allclose(ours[real][:, ours_ids], theirs[real], atol=1e-4, rtol=1e-4)
    # greedy: transformers' generate (pad banned, as OPUS-MT's generation config does)
    source = theirs_tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = theirs_model.generate(
            **source, num_beams=1, do_sample=False, max_new_tokens=20,
            bad_words_ids=[[len(order) - 1]], forced_eos_token_id=None,
        )  # fmt: skip
    want = theirs_tok.batch_decode(out, skip_special_tokens=True)
    params = jax.tree_util.tree_map(np.asarray, imported.params)
    translator = Translator(Transformer(c), params, tok, batch_size=8)
    got = translator.translate(TEXTS, beam_size=1, max_length=20)
    assert got == want
    assert sum(len(t) for t in want) > 20, want  # not all empty: the comparison says something


def test_refused_before_anything_is_written(tmp_path, opus):
    folder, _, _ = opus
    broken = tmp_path / "broken"
    broken.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"decoder_ffn_dim": 7}))
    with pytest.raises(export.ExportError, match="encoder_ffn_dim=24 but decoder_ffn_dim=7"):
        hf_import.read_marian(broken)
    with pytest.raises(export.ExportError, match="no config.json"):
        hf_import.read_marian(tmp_path / "nowhere")
    assert sorted(p.name for p in broken.iterdir()) == ["config.json"]


def test_a_model_folder_is_read_as_weights_only(tmp_path, opus):
    """A folder that asks for code of its own (auto_map) is refused unless trusted (its
    weights are then read, its code never run); an index naming a shard outside the
    folder is refused; a config.json of another shape is one line."""
    import shutil

    from flaxformer_lite.config import trust

    folder, _, _ = opus
    custom = shutil.copytree(folder, tmp_path / "custom")
    config = json.loads((custom / "config.json").read_text())
    auto = {"AutoModel": "modeling_mine.MineModel"}
    (custom / "config.json").write_text(json.dumps(config | {"auto_map": auto}))
    (custom / "modeling_mine.py").write_text("raise SystemExit('ran')\n")
    with pytest.raises(export.ExportError, match=r"asks for code of its own \(config.json"):
        hf_import.read_marian(custom)
    trust.trust_all()
    try:
        assert hf_import.read_marian(custom).tokenizer is not None  # weights, never code
    finally:
        trust.trust_all(False)
    escape = shutil.copytree(folder, tmp_path / "escape")
    (escape / "model.safetensors").rename(tmp_path / "outside.safetensors")
    index = {"weight_map": {"model.shared.weight": "../outside.safetensors"}}
    (escape / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(export.ExportError, match="names the shard '../outside.safetensors'"):
        hf_import.read_marian(escape)
    (escape / "config.json").write_text("[1, 2]")
    with pytest.raises(export.ExportError, match="config.json holds list, not an object"):
        hf_import.read_marian(escape)


@pytest.mark.slow  # ~35 s; the default run keeps the logits and greedy outputs' parity
def test_import_then_translate_evaluate_fine_tune_and_export_back(
    tmp_path, opus, fixture_data, one_device
):
    """``main import`` (train_and_evaluate(import_only=True)) on the fixture corpus: the
    run translates as transformers does, evaluates, fine-tunes from step 0 (with the
    folder it came from gone), and its export reads back as the same parameters and
    tokenizer."""
    import shutil

    from flaxformer_lite.inference.evaluation import evaluate_workdir
    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.training.startup import TrainingError
    from flaxformer_lite.training.train import train_and_evaluate
    from tests import fixtures

    folder, theirs_model, theirs_tok = opus
    config = fixtures.debug_config(fixture_data[1], num_steps=2, eval_bleu_sentences=4)
    config.data.aux_tag = ""  # the imported vocabulary has no <dict> piece
    workdir = tmp_path / "run"
    with pytest.raises(TrainingError, match="init_from"):
        train_and_evaluate(config, workdir, import_only=True)
    assert not workdir.exists()
    source_folder = shutil.copytree(folder, tmp_path / "opus")
    config.train.init_from = f"hf:{source_folder}"
    imported = train_and_evaluate(config, workdir, import_only=True)
    assert imported["step"] == 0 and imported["trained_steps"] == 0
    run = Run.open(workdir)
    assert run.model_config.bos_id == 0 and run.model_config.logits_bias
    source = theirs_tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = theirs_model.generate(
            **source, num_beams=1, do_sample=False, max_new_tokens=20,
            bad_words_ids=[[theirs_tok.pad_token_id]], forced_eos_token_id=None,
        )  # fmt: skip
    want = theirs_tok.batch_decode(out, skip_special_tokens=True)
    translator = Translator.from_workdir(workdir)
    assert translator.translate(TEXTS, beam_size=1, max_length=20) == want
    scores = evaluate_workdir(workdir, "test", limit=4, beam_size=1)
    assert 0 <= scores.bleu <= 100
    before, _ = run.params()
    shutil.rmtree(source_folder)  # a resume reads the run, not the folder
    tuned = train_and_evaluate(config, workdir)  # fine-tune: resumes from step 0
    assert tuned["step"] == 2 and tuned["trained_steps"] == 2
    after, _ = Run.open(workdir).params()
    moved = jax.tree_util.tree_map(lambda a, b: bool(np.any(a != b)), before, after)
    assert all(jax.tree_util.tree_leaves(moved))
    back = hf_import.read_marian(export.export_workdir(workdir, "hf", tmp_path / "hf"))
    jax.tree_util.tree_map(
        np.testing.assert_array_equal, back.params, jax.tree_util.tree_map(np.asarray, after)
    )
    assert back.tokenizer.to_bytes() == run.tokenizer.to_bytes()
