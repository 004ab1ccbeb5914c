"""Translator.generate and the generate command on a tiny language-model run."""

import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite.inference.translate import TranslateError, Translator
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.training.train import train_and_evaluate
from tests.fixtures import load_config, train_on_one_device, xla_flags

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, fixture_data):
    raw, data_dir = fixture_data
    config = load_config("lm_small", "debug")
    config.model.vocab_size = 80  # the fixture's English supports ~93 pieces
    config.model.max_len = 32
    config.data.dataset = "ding_de_en"  # the fixture Bible is too small for a tokenizer
    config.data.data_dir = str(data_dir)
    workdir = tmp_path_factory.mktemp("lm")
    with pytest.MonkeyPatch.context() as m:
        train_on_one_device(m)  # not about devices: on 8 it costs twice the CPU
        train_and_evaluate(config, workdir)
    return workdir, raw


def _greedy_by_full_forward(gen: Translator, prompt: list[int], new: int) -> list[int]:
    """Greedy continuation recomputing the whole sequence each step (no cache)."""
    model, params, c = gen.model, gen.params, gen.config
    seq = list(prompt)
    for _ in range(new):
        # The model shifts its input right behind BOS: logits at position t predict
        # token t, so an EOS placeholder at the end reads out the next token.
        logits = model.apply({"params": params}, jnp.asarray([seq + [c.eos_id]]))
        token = int(jnp.argmax(logits[0, len(seq)]))
        if token == c.eos_id:
            break
        seq.append(token)
    return seq[len(prompt) :]


@pytest.mark.slow
def test_generate_continues_prompts(lm_run):
    workdir, _ = lm_run
    gen = Translator.from_workdir(workdir)
    prompts = ["This is sentence", "", "number"]
    out = gen.generate(prompts, max_new_tokens=6, seed=3)
    assert len(out) == 3 and all(isinstance(s, str) for s in out)
    assert gen.generate(prompts, max_new_tokens=6, seed=3) == out  # same seed, same texts
    many = {tuple(gen.generate(prompts, max_new_tokens=6, seed=s)) for s in range(4)}
    assert len(many) > 1  # the seed matters when sampling
    # Greedy (temperature 0) is the argmax continuation of the prompt's pieces.
    greedy = gen.generate(["This is sentence"], max_new_tokens=6, temperature=0.0)[0]
    ids = gen.tokenizer.encode("This is sentence", add_eos=False).tolist()
    assert greedy == gen.tokenizer.decode(_greedy_by_full_forward(gen, ids, 6))
    # top_k=1 is greedy too, at any temperature.
    assert gen.generate(["This is sentence"], max_new_tokens=6, top_k=1, seed=9)[0] == greedy


def test_generate_bad_input(lm_run, tmp_path):
    workdir, _ = lm_run
    gen = Translator.from_workdir(workdir)
    with pytest.raises(TranslateError, match="holds a language model; use generate"):
        gen.translate(["a b"])
    with pytest.raises(TranslateError, match="a list of prompts, not one string"):
        gen.generate("a b")
    with pytest.raises(TranslateError, match=r"max_new_tokens=0 must be an integer in \[1, 31\]"):
        gen.generate(["a"], max_new_tokens=0)
    with pytest.raises(TranslateError, match="temperature=-1 must be >= 0"):
        gen.generate(["a"], temperature=-1)
    with pytest.raises(TranslateError, match="top_k=-2 must be an integer >= 0"):
        gen.generate(["a"], top_k=-2)
    with pytest.raises(TranslateError, match=r"top_p=0 must be in \(0, 1\]"):
        gen.generate(["a"], top_p=0)
    with pytest.raises(TranslateError, match="prompt 1 is int"):
        gen.generate(["a", 3], max_new_tokens=4)
    long = "This is sentence number 123456789. " * 10
    with pytest.warns(UserWarning, match="kept its last 24"):
        assert isinstance(gen.generate([long], max_new_tokens=8)[0], str)
    strict = Translator.from_workdir(workdir, too_long="refuse")
    with pytest.raises(TranslateError, match="at most 24 fit model.max_len=32"):
        strict.generate([long], max_new_tokens=8)


def test_generate_on_a_translation_run_is_refused(tmp_path):
    # A translation Translator built directly, without a run folder.
    from flaxformer_lite import ModelConfig, Transformer

    c = ModelConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, max_len=16)
    model = Transformer(c)
    params = unbox(
        model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32))
    )
    t = Translator(model, params["params"], tokenizer=None)
    with pytest.raises(TranslateError, match="holds a translation model; use translate"):
        t.generate(["a"])


def test_generate_cli(lm_run):
    workdir, raw = lm_run
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
    cmd = [sys.executable, "-m", "flaxformer_lite.main", "generate", f"--workdir={workdir}"]

    def cli(args, stdin=None):
        return subprocess.run(
            args, input=stdin, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )

    out = cli(cmd + ["--max_new_tokens=5", "--seed=1", "This is", "number"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(out.stdout.splitlines()) == 2
    gen = Translator.from_workdir(workdir)
    assert out.stdout.splitlines() == gen.generate(["This is", "number"], max_new_tokens=5, seed=1)
    piped = cli(cmd + ["--temperature=0"], stdin="This is\n")
    assert piped.returncode == 0 and len(piped.stdout.splitlines()) == 1
    bad = cli(cmd + ["--top_p=1.5", "x"])
    assert bad.returncode == 1 and "top_p=1.5" in bad.stderr and "Traceback" not in bad.stderr
    np.testing.assert_equal(bad.stdout, "")
