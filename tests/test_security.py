"""What a run folder, a corpus or a shared file holds is data: read as data of one shape,
bounded, never a path out of its folder, never code (the code a run carries runs on its
user's word only: test_extensions.py; a model folder's own code: test_hf_import.py; the
attention page's text: test_attention_maps.py; a sweep's folder names: test_sweep.py).
Each test is a hostile file that the reader once let through."""

import io
import json
import zipfile

import jax
import pytest

from flaxformer_lite.data import tokenizer as tok
from flaxformer_lite.data.assembly import check_corpus
from flaxformer_lite.data.files import CorpusError
from flaxformer_lite.sweep.rows import recorded as _recorded
from flaxformer_lite.sweep.runner import _claim_folder
from flaxformer_lite.sweep.spec import Sweep, SweepError, parse_axis
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir.folder import read_config


def _pair_archive(source: bytes, *, extra: dict[str, bytes] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("pieces.json", json.dumps({"pieces": ["<pad>", "</s>", "x"], "unk_id": 2}))
        z.writestr("source.spm", source)
        z.writestr("target.spm", b"not read this far")
        for name, data in (extra or {}).items():
            z.writestr(name, data)
    return buffer.getvalue()


def test_a_tokenizer_archive_is_read_bounded_and_only_its_members(tmp_path):
    """A zip bomb (65 MiB of zeros deflated to 64 KiB) is refused, never expanded; a
    member outside the three is never read or written anywhere."""
    path = tmp_path / "tokenizer.model"
    path.write_bytes(_pair_archive(bytes(65 << 20)))
    assert path.stat().st_size < 1 << 20
    with pytest.raises(
        ValueError, match=r"\(its source.spm expands past 64 MiB\); import it again"
    ):
        tok.Tokenizer.load(path)
    path.write_bytes(_pair_archive(b"model", extra={"../../escaped.py": b"print(1)"}))
    with pytest.raises(ValueError, match="not a valid pair tokenizer"):  # not a real model
        tok.Tokenizer.load(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.model"]
    assert not (tmp_path.parent.parent / "escaped.py").exists()
    for pieces, unk in ((["a", 3], 0), (["a"], 5), ("abc", 0)):
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w") as z:
            z.writestr("pieces.json", json.dumps({"pieces": pieces, "unk_id": unk}))
            z.writestr("source.spm", b"x")
            z.writestr("target.spm", b"x")
        path.write_bytes(buffer.getvalue())
        with pytest.raises(ValueError, match="not a valid pair tokenizer"):
            tok.Tokenizer.load(path)


@pytest.mark.parametrize(
    "text, said",
    [
        ("[]", "the config is list, not a mapping of sections"),
        ('"model"', "the config is str, not a mapping of sections"),
        ("null", "the config is NoneType"),
        ('{"model": "dense"}', "the config's section 'model' is str, not a mapping of fields"),
        ('{"model": {"extensions": 5}}', "config.model.extensions=5 must be of type str"),
        ('{"model": {"d_model": [1, 2]}}', "config.model.d_model=[1, 2] must be of type int"),
        ('{"model": {}, "os": {"system": "rm"}}', "unknown sections ['os']"),
    ],
)
def test_a_runs_config_is_data_of_one_shape(tmp_path, text, said):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ckpt_lib.CheckpointError) as e:
        read_config(tmp_path)
    assert said in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', '{"entry": "a"}', '[{"entry": 1}]'])
def test_a_manifest_is_data_of_one_shape(tmp_path, text):
    (tmp_path / "config.json").write_text('{"model": {}}')
    (tmp_path / "extensions").mkdir()
    (tmp_path / "extensions" / "manifest.json").write_text(text)
    with pytest.raises(ckpt_lib.CheckpointError, match="manifest.json (holds|holds a record)"):
        read_config(tmp_path)


def test_the_other_json_files_of_a_run_and_a_sweep(tmp_path):
    (tmp_path / "corpus.json").write_text("[1]")
    with pytest.raises(CorpusError, match="corpus.json holds list, not the dict"):
        check_corpus(tmp_path, "files:x", "f" * 64)
    sweep = Sweep("configs/ende_small.py:debug", axes=(parse_axis("model.num_heads=1"),))
    folder = tmp_path / "sweep"
    folder.mkdir()
    (folder / "sweep.json").write_text('["config"]')
    with pytest.raises(SweepError, match="sweep.json holds list, not the dict"):
        _claim_folder(sweep, folder)
    (folder / "results.jsonl").write_text('{"run": "a", "status": "ok"}\n[1]\n')
    with pytest.raises(SweepError, match="a line of .*results.jsonl holds list"):
        _recorded(folder)


def test_a_checkpoint_of_another_model_restores_into_nothing(tmp_path):
    """Parameters saved by a larger model, found where a run's checkpoint should be:
    one line naming a parameter and both shapes; nothing of them is used."""
    from flaxformer_lite.config import ExperimentConfig
    from flaxformer_lite.inference.run import Run
    from flaxformer_lite.training.state import abstract_train_state

    small = {"model": {"vocab_size": 40, "d_model": 16, "num_heads": 2, "d_ff": 32,
                       "num_encoder_layers": 1, "num_decoder_layers": 1}}  # fmt: skip
    large = json.loads(json.dumps(small))
    large["model"]["vocab_size"] = 4000
    state = jax.tree.map(lambda x: jax.numpy.ones(x.shape, x.dtype), abstract_train_state(large))
    checkpoints = ckpt_lib.Checkpoints(tmp_path)
    checkpoints.save(3, state)
    checkpoints.close()
    (tmp_path / "config.json").write_text(ExperimentConfig.from_config(small).to_json())
    with pytest.raises(ckpt_lib.CheckpointError) as e:
        Run.open(tmp_path).params("last")
    said = str(e.value)
    assert "cannot be read" in said and "(4000, 16)" in said and "\n" not in said
