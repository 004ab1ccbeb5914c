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
from flaxformer_lite.config import ConfigError, ExperimentConfig, extensions, trust
from flaxformer_lite.config.files import field_table
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.exchange import export
from flaxformer_lite.model.partitioning import unbox

LAB = """
import flax.linen as nn
import jax.numpy as jnp
from flaxformer_lite.model.attention import dot_scores, register_score_fn
from flaxformer_lite.model.registry import (
    register_attention, register_ffn, register_norm, register_positional)
from flaxformer_lite.sparse.grammar import patterns
from flaxformer_lite.sparse.grammar.spec import register_pattern


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
    assert kept[0]["source"] == str(path.resolve())
    extensions.keep(str(path), run)  # a resume with the same code
    # the author on this machine (the original where the run recorded it) reads it
    _forget(monkeypatch)
    extensions.load_kept(run)
    assert capsys.readouterr().err == ""
    # the file changed: resuming is refused with the fix
    changed = _lab(tmp_path / "lab", "\n# tuned\n")
    with pytest.raises(extensions.ExtensionError, match=r"lab_ext.py changed since .* restore"):
        extensions.keep(str(changed), run)
    # a damaged copy is never imported
    (run / "extensions" / "lab_ext.py").write_text("raise SystemExit\n")
    _forget(monkeypatch)
    with pytest.raises(extensions.ExtensionError, match="differs from what the run kept"):
        extensions.load_kept(run)


def _forget(monkeypatch) -> None:
    """A fresh process, as far as the extensions imported are concerned."""
    monkeypatch.setattr(extensions, "_LOADED", {})
    monkeypatch.setattr(extensions, "_MODULES", {})
    monkeypatch.setattr(trust, "_TRUST_ALL", [False])  # the flag, off again after the test


def test_a_runs_code_runs_only_on_its_users_word(tmp_path, monkeypatch, capsys):
    """A run that arrives from elsewhere (its lab moved, gone or changed) is not
    imported without --trust_extensions: one message naming each file, its SHA-256
    and what it registers; nothing imported, nothing written. The flag imports it and
    remembers the code in the user's record, so the next command needs no flag."""
    marker = tmp_path / "ran"
    path = tmp_path / "lab" / "lab_ext.py"
    path.parent.mkdir()
    path.write_text(
        "from flaxformer_lite.sparse import patterns\n"
        "from flaxformer_lite.sparse.grammar.spec import register_pattern\n"
        f"open({str(marker)!r}, 'a').write('x')\n"
        'register_pattern("t_trusted_band", {"window": 2})(lambda a, b, s: patterns.Local(2))\n'
    )
    run = tmp_path / "run"
    extensions.keep(str(path), run)
    marker.unlink(missing_ok=True)
    shutil.rmtree(path.parent)  # the run, as a shared or downloaded one arrives
    _forget(monkeypatch)
    record = trust.record_path()
    before = record.read_text() if record.exists() else None
    sha = extensions.digest(run / "extensions" / "lab_ext.py")
    with pytest.raises(extensions.ExtensionError) as refused:
        extensions.load_kept(run)
    said = str(refused.value)
    assert f"lab_ext.py (SHA-256 {sha}, registers sparse pattern 't_trusted_band')" in said
    assert "--trust_extensions" in said
    assert not marker.exists() and extensions._LOADED == {}
    assert (record.read_text() if record.exists() else None) == before
    trust.trust_all()
    extensions.load_kept(run)
    assert marker.read_text() == "x" and sha in trust.trusted()
    _forget(monkeypatch)  # the next command, without the flag: remembered
    extensions.load_kept(run)
    assert marker.read_text() == "xx"
    # the author's file changed after training: the run's copy, with a note
    path.parent.mkdir()
    path.write_text("# tuned\n")
    _forget(monkeypatch)
    extensions.load_kept(run)
    assert "changed since the run kept it; using the run's copy" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escape.py", "/tmp/abs.py", "sub/x.py", "link.py"])
def test_a_manifest_never_points_out_of_its_folder(tmp_path, monkeypatch, name):
    path = _lab(tmp_path / "lab")
    run = tmp_path / "run"
    extensions.keep(str(path), run)
    folder = run / "extensions"
    if name == "link.py":  # a link that leads out of the run's folder
        (folder / name).symlink_to(path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest[0]["copy"] = name
    (folder / "manifest.json").write_text(json.dumps(manifest))
    _forget(monkeypatch)
    trust.trust_all()
    with pytest.raises(extensions.ExtensionError, match=f"names the copy '{re.escape(name)}'"):
        extensions.load_kept(run)
    assert extensions._LOADED == {}


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


IMPLICIT = """
from flaxformer_lite.model.attention import dot_scores, register_score_fn
from flaxformer_lite.sparse.grammar import patterns
from flaxformer_lite.sparse.grammar.spec import register_pattern

register_pattern("t_own_band", {"window": 2})(lambda a, b, s: patterns.Local(a["window"]))
register_score_fn("t_own_neg")(lambda **_: lambda q, k: -dot_scores(q, k))
"""


def test_a_module_the_config_imports_itself_is_kept(
    tmp_path, monkeypatch, capsys, fixture_data, one_device
):
    """A config file that does ``import my_ext`` (no model.extensions): training keeps
    the module's file as if named, with a note, so the run reads as any other; after
    the lab moves, on the user's word. A name registered in ``__main__`` is refused."""
    import sys

    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.training.train import train_and_evaluate
    from tests.fixtures import debug_config

    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "t_own_ext.py").write_text(IMPLICIT)
    monkeypatch.syspath_prepend(str(lab))
    monkeypatch.chdir(tmp_path)
    __import__("t_own_ext")  # what the config file's own import does
    config = debug_config(fixture_data[1], num_steps=1, eval_bleu_sentences=0)
    config.model.attention_pattern = "t_own_band:window=2"
    config.model.attention_block_size = 8
    config.model.attention_dropout = 0.0
    run = tmp_path / "run"
    train_and_evaluate(config, run)
    said = capsys.readouterr().out
    assert "note: model.extensions += lab/t_own_ext.py (it registers sparse pattern " in said
    assert "'t_own_band', which the config uses; the run keeps it as if named)" in said
    kept = json.loads((run / "extensions/manifest.json").read_text())
    assert [r["entry"] for r in kept] == ["lab/t_own_ext.py"]
    _forget(monkeypatch)
    assert Run.open(run).model_config.attention_pattern == "t_own_band:window=2"  # the author
    shutil.move(lab, tmp_path / "moved")
    _forget(monkeypatch)
    with pytest.raises(Exception, match="t_own_ext.py .*registers sparse pattern 't_own_band'"):
        Run.open(run)
    trust.trust_all()
    assert Run.open(run).model_config.attention_pattern == "t_own_band:window=2"
    # a name registered by the script or notebook cell that runs: no file to keep
    from flaxformer_lite.sparse.grammar import patterns
    from flaxformer_lite.sparse.grammar.spec import register_pattern

    def here(a, b, s):
        return patterns.Local(2)

    here.__module__ = "__main__"
    register_pattern("t_main_band", {})(here)
    with pytest.raises(ConfigError, match=r"registered in __main__ .* model.extensions"):
        extensions.implicit(ModelConfig(attention_pattern="t_main_band", attention_dropout=0.0))
    del sys.modules["t_own_ext"]


def test_an_older_run_without_its_code_names_the_fix(tmp_path):
    """A run trained before runs kept a config's own imports: its names are unknown
    here, and the message says where to name the file, not "restore it"."""
    from flaxformer_lite.workdir.checkpoints import CheckpointError
    from flaxformer_lite.workdir.folder import read_config

    config = ExperimentConfig.from_config(_config("")).to_dict()
    config["model"]["attention_pattern"] = "t_gone_band:window=8"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as e:
        read_config(tmp_path)
    said = str(e.value)
    assert "unknown sparse pattern 't_gone_band'" in said
    assert 'name its file in the "extensions" of "model"' in said and "restore it" not in said


LAB_CONFIG = """
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
import t_sweep_ext  # the lab's own names, registered by importing it

from flaxformer_lite.config import apply_variants, base_config, get_preset


def get_config(arg=None):
    config = base_config(get_preset("paper_base"))
    config.model.attention_pattern = "t_sweep_band:window=2"
    config.model.attention_block_size = 8
    config.model.attention_dropout = 0.0
    return apply_variants(config, arg).lock()
"""


@pytest.mark.slow  # a 1-run sweep and its scoring, then a translate: ~40 s
def test_a_sweep_of_a_config_that_imports_its_lab(tmp_path, fixture_data):
    """The report's case: a config file that imports its lab module, swept; the runs
    train, keep the module and are scored; after the lab moves, translate reads a run on
    the user's word."""
    import os
    import subprocess
    import sys

    from tests.fixtures import ROOT, debug_env

    lab = tmp_path / "lab"
    lab.mkdir()
    (lab / "t_sweep_ext.py").write_text(IMPLICIT.replace("t_own", "t_sweep"))
    (lab / "my_config.py").write_text(LAB_CONFIG)
    env = debug_env(fixture_data, PYTHONPATH=str(ROOT))

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "flaxformer_lite.main", *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True)  # fmt: skip

    data = f"--config.data.data_dir={fixture_data[1]}"
    out = cli("sweep", "--config=lab/my_config.py:debug", "--workdir=sweep", "--seeds=1",
              "--sweep=model.num_heads=2", "--limit=4", "--beam_size=1", data,
              "--config.model.vocab_size=100")  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run = tmp_path / "sweep/num_heads=2/seed0"
    assert "note: model.extensions += lab/t_sweep_ext.py" in (run / "train.log").read_text()
    assert (run / "test_scores.json").is_file()
    os.rename(lab, tmp_path / "moved")
    refused = cli("translate", f"--workdir={run}", "Komm her!")
    assert refused.returncode == 1 and "t_sweep_ext.py (SHA-256" in refused.stderr
    trusted = cli("translate", f"--workdir={run}", "--trust_extensions", "Komm her!")
    assert trusted.returncode == 0 and trusted.stdout.count("\n") == 1, trusted.stderr[-2000:]
