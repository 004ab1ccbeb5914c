"""Test setup: 8 simulated CPU devices (multi-device code), CPU as the reference platform."""

import atexit
import os
import shutil
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
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

import jax  # noqa: E402
import pytest  # noqa: E402

from flaxformer_lite.config import ModelConfig  # noqa: E402


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
    """(raw package folder, TFDS data_dir) of the fixture Ding corpus, built once."""
    from tests import fixtures

    return fixtures.build_ding_dataset(tmp_path_factory.mktemp("ding"))
