"""Extensions named by configuration (config/extensions.py, model/registry.py): a file
outside the package registers a feed-forward block, a normalisation, a position
encoding, a score function and a sparse pattern; the config takes them once
model.extensions names the file (and lists them among the choices); the model builds
with them; a run keeps a copy with its SHA-256 and reads it after the file moves; a
changed file is refused on resume and noted on reading; registering a name twice with
other code, or a built-in name, is refused; export and import say what they cannot
carry. The worked example's whole CLI sequence is in the slow tier (test_lab_example)."""

import json
import re
import shutil
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from flaxformer_lite import Transformer
from flaxformer_lite.config import ConfigError, ExperimentConfig, extensions
from flaxformer_lite.config.files import field_table
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.inference import export
from flaxformer_lite.model.partitioning import unbox

LAB = """
import flax.linen as nn
import jax.numpy as jnp
from flaxformer_lite.model.attention import dot_scores, register_score_fn
from flaxformer_lite.model.registry import (
    register_attention, register_ffn, register_norm, register_positional)
from flaxformer_lite.sparse import patterns
from flaxformer_lite.sparse.spec import register_pattern


class Glu(nn.Module):
    config: object

    @nn.compact
    def __call__(self, x, *, deterministic=True):
        c = self.config
        h = nn.Dense(c.d_ff, name="wi")(x) * nn.sigmoid(nn.Dense(c.d_ff, name="wi_gate")(x))
        return nn.Dense(c.d_model, name="wo")(h)


class ScaleOnly(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x * self.param("gain", nn.initializers.ones, (x.shape[-1],))


class Ramp(nn.Module):
    d_model: int

    def __call__(self, positions):
        return jnp.broadcast_to(positions[..., None] / 100.0, (*positions.shape, self.d_model))


class NoAttention(nn.Module):  # an ablation: each position sees only itself
    config: object
    layer: int = 0
    causal: bool = False
    self_attention: bool = True

    @nn.compact
    def __call__(self, inputs_q, inputs_kv=None, mask=None, *, deterministic=True,
                 decode=False, positions=None):
        return nn.Dense(self.config.d_model, name="proj")(inputs_q)


register_attention("t_none")(lambda c, name, **kw: NoAttention(c, name=name, **kw))
register_ffn("t_glu")(lambda c, name: Glu(c, name=name))
register_norm("t_scale")(lambda c, name: ScaleOnly(name=name))
register_positional("t_ramp")(lambda c, name: Ramp(c.d_model, name=name))
register_score_fn("t_neg")(lambda **_: lambda q, k: -dot_scores(q, k))
register_pattern("t_band", {"window": 2})(lambda a, b, s: patterns.Local(a["window"]))
"""


def _lab(folder: Path, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "lab_ext.py"
    path.write_text(textwrap.dedent(LAB) + extra)
    return path


def _config(path, **model):
    model = {"extensions": str(path), "vocab_size": 50, "d_model": 16, "num_heads": 2,
             "d_ff": 32, "num_encoder_layers": 1, "num_decoder_layers": 1,
             "attention_block_size": 8, **model}  # fmt: skip
    return {"model": model, "data": {"max_length": 16}}


def test_a_lab_file_registers_every_extension_point(tmp_path):
    path = _lab(tmp_path / "lab")
    c = ExperimentConfig.from_config(
        _config(path, ffn="t_glu", norm="t_scale", positional="t_ramp", score_fn="t_neg")
    ).model
    plain = ExperimentConfig.from_config(_config(path, attention="t_none")).model
    assert ExperimentConfig.from_config(_config(path, attention_pattern="t_band:window=3"))
    table = field_table().splitlines()
    pairs = (
        ("ffn", "t_glu"),
        ("norm", "t_scale"),
        ("positional", "t_ramp"),
        ("attention", "t_none"),
    )
    for field, name in pairs:
        at = next(i for i, x in enumerate(table) if f"model.{field}:" in x)
        assert f"| {name}]" in table[at + 1]  # `fields` lists it among the choices
    with pytest.raises(ConfigError, match=r"model.ffn='t_gl'.*t_glu"):
        ExperimentConfig.from_config(_config(path, ffn="t_gl"))
    src, tgt = jnp.ones((1, 5), jnp.int32), jnp.ones((1, 4), jnp.int32)
    model = Transformer(c)
    params = unbox(model.init(jax.random.key(0), src, tgt))["params"]
    layer = params["encoder"]["layer_0"]
    assert set(layer["ffn"]) == {"wi", "wi_gate", "wo"}
    assert set(layer["ffn_norm"]) == {"gain"}  # the registered norm, not LayerNorm's
    # the registered encoding is added to the embeddings: another one changes the output
    base = model.apply({"params": params}, src, tgt)
    none = Transformer(c.replace(positional="none")).apply({"params": params}, src, tgt)
    assert float(jnp.abs(base - none).max()) > 1e-4
    # the attention sublayer replaced: self and cross-attention alike
    params = unbox(Transformer(plain).init(jax.random.key(0), src, tgt))["params"]
    layer = params["decoder"]["layer_0"]
    assert set(layer["self_attention"]) == set(layer["cross_attention"]) == {"proj"}


def test_a_name_is_registered_once(tmp_path):
    _lab(tmp_path / "a")
    same = _lab(tmp_path / "b")  # the same code elsewhere (a run's copy): accepted
    ExperimentConfig.from_config(_config(same))
    other = _lab(tmp_path / "c", "\nregister_ffn('t_glu')(lambda c, name: None)\n")
    with pytest.raises(ConfigError, match=r"'t_\w+' is already registered by other code"):
        ExperimentConfig.from_config(_config(other))
    from flaxformer_lite.model.registry import register_norm

    with pytest.raises(ValueError, match="'layer_norm' is taken"):
        register_norm("layer_norm")(lambda c, name: None)
    with pytest.raises(ConfigError, match=r"'nowhere/x.py' not found .* fix the path"):
        ExperimentConfig.from_config(_config("nowhere/x.py"))
    with pytest.raises(ConfigError, match="no module file for 'no_such_lab_module'"):
        ExperimentConfig.from_config(_config("no_such_lab_module"))


def test_a_run_keeps_its_extensions(tmp_path, monkeypatch, capsys):
    path = _lab(tmp_path / "lab")
    run = tmp_path / "run"
    extensions.keep(str(path), run)
    kept = json.loads((run / "extensions" / "manifest.json").read_text())
    assert kept[0]["entry"] == str(path) and (run / "extensions" / "lab_ext.py").is_file()
    assert kept[0]["sha256"] == extensions.digest(path)
    extensions.keep(str(path), run)  # a resume with the same code
    # the lab folder moves: a fresh process reads the run's copy, silently
    monkeypatch.setattr(extensions, "_LOADED", {})
    moved = tmp_path / "moved"
    shutil.move(path.parent, moved)
    extensions.load_kept(run)
    assert capsys.readouterr().err == ""
    # the file changed: resuming is refused with the fix, reading notes it
    changed = _lab(tmp_path / "lab", "\n# tuned\n")
    with pytest.raises(extensions.ExtensionError, match=r"lab_ext.py changed since .* restore"):
        extensions.keep(str(changed), run)
    monkeypatch.setattr(extensions, "_LOADED", {})
    extensions.load_kept(run)
    assert "changed since the run kept it; using the run's copy" in capsys.readouterr().err
    # a damaged copy is never imported
    (run / "extensions" / "lab_ext.py").write_text("raise SystemExit\n")
    monkeypatch.setattr(extensions, "_LOADED", {})
    with pytest.raises(extensions.ExtensionError, match="differs from what the run kept"):
        extensions.load_kept(run)


def test_export_and_import_name_what_they_cannot_carry(tmp_path):
    path = _lab(tmp_path / "lab")
    c = ExperimentConfig.from_config(_config(path, ffn="t_glu", attention_pattern="t_band")).model
    reasons = export.check(c)  # (the first file that registered them, in this process)
    assert re.fullmatch(r"model.ffn='t_glu' \(Marian's FFN is act\(x W1\) W2, registered by "
                        r"the extension /.*/lab_ext.py\)", reasons[0])  # fmt: skip
    assert re.search(r"a sparse pattern, registered by the extension /.*/lab_ext.py", reasons[1])
    assert export.check(ModelConfig(norm="rms_norm")) == [
        "model.norm='rms_norm' (Marian normalises by LayerNorm)"
    ]
    from flaxformer_lite.training import startup

    config = ExperimentConfig.from_config(
        {**_config(path, ffn="t_glu"), "train": {"init_from": "hf:/some/opus-mt"}}
    )
    with pytest.raises(startup.TrainingError, match=r"model.ffn='t_glu' cannot hold a Marian"):
        startup.with_imported_model(config, tmp_path / "run")
