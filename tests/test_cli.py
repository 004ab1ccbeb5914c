"""The command line end to end on fixture data: a :debug run, the LM, the sparse LM."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from flaxformer_lite.inference.run import Run
from flaxformer_lite.training.state import abstract_train_state
from flaxformer_lite.training.train import train_and_evaluate
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from tests.fixtures import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]
# In-process training here is not about devices (its subprocesses: one device too).
pytestmark = pytest.mark.usefixtures("one_device")


def test_cli_debug_run(trained_run):
    """``python -m flaxformer_lite.main --config=configs/ende_small.py:debug``, the shared
    trained run (tests/fixtures.py: this command line with a few overrides, on one
    device): validation and logs at their steps, the tokenizer, TensorBoard's events,
    the checkpoints and the config as given."""
    run, _ = trained_run
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validation = {r["step"]: r for r in records if r["split"] == "validation"}
    assert sorted(validation) == [3, 6]
    assert np.isfinite(validation[6]["loss"]) and validation[6]["perplexity"] > 1
    assert "bleu" in validation[6]  # eval_bleu_sentences: the greedy decode's BLEU
    assert {r["step"] for r in records if r["split"] == "train"} == {2, 4, 6}
    assert (run / "tokenizer.model").exists() and any((run / "tensorboard").iterdir())
    saved = Run.open(run)
    assert saved.steps("last") == [3, 6] and saved.config.model.vocab_size == 100
    assert saved.config.model.max_len == 32 and saved.config.train.profile == "2:2"
    said = (run.parent / "stdout.txt").read_text()
    assert "done: step 6 (6 this run)" in said and "Traceback" not in said
    # A bad field on this command line: tests/test_bad_inputs.py ('unknown field').


def test_language_model_training(fixture_data, tmp_path):
    """The decoder-only LM trains through the same loop on one text feature."""
    _, data_dir = fixture_data
    config = load_config("lm_small", "debug")
    config.model.vocab_size = 80  # English alone supports ~93 pieces
    config.data.dataset = "ding_de_en"  # the fixture Bible is too small for a tokenizer
    config.data.data_dir = str(data_dir)
    metrics = train_and_evaluate(config, tmp_path)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    params, step = ckpt_lib.restore_params(tmp_path, abstract_train_state(config).params, "last")
    assert step == 6 and "encoder" not in params
    assert not any(
        "cross_attention" in jax.tree_util.keystr(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    )


def test_sparse_long_lm_debug_run(fixture_data, tmp_path):
    """configs/lm_long_sparse.py:debug trains through the blocked sparse kernel."""
    _, data_dir = fixture_data
    config = load_config("lm_long_sparse", "debug")
    config.model.vocab_size = 80
    config.model.max_len = config.data.max_length = 128
    config.train.batch_size = 8  # one row per simulated device
    config.data.dataset = "ding_de_en"  # the fixture Bible is too small for a tokenizer
    config.data.data_dir = str(data_dir)
    config.train.attention_stats_every = 3  # the sparse heads' statistics, logged
    metrics = train_and_evaluate(config, tmp_path)
    assert np.isfinite(metrics["loss"]) and metrics["tokens"] > 0
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    stats = [r for r in logged if r["split"] == "attention"]
    assert [r["step"] for r in stats] == [3, 6]
    head = "decoder/layer_0/self_attention/head_0/"
    for name in ("entropy", "distance", "max_logit", "mass_in:local:window=8"):
        assert np.isfinite(stats[-1][head + name]), name
    assert 0 < stats[-1][head + "mass_in:topk:k=8"] <= 1


# Asking for help, or for the fields, imports neither JAX nor Flax (the command line
# answers at once) and exits 0; absl's own exit status for --help is 1.
LIGHT = """
import sys, runpy
sys.argv = ["flaxformer_lite.main", *sys.argv[1:]]
try:
    runpy.run_module("flaxformer_lite.main", run_name="__main__")
except SystemExit as e:
    code = e.code
print("HEAVY", sorted(m for m in ("jax", "flax", "optax", "orbax") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.parametrize("args", [["--help"], ["fields"], ["--helpfull"]])
def test_help_and_fields_answer_without_jax(args):
    out = subprocess.run(
        [sys.executable, "-c", LIGHT, *args], cwd=ROOT, capture_output=True, text=True,
        check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout[-500:]
    assert ("model.d_model" in out.stdout) if args == ["fields"] else ("--workdir" in out.stdout)


def test_compiled_programs_are_kept_in_the_compilation_cache_folder(tmp_path):
    """--compilation_cache points JAX's persistent cache at its folder ('' = off); a
    folder given by JAX_COMPILATION_CACHE_DIR (the suite's own) wins."""
    import jax

    from flaxformer_lite.workdir import compile_cache

    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_compilation_cache_max_size")  # fmt: skip
    before = {n: getattr(jax.config, n) for n in names}
    try:
        jax.config.update("jax_compilation_cache_max_size", -1)
        compile_cache.keep_compiled_programs(str(tmp_path / "other"))
        assert jax.config.jax_compilation_cache_dir == before["jax_compilation_cache_dir"]
        # The user's folder keeps its size but gets a limit: jax's lock between processes.
        assert jax.config.jax_compilation_cache_max_size == compile_cache.LOCK_ONLY
        jax.config.update("jax_compilation_cache_dir", None)
        compile_cache.keep_compiled_programs("")
        assert jax.config.jax_compilation_cache_dir is None
        compile_cache.keep_compiled_programs(str(tmp_path / "xla"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    finally:
        for n, value in before.items():
            jax.config.update(n, value)


# A fresh process: main's cache settings, then one program compiled twice (the second
# time after jax forgets it in memory), so that it is written and then read back.
CACHE_ROUND_TRIP = """
import os, sys, warnings
if sys.argv[2] == "hide":
    sys.modules["filelock"] = None  # an install without it: importing it fails
warnings.simplefilter("error")  # jax warns, and goes on, where it cannot use an entry
import jax, jax.numpy as jnp
from flaxformer_lite.workdir import compile_cache
compile_cache.keep_compiled_programs(sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # this tiny program too
f = lambda x: jnp.sin(x) @ x.T
for _ in range(2):
    jax.jit(f)(jnp.ones((8, 8))).block_until_ready()
    jax.clear_caches()
print("LIMIT", jax.config.jax_compilation_cache_max_size)
print("ENTRIES", len([n for n in os.listdir(sys.argv[1]) if n.endswith("-cache")]))
"""


@pytest.mark.parametrize("filelock", ["installed", "hide"])
def test_the_compilation_cache_writes_and_reads_its_entries(tmp_path, filelock):
    """With a size limit set and no ``filelock``, jax read and wrote no entry at all
    (a plain install lacked it): the package depends on it, and without it main keeps
    an unbounded cache rather than none."""
    import importlib.metadata

    requires = importlib.metadata.requires("flaxformer_lite") or []
    assert any(r.split(";")[0].startswith("filelock") for r in requires), requires
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    folder = tmp_path / "xla"
    out = subprocess.run(
        [sys.executable, "-c", CACHE_ROUND_TRIP, str(folder), filelock],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ENTRIES 0" not in out.stdout, out.stdout
    limit = "-1" if filelock == "hide" else str(2 << 30)
    assert f"LIMIT {limit}" in out.stdout, out.stdout


# One of two processes side by side: main's cache settings on the folder the user chose
# (JAX_COMPILATION_CACHE_DIR, as the suite and a sweep's runs may), then the same 12
# programs as the other process, each entry written in two halves 20 ms apart, so that
# a reader that does not wait for the writer finds half an entry.
CACHE_SIDE_BY_SIDE = """
import os, pathlib, sys, time
import jax, jax.numpy as jnp
from jax._src import path as jax_path
from flaxformer_lite.workdir import compile_cache

def slow_write(self, data):
    with open(self, "wb") as f:
        half = len(data) // 2
        f.write(data[:half]); f.flush(); time.sleep(0.02); f.write(data[half:])

type(jax_path.Path(os.environ["JAX_COMPILATION_CACHE_DIR"])).write_bytes = slow_write
compile_cache.keep_compiled_programs("~/.cache/flaxformer_lite/xla")  # main's default
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
hits = []
jax.monitoring.register_event_listener(
    lambda name, **_: hits.append(name) if name.endswith("cache_hits") else None)
ready = pathlib.Path(sys.argv[1])
(ready / sys.argv[2]).touch()
while len(list(ready.iterdir())) < 2:  # start together
    time.sleep(0.01)
for n in range(1, 13):
    jax.jit(lambda x, n=n: jnp.sin(x) * n + jnp.cos(x) @ x)(jnp.ones((n, n))).block_until_ready()
print("HITS", len(hits))
"""


def test_two_processes_share_the_compilation_cache_without_a_torn_entry(tmp_path):
    """jax writes an entry in place and locks the folder only when it has a size limit:
    two processes compiling the same programs into one folder at once read each other's
    half-written entries ("Error reading persistent compilation cache entry ...
    truncated stream") unless every process sets one (compile_cache.py)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "xla")
    (tmp_path / "ready").mkdir()
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", CACHE_SIDE_BY_SIDE, str(tmp_path / "ready"), name],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for name in ("a", "b")
    ]
    outs = [run.communicate(timeout=300) for run in runs]
    for run, (_, err) in zip(runs, outs, strict=True):
        assert run.returncode == 0, err[-2000:]
        assert "Error reading persistent compilation cache" not in err, err[-2000:]
    hits = sum(int(out.split("HITS")[1]) for out, _ in outs)
    assert hits > 0, outs  # they did share entries


def test_a_lock_only_cache_skips_jaxs_scan_of_every_entry(tmp_path):
    """A limit no cache reaches keeps jax's lock but not its per-write scan of every
    entry (which read each entry's size and access time: quadratic over a session); a
    real limit still scans. The scan is seen by the folder listing it makes (jax before
    0.11 then fails on an entry without its access-time file; later ones skip it)."""
    import contextlib

    from jax._src import lru_cache

    from flaxformer_lite.workdir.compile_cache import LIMIT, LOCK_ONLY, skip_scans_past_reach

    class Listed:
        """The cache's folder, counting its listings."""

        def __init__(self, folder):
            self.folder, self.listings = folder, 0

        def glob(self, pattern):
            self.listings += 1
            return self.folder.glob(pattern)

        def __truediv__(self, name):
            return self.folder / name

    skip_scans_past_reach()
    (tmp_path / "orphan-cache").write_bytes(b"x")  # jax's entry suffix, no atime file
    for limit, scans in ((LOCK_ONLY, 0), (LIMIT, 1)):
        cache = lru_cache.LRUCache(str(tmp_path), max_size=limit)
        cache.path = listed = Listed(cache.path)
        with contextlib.suppress(FileNotFoundError):
            cache._evict_if_needed()
        assert listed.listings == scans, limit
