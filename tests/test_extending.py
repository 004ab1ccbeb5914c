"""docs/extending.md's examples run as written: a registered score function and a
registered sparse pattern are accepted by the config and used by the model."""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flaxformer_lite import ModelConfig, Transformer
from flaxformer_lite.config import extensions, rules
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.model import attention
from flaxformer_lite.model.partitioning import unbox
from flaxformer_lite.sparse.grammar import spec

GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def _examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


@pytest.fixture
def registered():
    """Run the guide's first two examples; remove what they registered afterwards."""
    namespace: dict = {}
    for code in _examples()[:2]:
        exec(compile(code, "docs/extending.md", "exec"), namespace)  # noqa: S102
    yield namespace
    attention._SCORE_FNS.pop("cosine", None)
    extensions._ORIGINS.pop(("score function", "cosine"), None)
    extensions._ORIGINS.pop(("sparse pattern", "local_dilated"), None)
    if "cosine" in rules.SCORE_FUNCTIONS:
        rules.SCORE_FUNCTIONS.remove("cosine")
    spec._ATOMS.pop("local_dilated", None)


def test_the_guide_has_its_four_examples():
    assert len(_examples()) == 4  # the fourth (a task head) is model/classifier.py itself


def test_registered_score_function_and_pattern_work(registered):
    assert registered["config"].score_fn == "cosine"
    assert "local_dilated" in spec.pattern_names()
    small = dict(
        vocab_size=40, d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1,
        num_decoder_layers=1, max_len=64, attention_block_size=16,
    )  # fmt: skip
    src = jnp.arange(2, 42).reshape(1, 40) % 38 + 2
    # (the blocked sparse kernel computes dot-product scores: the two are used apart)
    for extra in (
        {"score_fn": "cosine"},
        {"attention_pattern": "local_dilated:window=4,dilation=8"},
    ):
        config = ModelConfig(**small, **extra)
        model = Transformer(config)
        params = unbox(model.init(jax.random.key(0), src, src[:, :20]))["params"]
        logits = model.apply({"params": params}, src, src[:, :20])
        assert logits.shape == (1, 20, 40) and bool(jnp.isfinite(logits).all())
    # the pattern is the union the example builds
    pattern = spec.layer_patterns(
        config.attention_pattern, 0, 2, block_size=16, seed=0, causal=False
    )[0]
    i, j = np.meshgrid(np.arange(64), np.arange(64), indexing="ij")
    d = np.abs(i - j)
    np.testing.assert_array_equal(pattern.mask(64), (d <= 4) | ((d % 8 == 0) & (d <= 32)))


def test_unregistered_names_are_config_errors():
    with pytest.raises(ConfigError, match="local_dilated"):
        ModelConfig(attention_pattern="local_dilated")
    with pytest.raises(ValueError, match="taken"):
        spec.register_pattern("local", {})(lambda a, b, s: None)
