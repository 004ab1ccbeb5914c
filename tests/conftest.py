"""Test setup: 8 simulated CPU devices (multi-device code), CPU as the reference platform."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

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
