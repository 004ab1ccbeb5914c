"""The peer we measure ourselves against: google/flax's ``examples/wmt`` Transformer.

Its ``models.py`` and ``decode.py`` come from the source distribution of the flax
version installed here (``pip download flax==<version> --no-binary :all: --no-deps``),
extracted once into ``benchmarks/.peer/flax-<version>/`` (git-ignored; nothing of it is
committed) and imported from there as ``wmt_models`` / ``wmt_decode``.

Its ``train.py`` imports TensorFlow and clu, so it is not imported: :func:`train_step`
below does what its ``train_step`` does on one device (the weighted, label-smoothed
cross entropy with its normalizing constant, ``value_and_grad``, ``apply_gradients``
on a flax ``TrainState`` with ``optax.adamw(b1=0.9, b2=0.98, eps=1e-9,
weight_decay=0)`` under the rsqrt schedule with linear warm-up, loss/accuracy/
denominator metrics and the learning rate), jitted with the state donated as its
``jax.pmap`` is. Decoding uses the peer's own cache (``decode=True``), its
``Transformer.encode``/``decode`` methods and ``decode.beam_search``.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import flax
import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

from flaxformer_lite.config.model import ModelConfig

CACHE = Path(__file__).resolve().parent / ".peer"
FILES = ("models.py", "decode.py")


def source_dir(version: str = flax.__version__) -> Path:
    """``examples/wmt`` of flax ``version``, downloaded and extracted on first use."""
    target = CACHE / f"flax-{version}" / "examples" / "wmt"
    if all((target / f).exists() for f in FILES):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        print(f"fetching flax {version}'s source distribution (examples/wmt) ...", flush=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"flax=={version}", "--no-binary",
             ":all:", "--no-deps", "-q", "-d", tmp],
            capture_output=True, text=True,
        )  # fmt: skip
        archives = list(Path(tmp).glob("flax-*.tar.gz"))
        cached = sorted(CACHE.glob("flax-*/examples/wmt/models.py"))
        if not archives and cached:  # offline (an accelerator machine): the one brought along
            other = cached[-1].parent
            print(f"no package index: using {other.relative_to(CACHE)} instead", flush=True)
            return other
        if not archives:
            raise SystemExit(
                f"error: could not download flax=={version}'s source distribution "
                f"(pip said: {done.stderr.strip().splitlines()[-1:] or done.returncode}); "
                "the peer benchmark needs the package index"
            )
        target.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archives[0]) as tar:
            for name in FILES:
                member = tar.getmember(f"flax-{version}/examples/wmt/{name}")
                (target / name).write_bytes(tar.extractfile(member).read())
    return target


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.cache
def modules():
    """(models, decode) of the peer."""
    src = source_dir()
    return _load("wmt_models", src / "models.py"), _load("wmt_decode", src / "decode.py")


def config(
    c: ModelConfig,
    *,
    dropout: float = 0.1,
    attention_dropout: float | None = None,
    decode: bool = False,
    deterministic=False,
):
    """The peer's TransformerConfig of our ``c``'s shape and compute dtype (shared
    embeddings, logits via the embedding, as its default config trains); attention
    dropout = ``dropout`` unless given."""
    models, _ = modules()
    if c.num_encoder_layers != c.num_decoder_layers:
        raise ValueError("the peer has one layer count for encoder and decoder")
    return models.TransformerConfig(
        vocab_size=c.vocab_size,
        output_vocab_size=c.vocab_size,
        share_embeddings=True,
        logits_via_embedding=True,
        emb_dim=c.d_model,
        num_heads=c.num_heads,
        num_layers=c.num_encoder_layers,
        qkv_dim=c.d_model,
        mlp_dim=c.d_ff,
        max_len=c.max_len,
        dropout_rate=dropout,
        attention_dropout_rate=dropout if attention_dropout is None else attention_dropout,
        dtype=c.compute_dtype,
        deterministic=deterministic,
        decode=decode,
    )


def rsqrt_schedule(learning_rate: float = 0.002, warmup_steps: int = 1000):
    """The peer's schedule: linear warm-up, then learning_rate * sqrt(warmup / step)."""
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, learning_rate, warmup_steps),
            lambda count: learning_rate * jnp.sqrt(warmup_steps / (count + warmup_steps)),
        ],
        boundaries=[warmup_steps],
    )


def create_state(c: ModelConfig, length: int, seed: int = 0):
    """The peer's TrainState (as its train.py builds it) and its schedule."""
    models, _ = modules()
    schedule = rsqrt_schedule()
    tx = optax.adamw(schedule, b1=0.9, b2=0.98, eps=1e-9, weight_decay=0.0)
    apply = models.Transformer(config(c, deterministic=True)).apply
    params = init_params(c, length, seed)
    return train_state.TrainState.create(apply_fn=apply, params=params, tx=tx), schedule


def _cross_entropy(logits, targets, weights, label_smoothing):
    """The peer's weighted cross entropy: smoothed one-hot targets minus the entropy of
    the smoothed distribution (so a perfect model scores 0)."""
    vocab = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = (1.0 - confidence) / (vocab - 1)
    constant = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    soft = jax.nn.one_hot(targets, vocab) * (confidence - low) + low
    loss = -jnp.sum(soft * nn.log_softmax(logits), axis=-1) - constant
    return (loss * weights).sum(), weights.sum()


def train_step(
    state, batch, dropout_rng, *, c: ModelConfig, schedule, label_smoothing=0.1, **overrides
):
    """One step as the peer's ``train.train_step`` does it (one device, no pmean);
    ``overrides``: of :func:`config` (dropout, attention_dropout)."""
    models, _ = modules()
    model = models.Transformer(config(c, **overrides))
    targets = batch["targets"]
    weights = jnp.where(targets > 0, 1, 0).astype(jnp.float32)
    rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = model.apply(
            {"params": params},
            batch["inputs"],
            targets,
            inputs_positions=batch["inputs_positions"],
            targets_positions=batch["targets_positions"],
            inputs_segmentation=batch["inputs_segment_ids"],
            targets_segmentation=batch["targets_segment_ids"],
            rngs={"dropout": rng},
        )
        loss, total = _cross_entropy(logits, targets, weights, label_smoothing)
        return loss / total, logits

    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    loss, total = _cross_entropy(logits, targets, weights, 0.0)
    accuracy = (jnp.equal(jnp.argmax(logits, -1), targets) * weights).sum()
    metrics = {
        "loss": loss,
        "accuracy": accuracy,
        "denominator": total,
        "learning_rate": schedule(state.step),
    }
    return new_state, metrics


def compiled_train_step(c: ModelConfig, length: int, **overrides):
    """(jitted step(state, batch), state, dropout key) for the peer."""
    state, schedule = create_state(c, length)
    fn = jax.jit(
        functools.partial(train_step, c=c, schedule=schedule, **overrides), donate_argnums=(0,)
    )
    return fn, state, jax.random.key(1)


def _decoder(c: ModelConfig, params, inputs, beams: int):
    """tokens_to_logits over the peer's cached decoder for ``beams`` copies of each row."""
    models, decode = modules()
    model = models.Transformer(config(c, decode=True, deterministic=True))
    encoded = decode.flat_batch_beam_expand(
        model.apply({"params": params}, inputs, method=models.Transformer.encode), beams
    )
    raw = decode.flat_batch_beam_expand(inputs, beams)

    def tokens_to_logits(ids, cache):
        logits, new = model.apply(
            {"params": params, "cache": cache},
            encoded,
            raw,
            ids,
            mutable=["cache"],
            method=models.Transformer.decode,
        )
        return logits.squeeze(axis=1), new["cache"]

    return model, tokens_to_logits


def init_cache(c: ModelConfig, batch: int, source: int, max_len: int):
    models, _ = modules()
    model = models.Transformer(config(c, decode=True, deterministic=True))
    return model.init(jax.random.key(0), jnp.ones((batch, source)), jnp.ones((batch, max_len)))[
        "cache"
    ]


def beam_search(c: ModelConfig, params, inputs, *, beam_size=4, alpha=0.6, eos_id, max_len):
    """The peer's ``predict_step``: its beam search over its cached decoder, ``max_len``
    new tokens (its sequences start with a dummy 0, hence ``max_len + 1`` slots)."""
    _, decode = modules()
    _, step = _decoder(c, params, inputs, beam_size)
    cache = init_cache(c, inputs.shape[0], inputs.shape[1], max_len + 1)  # beam_search expands it
    seqs, _ = decode.beam_search(
        inputs, cache, step, beam_size=beam_size, alpha=alpha, eos_id=eos_id,
        max_decode_len=max_len + 1,
    )  # fmt: skip
    return seqs[:, -1, 1:]


def greedy(c: ModelConfig, params, inputs, *, max_len):
    """Greedy decoding over the peer's cached decoder (its example decodes only by beam
    search; this is the plain loop a user of it writes: argmax, feed back, max_len steps)."""
    _, step = _decoder(c, params, inputs, 1)
    cache = init_cache(c, inputs.shape[0], inputs.shape[1], max_len)

    def body(carry, _):
        ids, cache = carry
        logits, cache = step(ids, cache)
        nxt = jnp.argmax(logits, -1).astype(jnp.int32)[:, None]
        return (nxt, cache), nxt[:, 0]

    start = jnp.zeros((inputs.shape[0], 1), jnp.int32)
    _, out = jax.lax.scan(body, (start, cache), None, length=max_len)
    return out.T


def init_params(c: ModelConfig, length: int, seed: int = 0):
    models, _ = modules()
    model = models.Transformer(config(c, deterministic=True))
    shape = (1, length)
    return jax.jit(model.init)(jax.random.key(seed), jnp.ones(shape), jnp.ones(shape))["params"]


if __name__ == "__main__":
    print(f"the peer (flax {flax.__version__} examples/wmt): {source_dir()}")
