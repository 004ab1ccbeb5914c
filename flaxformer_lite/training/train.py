"""``train_and_evaluate(config, workdir)``: the whole training run, importable from Colab.

config -> validation -> data (TFDS -> tokenizer -> packed grain batches) ->
jitted/pmapped train step -> metrics, evaluation, checkpoints. Re-running with
the same workdir resumes from its latest checkpoint (same data order, same
dropout randomness) after checking that the workdir holds the same model.
"""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from flaxformer_lite.config.experiment import BEST_METRICS, ExperimentConfig
from flaxformer_lite.config.mesh import MeshError
from flaxformer_lite.data import assembly, pipeline
from flaxformer_lite.data.tokenizer import Tokenizer
from flaxformer_lite.inference.evaluation import corpus_scores
from flaxformer_lite.inference.translate import Translator
from flaxformer_lite.model.build import build_model
from flaxformer_lite.model.partitioning import check_model
from flaxformer_lite.training import distributed, flops, losses, preemption, schedules
from flaxformer_lite.training.logging import MetricsLogger
from flaxformer_lite.training.parallel import Parallel
from flaxformer_lite.training.state import (
    TrainState,
    create_train_state,
    evaluation_params,
    is_token_embedding,
    make_optimizer,
    parameter_count,
    state_partitioning,
)
from flaxformer_lite.training.steps import eval_step, train_step
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir.folder import read_config, write_config
from flaxformer_lite.workdir.lock import WorkdirBusyError, WorkdirLock


class TrainingError(RuntimeError):
    """Training cannot go on; the message names the cause and the fix."""


def _check_workdir(config, workdir: Path) -> None:
    """Writable, and holding no other model's run (a clear error, never a shape crash)."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_test.{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise TrainingError(
            f"cannot write to --workdir={workdir} ({e.strerror}); choose a writable folder"
        ) from e
    previous = read_config(workdir)
    if previous is None:
        return
    previous, current = previous.to_dict(), config.to_dict()
    for section in ("model", "data"):
        old, new = previous.get(section, {}), current.get(section, {})
        differ = sorted(
            k for k in set(old) | set(new) if k != "data_dir" and old.get(k) != new.get(k)
        )
        if differ:
            details = ", ".join(f"{section}.{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ)
            raise TrainingError(
                f"--workdir={workdir} holds a run of a different {section} ({details}); "
                "use a new --workdir, or the config that run was trained with"
            )


def _evaluate(p_eval, par: Parallel, state, batches) -> dict[str, float]:
    total = None
    params = evaluation_params(state)
    for batch in batches:
        s = p_eval(params, par.put_batch(batch))
        s = par.unreplicate(s)
        total = s if total is None else jax.tree.map(lambda a, b: a + b, total, s)
    return {k: float(v) for k, v in losses.summarize(jax.device_get(total)).items()}


def train_and_evaluate(config, workdir: str | Path) -> dict[str, float]:
    """Train ``config`` in ``workdir`` (resuming if it holds a checkpoint).

    Returns the final validation metrics (loss, nll, perplexity, accuracy, and bleu
    where measured) with ``step`` (the step the run stopped at), ``trained_steps``
    (steps taken by this call: 0 when a finished run is re-run) and ``budget_reached``
    (1.0 when ``train.max_minutes`` stopped it before ``train.num_steps``, else 0.0).
    """
    # SIGTERM / Ctrl-C from here on: before the first step, stop with nothing to save;
    # after it, finish the step, checkpoint, then stop.
    stop = preemption.Preemption().install()
    workdir = Path(workdir)
    created = not workdir.exists() and jax.process_index() == 0
    try:
        config = ExperimentConfig.from_config(config)  # checked before any data is read
        config.model.check_precision()  # float64 needs x64 on
        wall_start = time.perf_counter()
        _check_workdir(config, workdir)
        with WorkdirLock(workdir, enabled=jax.process_index() == 0):
            return _train(config, workdir, wall_start, stop)
    except preemption.StoppedBeforeTraining as e:
        return _stopped_before_training(e, workdir, created)
    except WorkdirBusyError as e:
        raise TrainingError(str(e)) from None
    except BaseException:
        if created and _nothing_trained(workdir):  # a bad config or corpus: leave no trace
            shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        stop.restore()


def _stopped_before_training(
    e: preemption.StoppedBeforeTraining, workdir: Path, created: bool
) -> dict[str, float]:
    """A stop asked for while the run started: nothing to save; a workdir this call
    created is removed, so that the same command starts afresh."""
    step = ckpt_lib.steps(workdir)[-1] if workdir.is_dir() and ckpt_lib.steps(workdir) else 0
    if created and _nothing_trained(workdir):
        shutil.rmtree(workdir, ignore_errors=True)
    then = f"resumes from step {step}" if step else "starts afresh"
    print(
        f"stopped by {e}: nothing to save. The same command {then}: {preemption.resume_command()}",
        flush=True,
    )
    return {"step": step, "trained_steps": 0, "preempted": 1.0}


def _stop_if_asked(stop: preemption.Preemption, phase: str, *, agreed: bool = False) -> None:
    """Raise StoppedBeforeTraining if a stop was asked for. With several processes only
    at the ``agreed`` point, where every process asks the chief (the others must not be
    left waiting in a barrier)."""
    if jax.process_count() > 1:
        asked = agreed and distributed.all_agree(stop.requested is not None)
    else:
        asked = stop.requested is not None
    if asked:
        raise preemption.StoppedBeforeTraining(stop.requested or "a peer's stop", phase)


def _nothing_trained(workdir: Path) -> bool:
    """No checkpoint and no logged step: the run failed before training (its logs of
    a failure later on are kept)."""
    metrics = workdir / "metrics.jsonl"
    logged = metrics.exists() and metrics.stat().st_size > 0
    return not logged and not ckpt_lib.steps(workdir)


def _train(
    config: ExperimentConfig, workdir: Path, wall_start: float, stop: preemption.Preemption
) -> dict[str, float]:
    model_config = config.model
    _stop_if_asked(stop, "while starting")
    t, d = config.train, config.data
    try:
        par = Parallel(t.parallelism, t.mesh)
        if par.kind == "jit":
            check_model(par.mesh, model_config, t.batch_size)
        par.check_batch_size(t.batch_size)
    except (MeshError, ValueError) as e:
        raise TrainingError(str(e)) from None
    per_device = t.batch_size // jax.local_device_count()
    if par.kind == "pmap" and per_device % t.concurrent_splits:
        raise TrainingError(
            f"train.concurrent_splits={t.concurrent_splits} does not divide the {per_device} "
            f"rows each device gets (train.batch_size={t.batch_size}); pick a divisor"
        )
    if t.batch_size % jax.process_count():
        raise TrainingError(f"train.batch_size={t.batch_size} must divide among processes")
    is_chief = jax.process_index() == 0
    if is_chief:
        write_config(workdir, config.to_json())

    # Process 0 builds the dataset and trains the tokenizer; the others then read them.
    data = assembly.prepare_data(config, workdir) if is_chief else None
    distributed.barrier("tokenizer written")
    if data is None:
        data = assembly.prepare_data(config, workdir)
    _stop_if_asked(stop, "while preparing the data")
    if data.tokenizer.vocab_size != model_config.vocab_size:
        raise TrainingError(
            f"the tokenizer in {workdir} has {data.tokenizer.vocab_size} pieces but "
            f"model.vocab_size={model_config.vocab_size}; use a new --workdir"
        )
    st = data.stats["train"]
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

    model = build_model(model_config, d.task)
    tx, schedule = make_optimizer(config.optimizer, model_config, t.num_steps)
    par.lay_out(*state_partitioning(model, tx, d.max_length))
    state = create_train_state(model, tx, t.seed, d.max_length, par.state_shardings)
    print(
        f"model: {parameter_count(state.params):,} parameters; {par.num_devices} "
        f"{jax.devices()[0].platform} device(s) in {jax.process_count()} process(es), "
        f"parallelism={par.kind}"
        + (f", mesh {par.shape} (data x fsdp x model)" if par.kind == "jit" else "")
    )
    sampler = data.sampler(t.seed)
    iterator = pipeline.train_iterator(
        sampler(0) if sampler else data.train,
        batch_size=t.batch_size // jax.process_count(),
        max_length=d.max_length,
        seed=t.seed,
        pack=d.pack,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        shards=d.shards,
        example_ids=t.log_examples,
        resample=pipeline.SubwordSampler(
            data.train_texts, data.train, data.tokenizer, d.subword_alpha, d.max_length, t.seed
        )
        if data.train_texts is not None
        else sampler,
    )
    checkpoints = ckpt_lib.Checkpoints(
        workdir, keep=t.keep_checkpoints, best_mode=BEST_METRICS[t.best_metric]
    )
    spent_before = 0.0  # minutes of training commands behind the restored checkpoint
    if checkpoints.latest_step() is None and t.embedding_init == "ppmi":
        state = state.replace(params=_ppmi_embedding_params(config, data.tokenizer, state.params))
    if checkpoints.latest_step() is not None:
        state, data_state = checkpoints.restore(state)
        if "iterator" in data_state:
            try:
                iterator.set_state(data_state["iterator"])
            except (KeyError, ValueError) as e:
                raise TrainingError(
                    f"cannot resume the data position of {workdir} ({e}); resume with the "
                    "data.shards (or, with data.shards=0, the number of processes) it had"
                ) from None
        spent_before = float(data_state.get("train_minutes", 0.0))
        print(f"resumed from step {int(state.step)} in {workdir}")
    start = int(state.step)

    p_train = par.train_step(
        train_step,
        model=model,
        tx=tx,
        schedule=schedule,
        label_smoothing=t.label_smoothing,
        pad_id=model_config.pad_id,
        grad_accum_steps=config.optimizer.grad_accum_steps,
        concurrent_splits=t.concurrent_splits,
        microbatches=t.microbatches,
    )
    p_eval = par.eval_step(
        eval_step, model=model, label_smoothing=t.label_smoothing, pad_id=model_config.pad_id
    )
    eval_batches = pipeline.eval_batches(
        data.validation, batch_size=t.batch_size, max_length=d.max_length
    )
    if t.eval_batches:
        eval_batches = eval_batches[: t.eval_batches]
    step_flops = flops.train_step_flops(
        model_config, t.batch_size, d.max_length, d.max_length, d.task
    )
    # train.max_minutes is the budget of the run, over resumes: a re-run of a finished
    # budget trains nothing, an interrupted one gets what is left. A new run takes at
    # least one step, so that it leaves a checkpoint.
    deadline = wall_start + 60 * (t.max_minutes - spent_before) if t.max_minutes else math.inf
    first = start + 1
    if 0 < start < t.num_steps and distributed.all_agree(time.perf_counter() >= deadline):
        print(
            f"train.max_minutes={t.max_minutes:g} already spent on this run "
            f"({spent_before:.1f} min behind step {start}); nothing to train"
        )
        first = t.num_steps + 1
    logger = MetricsLogger(workdir, t.num_steps, enabled=is_chief, deadline=deadline)
    cooldown = config.optimizer.cooldown_fraction
    budget_seconds = 60 * t.max_minutes if t.max_minutes else math.inf
    cooling = False
    state = par.put_state(state)
    final: dict[str, float] = {}
    window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
    peer_lost, step, preempted, skipped = False, first, False, 0
    try:
        _stop_if_asked(stop, "while building the model", agreed=True)
        stop.training = True
        for step in range(first, t.num_steps + 1):
            batch = next(iterator)
            example_ids = batch.pop("example_ids", None)
            # This process's rows, times the processes: every process packs as many rows
            # of the same length, so the global count differs from this by packing only.
            window_tokens += int((batch["targets"] != 0).sum()) * jax.process_count()
            window_steps += 1
            lr_factor = None
            if cooldown:
                lr_factor = distributed.chief_value(
                    schedules.cooldown_factor(
                        cooldown,
                        step,
                        t.num_steps,
                        deadline - time.perf_counter(),
                        budget_seconds,
                    )
                )
                if lr_factor < 1 and not cooling and is_chief:
                    logger.message(
                        f"cooldown from step {step}: the learning rate falls linearly to 0 "
                        f"over the last {cooldown:g} of the run"
                    )
                cooling = lr_factor < 1
            state, metrics = p_train(state, par.put_batch(batch), lr_factor)
            if step == first:
                distributed.WATCHDOG.start()  # several processes: stop if a peer dies
            if example_ids is not None:
                logger.examples(step, example_ids)
            # Every process must stop at the same step: the chief's clock decides (checked
            # at logging steps when there are several processes, to spare a collective).
            out_of_time = (
                math.isfinite(deadline)
                and (jax.process_count() == 1 or step % t.log_every == 0)
                and distributed.all_agree(time.perf_counter() >= deadline)
            )
            preempted = (jax.process_count() == 1 or step % t.log_every == 0) and (
                distributed.all_agree(stop.requested is not None)
            )
            last = step == t.num_steps or out_of_time or preempted
            if step % t.log_every == 0 or last:
                m = par.metrics_to_host(metrics)
                _check_finite(m, step, checkpoints, t.log_every)
                elapsed = time.perf_counter() - window_start
                m["tokens_per_sec"] = window_tokens / elapsed
                m["step_time"] = elapsed / window_steps
                m["tflops_per_sec"] = step_flops / m["step_time"] / 1e12
                logger.write(step, m)
                if is_chief:
                    logger.progress(step, m)
                if m.get("skipped_updates", 0) > skipped:
                    skipped = int(m["skipped_updates"])
                    logger.message(
                        f"spike guard: {skipped} update(s) skipped so far (the last at or before "
                        f"step {step}; optimizer.spike_factor={config.optimizer.spike_factor:g})"
                    )
                window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
            if step % t.eval_every == 0 or (last and not preempted):
                host_state = par.unreplicate(state)
                final = _evaluate(p_eval, par, host_state, eval_batches)
                bleu = _validation_bleu(config, model, evaluation_params(host_state), data)
                if bleu is not None:
                    final["bleu"] = bleu
                logger.write(step, final, prefix="validation")
                logger.message(
                    f"validation @ {step}: loss {final['loss']:.4f}, nll {final['nll']:.4f}, "
                    f"perplexity {final['perplexity']:.2f}, accuracy {final['accuracy']:.4f}"
                    + (
                        f", greedy BLEU {bleu:.2f} ({config.train.eval_bleu_sentences} sentences)"
                        if bleu is not None
                        else ""
                    )
                )
                # The best checkpoint holds the parameters just evaluated (the EMA, if any).
                evaluated = host_state.replace(params=evaluation_params(host_state))
                checkpoints.save_best(step, evaluated, final[t.best_metric])
            if step % t.checkpoint_every == 0 or last:
                m = par.metrics_to_host(metrics)
                _check_finite(m, step, checkpoints, t.log_every)
                spent = spent_before + (time.perf_counter() - wall_start) / 60
                data_state = {
                    "iterator": distributed.merged_data_state(iterator.get_state()),
                    "train_minutes": spent,
                }
                checkpoints.save(step, par.unreplicate(state), data_state)
            if step % t.eval_every == 0 or step % t.checkpoint_every == 0:
                # Evaluation and saving are not training time.
                window_tokens, window_steps, window_start = 0, 0, time.perf_counter()
            if last:
                break
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        peer_lost = True
        raise distributed.PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()} lost the others at "
            f"step {step} ({str(e).splitlines()[0][:200]}); the run stopped. Restart every "
            "process with the same command to resume "
            + (
                f"from the checkpoint of step {checkpoints.latest_step()}"
                if checkpoints.latest_step() is not None
                else "(no checkpoint yet: from the start)"
            )
        ) from None
    finally:
        distributed.WATCHDOG.stop()
        iterator.close()
        if not peer_lost:  # orbax would wait for the lost process
            checkpoints.close()
        logger.close()
    stopped = int(par.unreplicate(state).step)
    if preempted:
        print(
            f"stopped by {stop.requested} at step {stopped}: checkpoint saved in {workdir}. "
            f"Resume with: {preemption.resume_command()}",
            flush=True,
        )
        return {"step": stopped, "trained_steps": stopped - start, "preempted": 1.0}
    if not final:  # nothing left to train: report the checkpoint's validation metrics
        final = _evaluate(p_eval, par, par.unreplicate(state), eval_batches)
    minutes = (time.perf_counter() - wall_start) / 60
    budget = (
        f" (train.max_minutes={t.max_minutes:g} reached before step {t.num_steps})"
        if stopped < t.num_steps
        else ""
    )
    print(
        f"done: step {stopped} ({stopped - start} this run) in {minutes:.1f} min{budget}; "
        f"validation loss {final['loss']:.4f}, accuracy {final['accuracy']:.4f}, "
        f"perplexity {final['perplexity']:.2f}; checkpoints in {workdir}"
    )
    return {
        **final,
        "step": stopped,
        "trained_steps": stopped - start,
        "budget_reached": float(stopped < t.num_steps),
    }


def _ppmi_embedding_params(config, tokenizer: Tokenizer, params):
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


def _validation_bleu(config, model, params, data: assembly.TrainingData) -> float | None:
    """Greedy BLEU on the first ``train.eval_bleu_sentences`` validation sentences."""
    n = config.train.eval_bleu_sentences
    if not n or config.data.task != "translation" or jax.process_count() > 1:
        return None  # several processes: translate the checkpoints afterwards
    translator = Translator(model, params, data.tokenizer, batch_size=config.train.batch_size)
    pairs = data.validation_texts[:n]
    hypotheses = translator.translate([p[0] for p in pairs], beam_size=1)
    return corpus_scores(hypotheses, [p[1] for p in pairs]).bleu


def _check_finite(m: dict[str, float], step: int, checkpoints, window: int) -> None:
    if not math.isfinite(m["loss"]) or not math.isfinite(m["grad_norm"]):
        good = checkpoints.latest_step()
        raise TrainingError(
            f"the loss is {m['loss']} (gradient norm {m['grad_norm']}) at step {step} "
            f"(checked every {window} steps); the last good checkpoint is "
            f"{'step ' + str(good) if good is not None else 'none'} and was kept. Lower "
            "optimizer.learning_rate or set optimizer.clip_grad_norm, then rerun to resume"
        )


__all__ = ["TrainState", "TrainingError", "train_and_evaluate"]
