"""``train_and_evaluate(config, workdir)``: the whole training run, importable from Colab.

config -> validation -> data (TFDS -> tokenizer -> packed grain batches) ->
jitted/pmapped train step -> metrics, evaluation, checkpoints. Re-running with
the same workdir resumes from its latest checkpoint (same data order, same
dropout randomness) after checking that the workdir holds the same model.
"""

from __future__ import annotations

import time

import jax

from flaxformer_lite.config import extensions
from flaxformer_lite.config.experiment import BEST_METRICS, ExperimentConfig
from flaxformer_lite.data import pipeline
from flaxformer_lite.inference.evaluation import validation_bleu
from flaxformer_lite.model.build import build_model
from flaxformer_lite.training import distributed, flops, losses, preemption, startup
from flaxformer_lite.training.logging import MetricsLogger
from flaxformer_lite.training.loop import Clock, FinalCheckpoints, Pace, Throughput, check_finite
from flaxformer_lite.training.parallel import Parallel
from flaxformer_lite.training.profiling import StepProfile
from flaxformer_lite.training.startup import TrainingError
from flaxformer_lite.training.state import (
    TrainState,
    create_train_state,
    evaluation_params,
    make_optimizer,
    parameter_count,
    state_partitioning,
)
from flaxformer_lite.training.steps import eval_step, sown_attention, train_step
from flaxformer_lite.views import diagnostics
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location, storage
from flaxformer_lite.workdir.folder import write_config
from flaxformer_lite.workdir.lock import WorkdirBusyError, WorkdirLock


def _evaluate(p_eval, par: Parallel, state, batches) -> dict[str, float]:
    total = None
    params = evaluation_params(state)
    for batch in batches:
        s = p_eval(params, par.put_batch(batch))
        s = par.unreplicate(s)
        total = s if total is None else jax.tree.map(lambda a, b: a + b, total, s)
    return {k: float(v) for k, v in losses.summarize(jax.device_get(total)).items()}


def train_and_evaluate(config, workdir, *, import_only: bool = False) -> dict[str, float]:
    """Train ``config`` in ``workdir`` (resuming if it holds a checkpoint).

    ``import_only`` (``main import``): build the run of ``train.init_from``'s model,
    save it as the checkpoint of step 0 and report its validation scores, no step.

    Returns the final validation metrics (loss, nll, perplexity, accuracy, and bleu
    where measured) with ``step`` (the step the run stopped at), ``trained_steps``
    (steps taken by this call: 0 when a finished run is re-run) and ``budget_reached``
    (1.0 when ``train.max_minutes`` stopped it before ``train.num_steps``, else 0.0).
    """
    # SIGTERM / Ctrl-C from here on: before the first step, stop with nothing to save;
    # after it, finish the step, checkpoint, then stop.
    stop = preemption.Preemption().install()
    workdir = location.check(workdir)  # a bad location: one line, nothing written
    created = not workdir.exists() and jax.process_index() == 0
    try:
        config = ExperimentConfig.from_config(config)  # checked before any data is read
        config = startup.with_implicit_extensions(config)  # a config's own imports, kept
        if import_only and not config.train.init_from:
            raise TrainingError("import needs --config.train.init_from=hf:DIR")
        config = startup.with_imported_model(config, workdir)
        config.model.check_precision()  # float64 needs x64 on
        wall_start = time.perf_counter()
        startup.check_workdir(config, workdir)
        with WorkdirLock(workdir, enabled=jax.process_index() == 0):
            return _train(config, workdir, wall_start, stop, import_only)
    except preemption.StoppedBeforeTraining as e:
        return startup.stopped_before_training(e, workdir, created)
    except WorkdirBusyError as e:
        raise TrainingError(str(e)) from None
    except BaseException:
        if created and startup.nothing_trained(workdir):  # a bad config or corpus: leave no trace
            storage.remove_tree(workdir)
        raise
    finally:
        stop.restore()


def _train(
    config: ExperimentConfig,
    workdir: location.Path,
    wall_start: float,
    stop: preemption.Preemption,
    import_only: bool = False,
) -> dict[str, float]:
    """The paper's recipe: data, model, state (or the checkpoint's), then the steps."""
    startup.stop_if_asked(stop, "while starting")
    par = startup.parallelism(config)
    if jax.process_index() == 0:
        extensions.keep(config.model.extensions, workdir)  # the run's code, kept with it
        write_config(workdir, config.to_json())
    startup.write_imported_tokenizer(config, workdir)
    data = startup.prepare_data(config, workdir)
    startup.stop_if_asked(stop, "while preparing the data")
    trainer = Trainer(config, workdir, par, data, wall_start)
    return trainer.imported() if import_only else trainer.run(stop)


class Trainer:
    """One training command of a run: its state, steps and periodic actions.

    Built from the config and the data (a fresh state, or the newest checkpoint's with
    the data position and the minutes it had spent); :meth:`run` takes the steps and
    logs, evaluates, checkpoints and stops when the recipe says."""

    def __init__(self, config, workdir: location.Path, par: Parallel, data, wall_start: float):
        c, t, d = config.model, config.train, config.data
        self.config, self.workdir, self.par, self.data = config, workdir, par, data
        self.is_chief = jax.process_index() == 0
        self.model = build_model(c, d.task)
        tx, schedule = make_optimizer(config.optimizer, c, t.num_steps)
        self.tx = tx
        par.lay_out(*state_partitioning(self.model, tx, d.max_length))
        state = create_train_state(self.model, tx, t.seed, d.max_length, par.state_shardings)
        print(startup.describe(config, par, parameter_count(state.params)))
        self.iterator = startup.train_iterator(config, data)
        self.profile = StepProfile(t.profile, workdir / "profile", active=self.is_chief)
        self.checkpoints = ckpt_lib.Checkpoints(
            workdir, keep=t.keep_checkpoints, best_mode=BEST_METRICS[t.best_metric]
        )
        state, spent_before = self._restore(state)
        self.start = int(state.step)
        self.state = par.put_state(state)
        self.p_train = par.train_step(
            train_step, model=self.model, tx=tx, schedule=schedule,
            label_smoothing=t.label_smoothing, pad_id=c.pad_id,
            grad_accum_steps=config.optimizer.grad_accum_steps,
            concurrent_splits=t.concurrent_splits, microbatches=t.microbatches,
        )  # fmt: skip
        self.p_eval = par.eval_step(
            eval_step, model=self.model, label_smoothing=t.label_smoothing, pad_id=c.pad_id
        )
        eval_batches = pipeline.eval_batches(
            data.validation, batch_size=t.batch_size, max_length=d.max_length
        )
        self.eval_batches = eval_batches[: t.eval_batches] if t.eval_batches else eval_batches
        tracker = startup.open_tracker(config, workdir) if self.is_chief else None
        self.logger = MetricsLogger(workdir, t.num_steps, enabled=self.is_chief, tracker=tracker)
        self.clock = Clock(
            max_minutes=t.max_minutes, num_steps=t.num_steps, every=t.log_every,
            cooldown_fraction=config.optimizer.cooldown_fraction, spent_before=spent_before,
            wall_start=wall_start, say=self.say,
        )  # fmt: skip
        self.logger.deadline = self.clock.deadline
        self.finals = FinalCheckpoints(
            self.clock, count=t.final_checkpoints, window=t.final_window,
            every=t.checkpoint_every, start_step=self.start,
        )  # fmt: skip
        self.pace, self.outlook_said = Pace(self.clock), False
        step_flops = flops.train_step_flops(c, t.batch_size, d.max_length, d.max_length, d.task)
        self.meter = Throughput(step_flops, d.task, peak=flops.peak_flops(jax.devices()))
        self.skipped = 0
        batch = {k: v[:8] for k, v in self.eval_batches[0].items()}  # a few validation rows
        self.attention_stats = sown_attention(config, batch) if t.attention_stats_every else None

    def _restore(self, state) -> tuple[TrainState, float]:
        """The newest checkpoint's state and the minutes its run had spent, or the fresh
        state (with PPMI embeddings if asked for) and 0."""
        if self.checkpoints.latest_step() is None:
            if self.config.train.init_from:  # step 0 is the imported model, kept
                params = startup.imported_params(self.config, state.params)
                # the optimizer's state anew: a moving average starts from these
                state = state.replace(params=params, opt_state=self.tx.init(params))
                self.checkpoints.save(0, state, {"train_minutes": 0.0})
            if self.config.train.embedding_init == "ppmi":
                params = startup.ppmi_embedding_params(
                    self.config, self.data.tokenizer, state.params
                )
                state = state.replace(params=params)
            return state, 0.0
        state, data_state = self.checkpoints.restore(state)
        if "iterator" in data_state:
            try:
                self.iterator.set_state(data_state["iterator"])
            except (KeyError, ValueError) as e:
                raise TrainingError(
                    f"cannot resume the data position of {self.workdir} ({e}); resume with "
                    "the data.shards (or, with data.shards=0, the number of processes) it had"
                ) from None
        print(f"resumed from step {int(state.step)} in {self.workdir}")
        return state, float(data_state.get("train_minutes", 0.0))

    def imported(self) -> dict[str, float]:
        """``main import``: the imported model's validation scores; no step taken."""
        try:
            final = self.validate(self.start)
        finally:
            self.iterator.close()
            self.checkpoints.close()
            self.logger.close()
        print(
            f"imported {self.config.train.init_from} as step {self.start} of {self.workdir}: "
            f"validation loss {final['loss']:.4f}, perplexity {final['perplexity']:.2f}"
            + (f", greedy BLEU {final['bleu']:.2f}" if "bleu" in final else "")
            + "; translate, evaluate or train (fine-tune) it from there"
        )
        return {**final, "step": self.start, "trained_steps": 0}

    def say(self, text: str) -> None:
        if self.is_chief:
            self.logger.message(text)

    def run(self, stop: preemption.Preemption) -> dict[str, float]:
        """Steps until ``train.num_steps``, the time budget or a stop; then the summary."""
        t = self.config.train
        first = self.start + 1
        if 0 < self.start < t.num_steps and self.clock.spent_already():
            print(
                f"train.max_minutes={t.max_minutes:g} already spent on this run "
                f"({self.clock.spent_before:.1f} min behind step {self.start}); nothing to train"
            )
            first = t.num_steps + 1
        final: dict[str, float] = {}
        peer_lost, step, preempted = False, first, False
        try:
            startup.stop_if_asked(stop, "while building the model", agreed=True)
            stop.training = True
            for step in range(first, t.num_steps + 1):
                batch = next(self.iterator)
                example_ids = batch.pop("example_ids", None)
                self.meter.add(batch)
                lr_factor = self.clock.lr_factor(step)
                with self.profile.step(step):
                    batch = self.par.put_batch(batch)
                    self.state, metrics = self.p_train(self.state, batch, lr_factor)
                self.profile.done(step, self.state)
                if step == first:
                    distributed.WATCHDOG.start()  # several processes: stop if a peer dies
                    self.pace.started(step)  # compiled: steps are timed from here
                if example_ids is not None:
                    self.logger.examples(step, example_ids)
                out_of_time = self.clock.out_of_time(step)
                preempted = self.clock.agreed(stop.requested is not None, step)
                last = step == t.num_steps or out_of_time or preempted
                final_due = self.finals.due(step, self.pace.seconds(step))  # every process
                acted = False
                if step % t.log_every == 0 or last:
                    self.log(step, metrics)
                    acted = True
                if step % t.eval_every == 0 or (last and not preempted):
                    final = self.validate(step)
                    acted = True
                if step % t.checkpoint_every == 0 or last or final_due:
                    self.save(step, metrics)
                    acted = True
                if t.attention_stats_every and step % t.attention_stats_every == 0:
                    self.log_attention_stats(step)
                    acted = True
                if acted:  # logging, evaluating and saving are not training time
                    self.meter.reset()
                if last:
                    break
        except jax.errors.JaxRuntimeError as e:
            if jax.process_count() == 1:
                raise
            peer_lost = True
            raise self._peer_lost(e, step) from None
        finally:
            self.profile.close()
            distributed.WATCHDOG.stop()
            self.iterator.close()
            if not peer_lost:  # orbax would wait for the lost process
                self.checkpoints.close()
            self.logger.close()
        return self._summary(final, preempted, stop)

    def log(self, step: int, metrics) -> None:
        m = self.par.metrics_to_host(metrics)
        check_finite(m, step, self.checkpoints, self.config.train.log_every)
        m.update(self.meter.rates())
        self.logger.write(step, m)
        if self.is_chief:
            projected, curve = self.pace.projected(step), self.config.train.expected_bleu
            outlook = f" -> step ~{projected:,}" if self.clock.timed and projected else ""
            self.logger.progress(step, m, outlook)
            if projected and not self.outlook_said and (self.clock.timed or curve):
                self.outlook_said = True  # once, after the first logged window
                self.logger.message(self.pace.outlook(step, curve))
        if m.get("skipped_updates", 0) > self.skipped:
            self.skipped = int(m["skipped_updates"])
            self.logger.message(
                f"spike guard: {self.skipped} update(s) skipped so far (the last at or before "
                f"step {step}; optimizer.spike_factor={self.config.optimizer.spike_factor:g})"
            )

    def validate(self, step: int) -> dict[str, float]:
        """Validation loss (and greedy BLEU) of the evaluated parameters; the best
        checkpoint keeps them if they are the best so far."""
        host_state = self.par.unreplicate(self.state)
        final = _evaluate(self.p_eval, self.par, host_state, self.eval_batches)
        params = evaluation_params(host_state)
        bleu = validation_bleu(self.config, self.model, params, self.data)
        if bleu is not None:
            final["bleu"] = bleu
        self.logger.write(step, final, prefix="validation")
        self.logger.message(
            f"validation @ {step}: loss {final['loss']:.4f}, nll {final['nll']:.4f}, "
            f"perplexity {final['perplexity']:.2f}, accuracy {final['accuracy']:.4f}"
            + (
                f", greedy BLEU {bleu:.2f} ({self.config.train.eval_bleu_sentences} sentences)"
                if bleu is not None
                else ""
            )
        )
        # The best checkpoint holds the parameters just evaluated (the EMA, if any).
        evaluated = host_state.replace(params=params)
        self.checkpoints.save_best(step, evaluated, final[self.config.train.best_metric])
        return final

    def log_attention_stats(self, step: int) -> None:
        """Entropy, distance, largest logit and pattern mass of every head, logged."""
        params = evaluation_params(self.par.unreplicate(self.state))
        sown = jax.device_get(self.attention_stats(params))
        patterns = self.config.train.attention_stats_patterns.split()
        stats = diagnostics.module_stats(sown, patterns=patterns)
        self.logger.write(step, diagnostics.flat(stats), prefix="attention")

    def save(self, step: int, metrics) -> None:
        m = self.par.metrics_to_host(metrics)
        check_finite(m, step, self.checkpoints, self.config.train.log_every)
        data_state = {
            "iterator": distributed.merged_data_state(self.iterator.get_state()),
            "train_minutes": self.clock.minutes(),
        }
        self.logger.settle()  # the logs as far as the checkpoint, before it
        self.checkpoints.save(step, self.par.unreplicate(self.state), data_state)

    def _peer_lost(self, e: Exception, step: int) -> distributed.PeerLostError:
        latest = self.checkpoints.latest_step()
        return distributed.PeerLostError(
            f"process {jax.process_index()} of {jax.process_count()} lost the others at "
            f"step {step} ({str(e).splitlines()[0][:200]}); the run stopped. Restart every "
            "process with the same command to resume "
            + (
                f"from the checkpoint of step {latest}"
                if latest is not None
                else "(no checkpoint yet: from the start)"
            )
        )

    def _summary(self, final: dict, preempted: bool, stop) -> dict[str, float]:
        t, workdir = self.config.train, self.workdir
        stopped = int(self.par.unreplicate(self.state).step)
        if preempted:
            print(
                f"stopped by {stop.requested} at step {stopped}: checkpoint saved in "
                f"{workdir}. Resume with: {preemption.resume_command()}",
                flush=True,
            )
            return {"step": stopped, "trained_steps": stopped - self.start, "preempted": 1.0}
        if not final:  # nothing left to train: report the checkpoint's validation metrics
            final = _evaluate(
                self.p_eval, self.par, self.par.unreplicate(self.state), self.eval_batches
            )
        minutes = (time.perf_counter() - self.clock.start) / 60
        budget = (
            f" (train.max_minutes={t.max_minutes:g} reached before step {t.num_steps})"
            if stopped < t.num_steps
            else ""
        )
        print(
            f"done: step {stopped} ({stopped - self.start} this run) in {minutes:.1f} min"
            f"{budget}; validation loss {final['loss']:.4f}, accuracy {final['accuracy']:.4f}, "
            f"perplexity {final['perplexity']:.2f}; checkpoints in {workdir}"
        )
        return {
            **final,
            "step": stopped,
            "trained_steps": stopped - self.start,
            "budget_reached": float(stopped < t.num_steps),
        }


__all__ = ["TrainState", "TrainingError", "train_and_evaluate"]
