"""Before the first step: the workdir, the devices, the data, and stops asked for meanwhile.

``train_and_evaluate`` checks the workdir (writable, not another model's run), lays
the devices out (:func:`parallelism`), builds or reads the data (process 0 builds the
dataset and tokenizer, the others read them: :func:`prepare_data`), and honours a
SIGTERM or Ctrl-C that arrives meanwhile (:func:`stop_if_asked`): nothing to save, a
workdir this command created is removed, and the same command starts afresh.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from flaxformer_lite.config import extensions
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.mesh import MeshError
from flaxformer_lite.data import assembly, packing, pipeline
from flaxformer_lite.data.tokenizer import MODEL_NAME, Tokenizer
from flaxformer_lite.exchange import hf_import
from flaxformer_lite.exchange.export import REGISTERED, ExportError
from flaxformer_lite.model.build import attention_kernels
from flaxformer_lite.model.partitioning import check_model
from flaxformer_lite.training import distributed, preemption
from flaxformer_lite.training.parallel import Parallel
from flaxformer_lite.training.state import is_token_embedding
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.folder import read_config
from flaxformer_lite.workdir.tracker import WandbRun


class TrainingError(RuntimeError):
    """Training cannot go on; the message names the cause and the fix."""


# Fields a resumed run may change: where the data lives, how the same model is
# computed (its layers scanned or unrolled: checkpoints convert; recomputed or kept),
# and where its extensions' files are (their code is checked by SHA-256 instead).
HOW = ("data_dir", "scan_layers", "remat", "extensions")


def with_implicit_extensions(config: ExperimentConfig) -> ExperimentConfig:
    """``config`` with the user files whose registrations it uses added to
    ``model.extensions`` (a config file that imported its lab module itself), each with
    a note: the run keeps them, so every later command reads it as any other."""
    found = extensions.implicit(config.model)
    if not found:
        return config
    for file, what in found:
        print(f"note: model.extensions += {file} (it registers {what}, which the config uses; "
              "the run keeps it as if named)")  # fmt: skip
    names = extensions.entries(config.model.extensions) + [file for file, _ in found]
    return dataclasses.replace(config, model=config.model.replace(extensions=",".join(names)))


def check_workdir(config, workdir: location.Path) -> None:
    """Writable, and holding no other model's run (a clear error, never a shape crash)."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test.{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainingError(
            f"cannot write to --workdir={workdir} ({e.strerror or e}); choose a writable "
            + (
                "bucket, or grant this account write access to it"
                if location.is_remote(workdir)
                else "folder"
            )
        ) from e
    extensions.verify(config.model.extensions, workdir)  # a changed file, named as such
    previous = read_config(workdir)
    if previous is None:
        return
    previous, current = previous.to_dict(), config.to_dict()
    for section in ("model", "data"):
        old, new = previous.get(section, {}), current.get(section, {})
        differ = sorted(k for k in set(old) | set(new) if k not in HOW and old.get(k) != new.get(k))
        if differ:
            details = ", ".join(f"{section}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ)
            raise TrainingError(
                f"--workdir={workdir} holds a run of a different {section} ({details}); "
                "use a new --workdir, or the config that run was trained with"
            )


def stopped_before_training(
    e: preemption.StoppedBeforeTraining, workdir: location.Path, created: bool
) -> dict[str, float]:
    """A stop asked for while the run started: nothing to save; a workdir this call
    created is removed, so that the same command starts afresh."""
    step = ckpt_lib.steps(workdir)[-1] if workdir.is_dir() and ckpt_lib.steps(workdir) else 0
    if created and nothing_trained(workdir):
        storage.remove_tree(workdir)
    then = f"resumes from step {step}" if step else "starts afresh"
    print(
        f"stopped by {e}: nothing to save. The same command {then}: {preemption.resume_command()}",
        flush=True,
    )
    return {"step": step, "trained_steps": 0, "preempted": 1.0}


def stop_if_asked(stop: preemption.Preemption, phase: str, *, agreed: bool = False) -> None:
    """Raise StoppedBeforeTraining if a stop was asked for. With several processes only
    at the ``agreed`` point, where every process asks the chief (the others must not be
    left waiting in a barrier)."""
    if jax.process_count() > 1:
        asked = agreed and distributed.all_agree(stop.requested is not None)
    else:
        asked = stop.requested is not None
    if asked:
        raise preemption.StoppedBeforeTraining(stop.requested or "a peer's stop", phase)


def nothing_trained(workdir: location.Path) -> bool:
    """No checkpoint and no logged step: the run failed before training (its logs of
    a failure later on are kept)."""
    metrics = workdir / "metrics.jsonl"
    logged = metrics.exists() and metrics.stat().length > 0
    return not logged and not ckpt_lib.steps(workdir)


def describe(config: ExperimentConfig, par: Parallel, parameters: int) -> str:
    """The start-up lines: the model's size, where it runs, and (sparse attention or a
    fused kernel) which kernel runs each layer's attention."""
    c = config.model
    line = (
        f"model: {parameters:,} parameters; {par.num_devices} "
        f"{jax.devices()[0].platform} device(s) in {jax.process_count()} process(es), "
        f"parallelism={par.kind}"
        + (f", mesh {par.shape} (data x fsdp x model)" if par.kind == "jit" else "")
        + (f", remat={c.remat}" if c.remat != "none" else "")
    )
    if c.sparse_attention or c.attention_impl in ("cudnn", "splash"):
        line += "\n" + attention_kernels(c, config.data.task)
    return line


def open_tracker(config: ExperimentConfig, workdir: location.Path) -> WandbRun | None:
    """The run's W&B run (``train.wandb_project``; resumed by the id the workdir keeps,
    with the config), or None."""
    project = config.train.wandb_project
    return WandbRun(workdir, project, json.loads(config.to_json())) if project else None


def parallelism(config: ExperimentConfig) -> Parallel:
    """jit over the mesh (or pmap), checked against the model and the batch."""
    t = config.train
    try:
        par = Parallel(t.parallelism, t.mesh)
        if par.kind == "jit":
            check_model(par.mesh, config.model, t.batch_size)
        par.check_batch_size(t.batch_size, t.concurrent_splits)
    except (MeshError, ValueError) as e:
        raise TrainingError(str(e)) from None
    if t.batch_size % jax.process_count():
        raise TrainingError(f"train.batch_size={t.batch_size} must divide among processes")
    return par


def prepare_data(config: ExperimentConfig, workdir: location.Path) -> assembly.TrainingData:
    """Process 0 builds the dataset and trains the tokenizer; the others then read them."""
    data = assembly.prepare_data(config, workdir) if jax.process_index() == 0 else None
    distributed.barrier("tokenizer written")
    if data is None:
        data = assembly.prepare_data(config, workdir)
    if data.tokenizer is None:  # a generated task: ids already, checked by the assembly
        print(
            f"data: {len(data.train)} generated training and {len(data.validation)} "
            f"validation examples of {config.data.dataset}"
        )
        return data
    if data.tokenizer.vocab_size != config.model.vocab_size:
        raise TrainingError(
            f"the tokenizer in {workdir} has {data.tokenizer.vocab_size} pieces but "
            f"model.vocab_size={config.model.vocab_size}; use a new --workdir"
        )
    d, st = config.data, data.stats["train"]
    if st.examples == 0 and st.dropped_too_long:
        raise TrainingError(
            f"data.max_length={d.max_length} drops every training pair (all "
            f"{st.dropped_too_long} are longer in pieces, EOS included); raise "
            "data.max_length or set data.too_long=truncate"
        )
    if d.stream:
        print(
            f"data: running text in {st.examples} training and {len(data.validation)} "
            f"validation rows of {d.max_length} tokens ({st.dropped_empty} empty texts skipped)"
        )
    else:
        print(
            f"data: {st.examples} training pairs ({st.dropped_too_long} over {d.max_length} "
            f"tokens dropped, {st.truncated} truncated, {st.dropped_empty} empty skipped), "
            f"{len(data.validation)} validation pairs"
        )
    if data.train_pools:  # the count above holds every pool in full
        draws = " + ".join(f"{n} drawn in turn from {len(p)}" for p, n in data.train_pools)
        print(f"data: an epoch holds {len(data.train)} fixed pairs + {draws}")
    return data


def train_iterator(config: ExperimentConfig, data: assembly.TrainingData):
    t, d = config.train, config.data
    sampler = data.sampler(t.seed)
    resample = sampler
    if data.train_texts is not None:
        resample = pipeline.SubwordSampler(
            data.train_texts, data.train, data.tokenizer, d.subword_alpha, d.max_length, t.seed
        )
    return packing.train_iterator(
        sampler(0) if sampler else data.train,
        batch_size=t.batch_size // jax.process_count(),
        max_length=d.max_length,
        seed=t.seed,
        pack=d.pack,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        shards=d.shards,
        example_ids=t.log_examples,
        resample=resample,
    )


def ppmi_embedding_params(config, tokenizer: Tokenizer, params):
    """``params`` with every ``[vocab, d_model]`` token embedding table replaced by the
    PPMI co-occurrence vectors of :func:`~flaxformer_lite.data.assembly.ppmi_table`."""
    vocab, dim = config.model.vocab_size, config.model.d_model
    table = assembly.ppmi_table(config, tokenizer)
    replaced = []

    def replace(path, leaf):
        if is_token_embedding(path) and leaf.shape == (vocab, dim):
            replaced.append(jax.tree_util.keystr(path))
            return jnp.asarray(table, leaf.dtype)
        return leaf

    params = jax.tree_util.tree_map_with_path(replace, params)
    print(f"embeddings: PPMI vectors in {', '.join(replaced) or 'no table'}")
    return params


def _imported(config: ExperimentConfig) -> hf_import.Imported:
    """``train.init_from``'s model, read once per start (its fields, tokenizer and
    weights are asked for at three points; an OPUS-MT model is ~300 MB)."""
    where = Path(config.train.init_from.removeprefix("hf:"))
    try:
        stamp = (where / "config.json").stat().st_mtime_ns
    except OSError:
        stamp = None  # read_marian says what is missing
    try:
        return _read_once(str(where), stamp)
    except (ExportError, OSError) as e:
        raise TrainingError(f"train.init_from={config.train.init_from}: {e}") from None


@functools.lru_cache(maxsize=1)
def _read_once(where: str, stamp: int | None) -> hf_import.Imported:
    return hf_import.read_marian(where)


def with_imported_model(config: ExperimentConfig, workdir: location.Path) -> ExperimentConfig:
    """``config`` with the model fields of ``train.init_from``'s model (architecture,
    special ids, epsilon, logits bias); the config's other fields (dropout, attention
    pattern, precision, ...) stay, so every ablation runs on the imported weights. A
    run that imported it already takes them from its own config (the folder it came
    from may be gone)."""
    if not config.train.init_from:
        return config
    c = config.model
    for field, standard, _, _ in REGISTERED[:3]:  # blocks that hold Marian's weights
        if getattr(c, field) != standard:
            raise TrainingError(
                f"train.init_from={config.train.init_from}: model.{field}="
                f"{getattr(c, field)!r} cannot hold a Marian model's weights (its blocks are "
                f"model.{field}={standard!r}); drop model.{field}, or train without init_from"
            )
    previous = read_config(workdir) if (workdir / "config.json").is_file() else None
    if previous is not None and previous.train.init_from == config.train.init_from:
        imported = previous.model
    else:
        imported = _imported(config).config
    fields = {name: getattr(imported, name) for name in hf_import.IMPORTED_FIELDS}
    changed = [f"{k}={v!r}" for k, v in fields.items() if getattr(config.model, k) != v]
    if changed:
        print(f"model: from {config.train.init_from}: {', '.join(changed)}")
    train = config.train
    if train.embedding_init != "random":  # the embeddings are the imported model's
        print(f"train.embedding_init={train.embedding_init!r} not applied: init_from sets them")
        train = train.replace(embedding_init="random")
    return dataclasses.replace(config, model=config.model.replace(**fields), train=train)


def write_imported_tokenizer(config: ExperimentConfig, workdir: location.Path) -> None:
    """The imported model's tokenizer as the run's (written once, atomically)."""
    if not config.train.init_from or jax.process_index() != 0:
        return
    if (workdir / MODEL_NAME).exists() and ckpt_lib.steps(workdir):
        return  # imported before: the run's own, checked against its data later
    tokenizer = _imported(config).tokenizer
    if tokenizer is None:
        raise TrainingError(
            f"train.init_from={config.train.init_from}: the folder has no tokenizer "
            "(source.spm, target.spm, vocab.json); save the model with its MarianTokenizer"
        )
    d = config.data
    for name, tag in (("aux_tag", d.aux_tag), ("reverse_tag", d.reverse_tag)):
        if tag and tag not in tokenizer.pieces:
            raise TrainingError(
                f"data.{name}={tag!r} is no piece of {config.train.init_from}'s vocabulary "
                f"(its model never saw the tag); set --config.data.{name}=''"
            )
    data, path = tokenizer.to_bytes(), workdir / MODEL_NAME
    if path.exists():
        if path.read_bytes() != data:
            raise TrainingError(
                f"{path} is not the tokenizer of {config.train.init_from}; use a new --workdir"
            )
        return
    storage.write_atomic(path, data)


def imported_params(config: ExperimentConfig, params):
    """``params`` replaced by ``train.init_from``'s (same tree, shapes and dtypes)."""
    new = _imported(config).params
    flat_new = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(new)}
    flat_old = jax.tree_util.tree_leaves_with_path(params)
    missing = sorted({jax.tree_util.keystr(p) for p, _ in flat_old} - set(flat_new))
    extra = sorted(set(flat_new) - {jax.tree_util.keystr(p) for p, _ in flat_old})
    if missing or extra:
        raise TrainingError(
            f"train.init_from={config.train.init_from} does not fit this model: "
            + (f"it has no {missing[0]}" if missing else f"this model has no {extra[0]}")
            + " (a model option that adds or drops parameters; leave it at its default)"
        )

    def replace(path, leaf):
        value = np.asarray(flat_new[jax.tree_util.keystr(path)])
        if value.shape != leaf.shape:
            raise TrainingError(
                f"train.init_from: {jax.tree_util.keystr(path)} is {value.shape} there, "
                f"{leaf.shape} here"
            )
        return jnp.asarray(value, leaf.dtype)

    print(f"model: parameters from {config.train.init_from}")
    return jax.tree_util.tree_map_with_path(replace, params)
