"""Test setup: 8 simulated CPU devices (multi-device code), CPU as the reference platform."""

import atexit
import os
import shutil
import tempfile


def _jaxlib_version() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without importing jax."""
    from importlib.metadata import version

    return tuple(int(x) for x in version("jaxlib").split(".")[:2])


os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The suite compiles hundreds of small programs and runs most of them once or a few
# times: XLA's backend optimizations (LLVM -O3 on CPU) cost more than they save there
# (the suite ran ~25% faster without them). Numerics are the same operations, in
# possibly another order of fusion, which every tolerance here allows for. A test
# whose run time dominates (a long training) asks for them back with
# ``jax.jit(..., compiler_options=OPTIMIZED)`` (tests/fixtures.py). Subprocesses
# inherit the flag. FLAXFORMER_TEST_OPTIMIZE=1 keeps XLA's default everywhere.
if "--xla_backend_optimization_level" not in os.environ["XLA_FLAGS"] and os.environ.get(
    "FLAXFORMER_TEST_OPTIMIZE", "0"
) in ("", "0"):
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
    # Compilation is about half of the suite's time (over 4,000 programs, most of them
    # single ops run eagerly). XLA's classic CPU emitters compile in about two thirds
    # of the time of its newer fusion emitters (the MLIR code generator), and their
    # code runs no slower at these sizes (benchmarks/compile_flags.py). Only jaxlib
    # versions whose flag list holds the flag get it: XLA aborts on a flag it does
    # not know.
    if (0, 6) <= _jaxlib_version() < (0, 11):
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests (and the CLI subprocesses they start) build the same debug model, each
# with fresh jit closures, so jax's in-memory cache misses and XLA compiles the same
# program again. A persistent cache, keyed on the compiled program itself, shared by
# the whole session (subprocesses inherit the variables) and removed after it, lets
# them reuse one compilation. It changes which binary is reused, never what runs.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="flaxformer-test-xla-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")
# What a bucket's run copies to the machine (a tokenizer, a data folder, a corpus:
# workdir/location.py) goes to a folder of the session's, not the user's ~/.cache.
if "FLAXFORMER_CACHE" not in os.environ:
    _local = tempfile.mkdtemp(prefix="flaxformer-test-cache-")
    atexit.register(shutil.rmtree, _local, ignore_errors=True)
    os.environ["FLAXFORMER_CACHE"] = _local
# Which runs' code the user trusts (config/trust.py) is recorded in the user's config
# folder: the session's own, so that no test reads or writes the user's record.
if "XDG_CONFIG_HOME" not in os.environ:
    _config_home = tempfile.mkdtemp(prefix="flaxformer-test-config-")
    atexit.register(shutil.rmtree, _config_home, ignore_errors=True)
    os.environ["XDG_CONFIG_HOME"] = _config_home
# Searches stored as executables (inference/programs.py) are compiled anew, not taken
# from that shared cache, and keyed on the modules a process imported (the tests'
# differ from worker to worker): in the suite they would cost compiles and rarely
# load. tests/test_programs.py turns them on where it tests them.
os.environ.setdefault("FLAXFORMER_LITE_STORED_SEARCHES", "0")
# The workers and their subprocesses write that folder at once: with a size limit jax
# locks it, so none reads another's half-written entry (workdir/compile_cache.py).
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(1 << 50))

import jax  # noqa: E402
import pytest  # noqa: E402

from flaxformer_lite.workdir.compile_cache import skip_scans_past_reach  # noqa: E402

skip_scans_past_reach()  # the lock without jax's per-write scan of every entry

from flaxformer_lite.config.model import ModelConfig  # noqa: E402


@pytest.fixture
def tiny_config() -> ModelConfig:
    """A model small enough for exhaustive tests (no dropout)."""
    return ModelConfig(
        vocab_size=50,
        d_model=32,
        num_heads=4,
        d_ff=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        max_len=32,
        embedding_dropout=0.0,
        residual_dropout=0.0,
    )


@pytest.fixture
def rng():
    return jax.random.key(0)


@pytest.fixture(scope="session")
def fixture_data(tmp_path_factory):
    """(raw package folder, TFDS data_dir) of the fixture Ding corpus, built once for
    the whole session (all workers). Read-only: a test that changes a corpus writes
    its own."""
    from tests import fixtures

    folder = fixtures.shared_folder(tmp_path_factory, "ding", fixtures.build_ding_dataset)
    return folder / "raw", folder / "tfds"


@pytest.fixture
def one_device(monkeypatch):
    """Training in this process on one device (tests/fixtures.train_on_one_device)."""
    from tests import fixtures

    fixtures.train_on_one_device(monkeypatch)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, fixture_data):
    """(workdir, raw folder): a :debug translation run trained by the command line
    (tests/fixtures.py)."""
    from tests import fixtures

    return fixtures.trained_translation_run(tmp_path_factory, fixture_data), fixture_data[0]


# Files by their share of the default suite's time (seconds on a 2-core machine, from
# --durations): heaviest first. With pytest-xdist's --dist loadfile each worker takes
# the next file when it is done, so the longest files must start first, or the run
# ends with one worker idle while the other works through a long file alone. Only
# the order changes; a file not listed runs after these, in collection order.
FILE_SECONDS = {
    "test_decoding.py": 85,
    "test_resume.py": 62,
    "test_translate.py": 61,
    "test_faults.py": 60,
    "test_kernels.py": 58,
    "test_routed.py": 52,
    "test_transformer.py": 50,
    "test_sparse.py": 49,
    "test_gcs.py": 40,
    "test_slurm.py": 30,
    "test_synthetic.py": 32,
    "test_generate.py": 32,
    "test_bad_inputs.py": 31,
    "test_scan_layers.py": 29,
    "test_route_gpu.py": 26,
    "test_steps.py": 26,
    "test_routed_gpu.py": 24,
    "test_export.py": 24,
    "test_precision.py": 23,
    "test_attention_maps.py": 22,
    "test_cli.py": 20,
    "test_compressed_gpu.py": 19,
    "test_sharding.py": 19,
    "test_chunked.py": 17,
    "test_block_sparse_gpu.py": 17,
    "test_hf_import.py": 16,
    "test_continuous.py": 14,
    "test_float64.py": 14,
    "test_extending.py": 12,
    "test_corpora.py": 11,
    "test_run.py": 10,
}


def pytest_collection_modifyitems(config, items):
    """Heaviest files first (FILE_SECONDS); tests marked ``gpu`` run where JAX sees an
    NVIDIA GPU (JAX_PLATFORMS=cuda, as ``make test-gpu`` and benchmarks/gpu/run.sh set it),
    skipped elsewhere."""
    rank = {name: i for i, name in enumerate(FILE_SECONDS)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable sort
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu and jax.default_backend() != "gpu":
        why = "needs an NVIDIA GPU (make test-gpu, or benchmarks/gpu/run.sh tests)"
        skip = pytest.mark.skip(reason=why)
        for item in gpu:
            item.add_marker(skip)
