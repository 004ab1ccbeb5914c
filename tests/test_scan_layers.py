"""model.scan_layers: the layer stacks as one nn.scan. The same outputs and gradients as
the unrolled model with the same parameters (float64), parameters stacked along the
'layers' logical axis, checkpoints of either layout restored into the other (the
train state with Adam's moments, and the parameters alone), decoding unchanged, and
what cannot be scanned refused with the fix."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flaxformer_lite import ModelConfig, Transformer
from flaxformer_lite.config.model import ConfigError
from flaxformer_lite.inference import decoding
from flaxformer_lite.model.lm import LanguageModel
from flaxformer_lite.model.partitioning import logical_specs, unbox
from flaxformer_lite.training.state import TrainState, create_train_state
from flaxformer_lite.training.steps import train_step
from flaxformer_lite.workdir import checkpoints
from flaxformer_lite.workdir.layer_layout import switched

CFG = ModelConfig(
    vocab_size=24, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=3,
    num_decoder_layers=2, max_len=32, embedding_dropout=0.0, residual_dropout=0.0,
)  # fmt: skip
SRC = jnp.array([[5, 6, 7, 8, 1, 0, 0, 0], [9, 10, 11, 12, 13, 14, 1, 0]])
TGT = jnp.array([[20, 21, 22, 1, 0, 0], [3, 4, 5, 6, 7, 1]])


def _models(config, arch):
    cls = Transformer if arch == "translation" else LanguageModel
    return cls(config), cls(config.replace(scan_layers=True))


# ~15 s each: the slow tier; the default run keeps the float32 form below (the layout
# changes neither the initial parameters nor the first steps).
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["translation", "sparse lm"])
def test_scanned_equals_unrolled_in_float64(arch):
    # float64 end to end: the same operations in a loop; observed equal to ~1e-16, the
    # bound 1e-12 relative.
    with jax.enable_x64(True):
        config = CFG.replace(dtype="float64", param_dtype="float64")
        args = (SRC, TGT)
        if arch != "translation":  # the same sparse pattern in every layer
            config = config.replace(attention_pattern="local:window=3+global:first=1",
                                    attention_block_size=4)  # fmt: skip
            args = (jnp.concatenate([SRC, SRC], axis=1),)
        plain, scanned = _models(config, arch)
        params = unbox(plain.init(jax.random.key(0), *args))["params"]
        stacked, _ = switched(params)
        boxed = scanned.init(jax.random.key(0), *args)["params"]
        assert jax.tree.structure(unbox(boxed)) == jax.tree.structure(stacked)
        layers = boxed["decoder"]["layers"]["layer"]["ffn"]["wi"]["kernel"]
        assert tuple(logical_specs({"k": layers})["k"]) == ("layers", "embed", "mlp")

        def loss(model):
            return lambda p: jnp.sum(jnp.tanh(model.apply({"params": p}, *args)))

        want, grads = jax.jit(jax.value_and_grad(loss(plain)))(params)
        got, scan_grads = jax.jit(jax.value_and_grad(loss(scanned)))(stacked)
        np.testing.assert_allclose(got, want, rtol=1e-12)
        for g, r in zip(jax.tree.leaves(switched(scan_grads)[0]), jax.tree.leaves(grads),
                        strict=True):  # fmt: skip
            np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-14)


@pytest.mark.slow  # ~16 s: two trainings and restores
def test_checkpoints_restore_across_layouts(tmp_path):
    """A train state (parameters and Adam's moments) saved unrolled resumes scanned,
    and one saved scanned resumes unrolled; the best checkpoint's parameters alone
    too."""
    plain, scanned = _models(CFG, "translation")
    tx = optax.adam(1e-3)
    states = {}
    for name, model in (("plain", plain), ("scanned", scanned)):
        params = unbox(model.init(jax.random.key(0), SRC, TGT))["params"]
        states[name] = TrainState(
            step=jnp.int32(0), params=params, opt_state=tx.init(params),
            rng=jax.random.key_data(jax.random.key(0)),
        )  # fmt: skip
    trained = states["plain"].replace(
        params=jax.tree.map(lambda x: x + 1.0, states["plain"].params)
    )
    for saved, target in (("plain", "scanned"), ("scanned", "plain")):
        state = trained if saved == "plain" else trained.replace(
            params=switched(trained.params)[0], opt_state=switched(trained.opt_state)[0]
        )  # fmt: skip
        folder = tmp_path / saved
        ckpt = checkpoints.Checkpoints(folder, best_mode="min")
        ckpt.save(3, state, {"train_minutes": 1.0})
        ckpt.save_best(3, state, 0.5)
        ckpt.close()
        restored, data = checkpoints.Checkpoints(folder).restore(states[target])
        assert data["train_minutes"] == 1.0
        assert jax.tree.structure(restored.params) == jax.tree.structure(states[target].params)
        assert jax.tree.structure(restored.opt_state) == jax.tree.structure(
            states[target].opt_state
        )
        back = restored.params if target == "plain" else switched(restored.params)[0]
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(trained.params), strict=True):
            np.testing.assert_array_equal(a, b)
        target_params = jax.eval_shape(lambda t=target: states[t].params)
        best, step = checkpoints.restore_params(folder, target_params, kind="best")
        assert step == 3
        assert jax.tree.structure(best) == jax.tree.structure(states[target].params)
        best = best if target == "plain" else switched(best)[0]
        for a, b in zip(jax.tree.leaves(best), jax.tree.leaves(trained.params), strict=True):
            np.testing.assert_array_equal(a, b)  # arrays read, not the target's placeholders
        # A key the checkpoint lacks, in either layout: an error, not a placeholder.
        foreign = {**target_params, "extra": jax.ShapeDtypeStruct((3,), jnp.float32)}
        with pytest.raises(
            checkpoints.CheckpointError, match="parameters of another model: .* is missing"
        ):
            checkpoints.restore_params(folder, foreign, kind="best")


def test_a_scanned_model_decodes_as_the_unrolled_one():
    plain, scanned = _models(CFG, "translation")
    params = unbox(plain.init(jax.random.key(0), SRC, TGT))["params"]
    params = jax.tree.map(lambda x: x * 3.0, params)  # sharper: a decisive search
    kw = dict(max_length=8, eos_id=1, bos_id=2)
    ids = decoding.sample(plain, params, SRC, **kw)
    np.testing.assert_array_equal(decoding.sample(scanned, switched(params)[0], SRC, **kw), ids)
    beams, _ = decoding.beam_search(plain, params, SRC, beam_size=2, alpha=0.6, **kw)
    scan_beams, _ = decoding.beam_search(
        scanned, switched(params)[0], SRC, beam_size=2, alpha=0.6, **kw
    )
    np.testing.assert_array_equal(scan_beams, beams)


def test_what_cannot_be_scanned_is_refused():
    with pytest.raises(ConfigError, match="differs between layers"):
        CFG.replace(scan_layers=True, attention_pattern="bigbird", attention_block_size=4)
    with pytest.raises(ConfigError, match="differs between layers"):
        CFG.replace(scan_layers=True, attention_pattern="local:window=4|full")
    with pytest.raises(ConfigError, match="sow_attention_weights=False"):
        CFG.replace(scan_layers=True, sow_attention_weights=True)
    CFG.replace(scan_layers=True, remat="full", attention_pattern="local:window=4+full")


# ~8 s a case (two train steps compiled); 3 layers in the slow tier.
@pytest.mark.parametrize("layers", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_the_layout_changes_neither_the_initial_parameters_nor_the_steps(layers):
    """The same seed gives the same initial parameters and the same dropout masks,
    scanned (with remat: its recomputed masks too) or unrolled: the first steps' losses
    agree to float32 round-off. (Before, nn.scan split the keys per layer: another draw
    of both, a first loss 5.603 against 5.594 in the CLI's debug run.) Remat alone:
    tests/test_remat.py."""
    config = CFG.replace(
        num_encoder_layers=layers, num_decoder_layers=layers, embedding_dropout=0.1,
        residual_dropout=0.2, attention_dropout=0.1, ffn_dropout=0.1,
    )  # fmt: skip
    tx = optax.adam(1e-2)
    batch = {"inputs": SRC, "targets": TGT}
    runs = {}
    for name, variant in (("unrolled", {}), ("scanned", {"scan_layers": True, "remat": "full"})):
        model = Transformer(config.replace(**variant))
        state = create_train_state(model, tx, seed=3, length=8)
        initial = state.params if name == "unrolled" else switched(state.params)[0]
        step = jax.jit(functools.partial(
            train_step, model=model, tx=tx, schedule=lambda _: 1e-2, label_smoothing=0.1
        ))  # fmt: skip
        losses = []
        for _ in range(2):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        runs[name] = initial, losses
    want_params, want_losses = runs["unrolled"]
    for name, (params, losses) in runs.items():
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want_params), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)  # the same draws, exactly
        # The same operations compiled as a loop: float32 round-off, ~1e-7 relative per
        # operation (observed up to 3e-7); the old layouts differed by ~2e-3.
        np.testing.assert_allclose(losses, want_losses, rtol=2e-5, err_msg=name)
    assert want_losses[1] < want_losses[0]  # the steps train
