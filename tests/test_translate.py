"""The Translator API and the translate/evaluate commands on a tiny trained workdir."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.inference import batching, decoding
from flaxformer_lite.inference import translate as translate_module
from flaxformer_lite.inference.evaluation import evaluate_workdir
from flaxformer_lite.inference.translate import TranslateError, Translator
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir.folder import write_config
from tests.fixtures import Compiles, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(trained_run):
    """The session's trained run (conftest.py): max_len 32, best checkpoint by BLEU."""
    return trained_run


def test_translate_returns_strings_in_order(run):
    workdir, _ = run
    t = Translator.from_workdir(workdir)
    assert t.checkpoint.startswith("best checkpoint")
    sentences = ["This is sentence number 3.", "", "   ", "This is sentence number 4."]
    with pytest.warns(UserWarning, match="2 of 4 sentences are empty or blank .*sentence 1"):
        out = t.translate(sentences)
    assert len(out) == 4 and all(isinstance(s, str) for s in out)
    assert out[1] == "" and out[2] == ""
    assert t.translate(["This is sentence number 3."], beam_size=1) == t.translate(
        ["This is sentence number 3."], beam_size=1
    )


RULES = dict(no_repeat_ngram=2, min_length_ratio=0.5, max_length_ratio=1.5)


@pytest.mark.parametrize(("beam", "rules"), [(1, {}), (3, RULES)])
def test_continuous_batching_translates_as_batches_do(run, beam, rules):
    """Greedy and beam search by continuous batching (the default) give each sentence
    what the batch by batch search gives: two source widths, several batches each (a
    beam sentence keeps its batch's limit; here with length ratios and no repeated
    2-grams), 1 and 2 streams (beams: 2, the queues the greedy case checks).
    The run's model with random weights (the trained 6 steps end some machines'
    outputs at once, whose float rounding breaks the EOS tie another way) gives each
    sentence its own output: a sentence given another's slot shows."""
    workdir, _ = run
    t = Translator.from_workdir(workdir)
    dummy = jnp.ones((1, 8), jnp.int32)
    params = unbox(t.model.init(jax.random.key(1), dummy, dummy))["params"]
    t.params = jax.tree.map(lambda x: x * 3.0, params)  # sharper: outputs that differ
    words = "the of sentence number this is a".split()
    sentences = [" ".join(words[(i + j) % 7] for j in range(1 + i)) for i in range(20)]
    sentences += [f"This is sentence number {i}." for i in range(5)]
    t.decode = t.decode.replace(batch_tokens=64, streams=1, continuous=False, max_extra=2)
    want = t.translate(sentences, beam_size=beam, **rules)
    assert len(set(want)) > 10
    for streams in (1, 2) if beam == 1 else (2,):
        t.decode = t.decode.replace(streams=streams, continuous=True)
        assert t.translate(sentences, beam_size=beam, **rules) == want


def test_bad_input_messages(run, monkeypatch):
    workdir, _ = run
    t = Translator.from_workdir(workdir)
    # Decoding options are the decode section's fields, checked as the config is.
    with pytest.raises(ConfigError, match="decode.beam_size=0 must be > 0"):
        t.translate(["a b c"], beam_size=0)
    with pytest.raises(ConfigError, match="decode.alpha=-1 must be >= 0"):
        t.translate(["a b c"], alpha=-1)
    with pytest.raises(ConfigError, match="decode.no_repeat_ngram=-2 must be >= 0"):
        t.translate(["a b c"], no_repeat_ngram=-2)
    with pytest.raises(ConfigError, match="decode.min_length_ratio=-0.5 must be >= 0"):
        t.translate(["a b c"], min_length_ratio=-0.5)
    with pytest.raises(ConfigError, match="min_length_ratio=2 exceeds max_length_ratio=1"):
        t.translate(["a b c"], min_length_ratio=2, max_length_ratio=1)
    # Length bounds tied to the source: the search gets floor(0.5 n) and ceil(1.5 n) + 5
    # for a source of n pieces (their effect on the search: tests/test_decoding.py), by
    # continuous batching (the default) and batch by batch.
    n = len(t.tokenizer.encode("a b c d e")) - 1
    for module, name, continuous in ((translate_module, "beam_continuous", True),
                                     (decoding, "beam_search", False)):  # fmt: skip
        seen, real = {}, getattr(module, name)

        def spy(*args, real=real, seen=seen, **kwargs):
            seen.update(kwargs)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
        t.decode = t.decode.replace(continuous=continuous)
        out = t.translate(["a b c d e"], beam_size=2, min_length_ratio=0.5, max_length_ratio=1.5)
        assert isinstance(out[0], str)
        assert int(seen["min_lengths"][0]) == n // 2
        assert int(seen["max_lengths"][0]) == -(-3 * n // 2) + 5
        monkeypatch.undo()
    # Greedy under the no-repeat rule runs as a beam of one.
    assert t.translate(["a b c"], beam_size=1, no_repeat_ngram=2)[0] is not None
    with pytest.raises(TranslateError, match="a list of sentences, not one string"):
        t.translate("a b c")
    with pytest.raises(TranslateError, match="sentence 1 is not a string"):
        t.translate(["a", 3])
    long = "This is sentence number 123456789. " * 20
    with pytest.warns(UserWarning, match="1 of 1 sentences have more than model.max_len=32"):
        assert isinstance(t.translate([long], beam_size=1)[0], str)
    strict = Translator.from_workdir(workdir, too_long="refuse")
    with pytest.raises(TranslateError, match="more than model.max_len=32"):
        strict.translate([long])
    # Characters outside the vocabulary map to <unk>, never a crash.
    assert isinstance(t.translate(["日本語 ✓ ∑"], beam_size=1)[0], str)


def test_workdir_without_checkpoints(tmp_path):
    with pytest.raises(ckpt_lib.CheckpointError, match="not a training run"):
        Translator.from_workdir(tmp_path)
    write_config(tmp_path, '{"model": {}, "data": {}}')
    with pytest.raises(ckpt_lib.CheckpointError, match="holds no checkpoint yet"):
        Translator.from_workdir(tmp_path)


def _kept_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_ensemble_members(run, monkeypatch):
    workdir, _ = run
    single = Translator.from_workdir(workdir)
    sentences = ["This is sentence number 3.", "This is sentence number 12."]
    # The same checkpoint twice: the mean probability is the model's own.
    twice = Translator.from_workdir(workdir, ensemble=[str(workdir)])
    assert isinstance(twice.params, tuple) and len(twice.params) == 2
    assert "ensemble of 2" in twice.checkpoint and "(best, step" in twice.checkpoint
    assert twice.translate(sentences, beam_size=2) == single.translate(sentences, beam_size=2)
    step = _kept_steps(workdir)[0]
    three = Translator.from_workdir(workdir, ensemble=[f"@{step}", f"{workdir}@{step}"])
    assert f"{workdir}@{step}" in three.checkpoint
    seen = []
    real = translate_module.beam_continuous  # beams by continuous batching (the default)

    def spy(model, params, *args, **kw):
        seen.append(params)
        return real(model, params, *args, **kw)

    monkeypatch.setattr(translate_module, "beam_continuous", spy)
    out = three.translate(sentences, beam_size=2)
    assert len(out) == 2 and all(isinstance(s, str) for s in out)
    assert len(seen[0]) == 3


def test_ensemble_member_errors(run, tmp_path):
    workdir, _ = run
    with pytest.raises(ckpt_lib.CheckpointError, match=r"no checkpoint of step 999 .* kept are"):
        Translator.from_workdir(workdir, ensemble=["@999"])
    with pytest.raises(ckpt_lib.CheckpointError, match=r"member '.*nowhere'.* not a training run"):
        Translator.from_workdir(workdir, ensemble=[str(tmp_path / "nowhere")])
    other = tmp_path / "other"
    shutil.copytree(workdir, other)
    with open(other / "tokenizer.model", "ab") as f:
        f.write(b"x")
    with pytest.raises(ckpt_lib.CheckpointError, match="has another tokenizer"):
        Translator.from_workdir(workdir, ensemble=[str(other)])
    shutil.copy(workdir / "tokenizer.model", other / "tokenizer.model")
    values = json.loads((other / ckpt_lib.CONFIG_FILE).read_text())
    values["model"]["residual_dropout"] = 0.3  # training-only: still a valid member
    (other / ckpt_lib.CONFIG_FILE).write_text(json.dumps(values))
    assert len(Translator.from_workdir(workdir, ensemble=[str(other)]).params) == 2
    values["model"]["d_ff"] = values["model"]["d_ff"] * 2
    (other / ckpt_lib.CONFIG_FILE).write_text(json.dumps(values))
    with pytest.raises(ckpt_lib.CheckpointError, match="has another model config"):
        Translator.from_workdir(workdir, ensemble=[str(other)])


def test_evaluate_writes_scores_and_translations(run, tmp_path):
    workdir = tmp_path / "run"  # evaluate writes into the run: a copy of the shared one
    shutil.copytree(run[0], workdir)
    scores = evaluate_workdir(workdir, "test", beam_size=2, limit=10)
    assert scores.num_sentences == 10 and "tok:13a" in scores.bleu_signature
    rows = (workdir / "test_translations.tsv").read_text().splitlines()
    assert rows[0] == "source\treference\thypothesis" and len(rows) == 11
    hypotheses = [row.split("\t")[2] for row in rows[1:]]
    saved = json.loads((workdir / "test_scores.json").read_text())
    assert saved["bleu"] == scores.bleu and saved["num_sentences"] == 10
    # Options given are used; the others come from the run's decode section.
    assert (saved["beam_size"], saved["alpha"], saved["no_repeat_ngram"]) == (2, 0.6, 0)
    assert saved["checkpoint"].startswith("best checkpoint")
    # The scores are those of the written translations.
    sources = [row.split("\t")[0] for row in rows[1:]]
    assert Translator.from_workdir(workdir).translate(sources, beam_size=2) == hypotheses
    with pytest.raises(ConfigError, match="config.decode.alpha=-1.0 must be >= 0"):
        evaluate_workdir(workdir, "test", alpha=-1.0, limit=2)


@pytest.mark.slow
def test_translate_cli(run, tmp_path):
    workdir, raw = tmp_path / "run", run[1]  # average writes into the run: a copy
    shutil.copytree(run[0], workdir)
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    cmd = [
        sys.executable,
        "-m",
        "flaxformer_lite.main",
        "translate",
        f"--workdir={workdir}",
        "--beam_size=2",
    ]

    def cli(args, stdin=None):
        return subprocess.run(
            args, input=stdin, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )

    average = cli([*cmd[:3], "average", f"--workdir={workdir}", "--num=2"])
    assert average.returncode == 0 and "averaged" in average.stdout, average.stderr[-2000:]
    out = cli(cmd + ["This is sentence number 1.", "This is sentence number 2."])
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.splitlines()) == 2
    piped = cli(cmd, stdin="This is sentence number 9.\n")
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 1
    ensemble = cli(cmd + [f"--ensemble=@{_kept_steps(workdir)[-1]}", "This is sentence number 9."])
    assert ensemble.returncode == 0, ensemble.stderr[-2000:]
    assert len(ensemble.stdout.splitlines()) == 1
    missing = cli(cmd + ["--ensemble=@999", "x"])
    assert missing.returncode == 1 and "no checkpoint of step 999" in missing.stderr
    assert "Traceback" not in missing.stderr
    bad = cli(cmd[:-1] + ["--beam_size=0", "x"])
    assert bad.returncode == 1 and "beam_size=0" in bad.stderr and "Traceback" not in bad.stderr


def test_translate_streams_one_line_out_per_line_in(run):
    """10,000 lines through standard input, with empty and blank lines, a line too long
    for the model, invalid UTF-8, control characters and line separators inside lines,
    a CRLF ending and no final newline: 10,000 lines out, in order, the first chunk
    written while the input is still open, and one warning that counts each kind."""
    import queue
    import threading

    from flaxformer_lite.inference.streaming import CHUNK

    workdir, raw = run
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    cmd = [sys.executable, "-m", "flaxformer_lite.main", "translate", f"--workdir={workdir}"]
    proc = subprocess.Popen(
        cmd + ["--beam_size=1"],
        cwd=ROOT,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    lines = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stdout], daemon=True).start()
    numbered = [f"This is sentence number {i % 50}.".encode() for i in range(10_000)]
    special = {
        CHUNK + 1: b"",
        CHUNK + 2: b"   \t ",
        CHUNK + 3: " ".join(["Haus"] * 100).encode(),
        CHUNK + 4: b"Komm \xff\xfe her!",
        CHUNK + 5: "Komm\x0cher\u2028jetzt\x1b[31m sofort\x85!".encode(),
        CHUNK + 6: b"Wo ist der Bahnhof?\r",
    }
    source = [special.get(i, s) for i, s in enumerate(numbered)]
    proc.stdin.write(b"\n".join(source[:CHUNK]) + b"\n")
    proc.stdin.flush()
    first = [lines.get(timeout=300) for _ in range(CHUNK)]  # before the input ends
    proc.stdin.write(b"\n".join(source[CHUNK:]))  # no newline after the last line
    proc.stdin.close()
    proc.wait(timeout=600)
    err = proc.stderr.read().decode()
    assert proc.returncode == 0, err[-3000:]
    out = first + [lines.get(timeout=10) for _ in range(lines.qsize())]
    assert len(out) == 10_000 and all(x.endswith(b"\n") for x in out)
    out = [x.decode()[:-1] for x in out]
    assert out[CHUNK + 1] == out[CHUNK + 2] == ""
    translator = Translator.from_workdir(workdir)
    for part in (slice(0, 64), slice(CHUNK, CHUNK + 64), slice(-64, None)):
        expected = translator.translate(
            [s.decode("utf-8", "replace") for s in source[part]], beam_size=1
        )
        assert out[part] == expected
    assert err.strip().splitlines() == [
        "warning: of 10000 lines, 2 empty or blank (empty lines out); 1 longer than "
        "model.max_len=32 pieces (translated from their first 31); 1 not valid UTF-8 (bad "
        f"bytes replaced by U+FFFD; the first: line {CHUNK + 5})"
    ]


def test_batches_by_tokens_cover_every_sentence_in_few_shapes(run):
    """Sorted by length, each batch as many sentences as its width's token budget
    holds: every sentence once, no batch over budget, one shape per width; and the
    outputs do not depend on how the sentences were batched, nor on how many batches
    run at once."""
    import numpy as np

    workdir, _ = run
    t = Translator.from_workdir(workdir)
    rng = np.random.default_rng(0)
    encoded = [np.ones(int(n), np.int32) for n in rng.integers(2, 32, 300)]
    batches = list(batching.batches(encoded, t.config.max_len, 256))
    seen = sorted(i for idx, _, _ in batches for i in idx)
    assert seen == list(range(300))
    shapes = {}
    for idx, rows, longest in batches:
        assert len(idx) <= rows.shape[0] and rows.shape[0] * rows.shape[1] <= 256
        assert longest == max(len(encoded[i]) for i in idx) <= rows.shape[1]
        shapes.setdefault(rows.shape[1], set()).add(rows.shape)
    assert all(len(s) == 1 for s in shapes.values())
    texts = [f"This is sentence number {i}." * (1 + i % 3) for i in range(12)]
    by_tokens = t.translate(texts, beam_size=2)
    small = Translator.from_workdir(workdir, batch_size=5)  # 3 batches, 2 at once on CPU
    assert small.translate(texts, beam_size=2) == by_tokens
    small.decode = small.decode.replace(streams=1)
    assert small.translate(texts, beam_size=2) == by_tokens
    with Compiles() as compiles:
        t.translate(texts[::-1], beam_size=2)  # the same widths and buckets: no compile
    assert not compiles.threads, compiles.threads
