"""The (data, fsdp, model) mesh on 8 simulated CPU devices: every mesh trains like one
device, parameters are laid out as the rules say, and checkpoints move between meshes."""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from flaxformer_lite.config import mesh as mesh_spec
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.mesh import MeshError
from flaxformer_lite.config.model import ModelConfig
from flaxformer_lite.data import packing
from flaxformer_lite.model import partitioning
from flaxformer_lite.model.transformer import Transformer
from flaxformer_lite.training.parallel import Parallel
from flaxformer_lite.training.state import (
    abstract_train_state,
    create_train_state,
    make_optimizer,
    state_partitioning,
)
from flaxformer_lite.training.steps import train_step
from flaxformer_lite.training.train import TrainingError, train_and_evaluate
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from tests import fixtures
from tests.fixtures import debug_config, load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Eight heads, so that the model axis can take all eight devices; dropout on, so that
# the dropout draws are checked to be the same whatever the layout.
MODEL = ModelConfig(
    vocab_size=64,
    d_model=32,
    num_heads=8,
    d_ff=64,
    num_encoder_layers=1,
    num_decoder_layers=1,
    max_len=32,
)


def _setup(mesh: str, devices=None):
    """(Parallel, compiled step, sharded state, batches) of the tiny model on ``mesh``."""
    config = load_config()
    tx, schedule = make_optimizer(config.optimizer, MODEL, 100)
    model = Transformer(MODEL)
    par = Parallel("jit", mesh, devices=devices)
    partitioning.check_model(par.mesh, MODEL, 16)
    par.lay_out(*state_partitioning(model, tx, 16))
    state = create_train_state(model, tx, 0, 16, par.state_shardings)
    step = par.train_step(train_step, model=model, tx=tx, schedule=schedule, label_smoothing=0.1)
    examples = [
        {
            "inputs": np.array([5 + i % 40, 6, 7 + i % 3, 1], np.int32),
            "targets": np.array([8, 9 + i % 30, 10 + i % 7, 1], np.int32),
        }
        for i in range(200)
    ]
    it = packing.train_iterator(examples, batch_size=16, max_length=16, seed=0, prefetch=0)
    return par, step, state, [next(it) for _ in range(5)]


def _train(mesh: str, devices=None):
    par, step, state, batches = _setup(mesh, devices)
    losses = []
    for batch in batches:
        state, metrics = step(state, par.put_batch(batch))
        losses.append(par.metrics_to_host(metrics)["loss"])
    return losses, jax.device_get(state.params)


@functools.cache
def _one_device():
    return _train("data:1", devices=jax.devices()[:1])


# 8x1x1 is also pmap == jit's layout (tests/test_steps.py); it and 4x1x2 run with
# `make test-all`, the meshes that shard parameters in every run.
@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param("data:8", id="8x1x1", marks=pytest.mark.slow),
        pytest.param("data:1,fsdp:8", id="1x8x1"),
        pytest.param("data:1,model:8", id="1x1x8", marks=pytest.mark.slow),
        pytest.param("data:2,fsdp:2,model:2", id="2x2x2"),
        pytest.param("data:4,model:2", id="4x1x2", marks=pytest.mark.slow),
    ],
)
def test_every_mesh_trains_like_one_device(mesh):
    assert jax.device_count() == 8, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    want_losses, want_params = _one_device()
    losses, params = _train(mesh)
    # The same float32 sums in another grouping over devices: round-off of order
    # epsilon (1.2e-7) times the reduction depth, a few steps in, far below 1e-5.
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    flat = dict(jax.tree_util.tree_flatten_with_path(want_params)[0])
    compared, worst = 0, 0.0
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        if name.endswith("['key']['bias']"):
            # Its true gradient is exactly zero (q.b_k shifts a whole softmax row); each
            # layout rounds to a different ~1e-9, which Adam (eps 1e-9) makes a full step.
            continue
        # Relative to the tensor: an element whose Adam step divides two roundings of ~0
        # (|g| ~ sqrt(v)) may move by ~1e-5 of the tensor's scale in either layout.
        error = np.linalg.norm(np.asarray(x) - flat[path]) / np.linalg.norm(flat[path])
        assert error <= 1e-5, (name, error)
        worst = max(worst, error)
        compared += 1
    assert compared > 30
    print(f"{mesh}: worst relative parameter error {worst:.1e}")


def test_parameters_are_laid_out_as_the_rules_say():
    """The arrays themselves, not the rules: on 2x2x2 the query kernel [m, h, d] holds a
    quarter of m... no: half of m (fsdp) and half of the heads (model) per device."""
    par, _, state, _ = _setup("data:2,fsdp:2,model:2")
    layer = state.params["encoder"]["layer_0"]
    expect = {
        "query kernel": (layer["self_attention"]["query"]["kernel"], P("fsdp", "model")),
        "out kernel": (layer["self_attention"]["out"]["kernel"], P("model", None, "fsdp")),
        "ffn wi": (layer["ffn"]["wi"]["kernel"], P("fsdp", "model")),
        "ffn wo": (layer["ffn"]["wo"]["kernel"], P("model", "fsdp")),
        "embedding": (state.params["shared_embedding"]["embedding"], P("model", "fsdp")),
        "norm scale": (layer["ffn_norm"]["scale"], P("fsdp")),
    }
    for name, (array, spec) in expect.items():
        assert array.sharding.spec == spec, name
        full = np.array(array.shape)
        shard = np.array(array.addressable_shards[0].data.shape)
        split = [2 if i < len(spec) and spec[i] is not None else 1 for i in range(len(full))]
        assert list(full // shard) == split, name
    # The query kernel: each device holds d_model/2 x heads/2 x d_k.
    q = layer["self_attention"]["query"]["kernel"]
    assert q.addressable_shards[0].data.shape == (16, 4, 4)
    # Adam's moments are laid out like their parameters; its count is replicated.
    adam = state.opt_state
    mu = jax.tree_util.tree_flatten_with_path(adam)[0]
    moments = [x for path, x in mu if jax.tree_util.keystr(path).endswith("['query']['kernel']")]
    assert moments and all(m.sharding.spec == P("fsdp", "model") for m in moments)
    assert state.step.sharding.spec == P() and state.rng.sharding.spec == P()
    # Batches are split over data x fsdp.
    assert par.batch_sharding.spec == P(("data", "fsdp"))


def test_mesh_errors_name_the_value_and_the_fix():
    with pytest.raises(MeshError, match="only one axis may be -1"):
        mesh_spec.parse_mesh("data:-1,model:-1")
    with pytest.raises(MeshError, match="'tensor:2' is not 'axis:size'"):
        mesh_spec.parse_mesh("data:-1,tensor:2")
    with pytest.raises(MeshError, match="has 6 devices but 8 are present"):
        mesh_spec.mesh_shape("data:3,model:2", 8)
    with pytest.raises(MeshError, match=r"fixed axes \(3 devices\) do not divide the 8"):
        mesh_spec.mesh_shape("data:-1,model:3", 8)
    assert mesh_spec.mesh_shape("data:-1,fsdp:2", 8) == (4, 2, 1)
    assert mesh_spec.mesh_shape("", 8) == (8, 1, 1)
    assert mesh_spec.mesh_shape("model:2", 8) == (4, 1, 2)
    mesh = partitioning.make_mesh("data:2,model:4")
    with pytest.raises(MeshError, match=r"model.num_heads=2 is not divisible by the model axis"):
        partitioning.check_model(mesh, MODEL.replace(num_heads=2), 16)
    with pytest.raises(MeshError, match=r"train.batch_size=3 is not divisible by the 2"):
        partitioning.check_model(mesh, MODEL, 3)
    with pytest.raises(MeshError, match="parallelism=pmap replicates"):
        Parallel("pmap", "data:4,fsdp:2")


def test_a_bad_mesh_is_a_config_error_before_any_data(tmp_path):
    config = load_config()
    config.train.mesh = "data:2;model:4"
    with pytest.raises(Exception, match="train.mesh='data:2;model:4'"):
        ExperimentConfig.from_config(config)
    config = debug_config(tmp_path / "no-data", mesh="data:1,model:8")  # 2 heads
    with pytest.raises(TrainingError, match="model.num_heads=2 is not divisible"):
        train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_checkpoints_move_between_meshes(fixture_data, tmp_path):
    """A run on 2x2x2 resumes on 8x1x1 and on 1x1x8-less 4x1x2, restores on one device,
    and translate / evaluate / average read it in a one-device process."""
    raw, data_dir = fixture_data
    workdir = tmp_path / "run"
    train_and_evaluate(debug_config(data_dir, num_steps=3, mesh="data:2,fsdp:2,model:2"), workdir)
    config = debug_config(data_dir)
    target = abstract_train_state(config)
    one, _ = ckpt_lib.Checkpoints(workdir).restore(target, 3)
    assert all(len(x.sharding.device_set) == 1 for x in jax.tree.leaves(one))
    # Restored onto another mesh with target shardings: the same values.
    model_config = ExperimentConfig.from_config(config)
    from flaxformer_lite.model.build import build_model

    model = build_model(model_config.model, "translation")
    tx, _ = make_optimizer(model_config.optimizer, model_config.model, 6)
    par = Parallel("jit", "data:8")
    par.lay_out(*state_partitioning(model, tx, model_config.data.max_length))
    sharded_target = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        target,
        par.state_shardings,
    )
    eight, _ = ckpt_lib.Checkpoints(workdir).restore(sharded_target, 3)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(eight), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert eight.params["shared_embedding"]["embedding"].sharding.mesh.shape["data"] == 8
    # Resume on another mesh: trains on from step 3.
    metrics = train_and_evaluate(
        debug_config(data_dir, num_steps=6, mesh="data:4,model:2"), workdir
    )
    assert metrics["step"] == 6 and metrics["trained_steps"] == 3
    # One device, another process: average, evaluate, translate (the library calls the
    # commands make; their command lines are tested in test_translate/test_resume).
    env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=fixtures.xla_flags(1))
    out = subprocess.run(
        [sys.executable, "-c", ONE_DEVICE_READER, str(workdir)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["devices"] == 1
    assert result["averaged"] == [6, [3, 6], "averaged checkpoint, step 6"]
    assert np.isfinite(result["bleu"]) and result["translations"] == 1


ONE_DEVICE_READER = """
import json, sys
import jax
from flaxformer_lite.inference.average import average_workdir
from flaxformer_lite.inference.evaluation import evaluate_workdir
from flaxformer_lite.inference.translate import Translator
workdir = sys.argv[1]
step, steps = average_workdir(workdir, 2, window=1.0, validate=False)
averaged = Translator.from_workdir(workdir, kind="averaged")
scores = evaluate_workdir(workdir, "test", limit=4, beam_size=1)
print(json.dumps({
    "devices": jax.device_count(),
    "averaged": [step, steps, averaged.checkpoint],
    "bleu": scores.bleu,
    "translations": len(averaged.translate(["a house"], beam_size=1)),
}))
"""
