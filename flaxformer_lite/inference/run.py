"""A run folder opened for reading: its config, tokenizer, model and parameters.

Inference (``translate``, ``evaluate``, ``average``, ensembles) and training read a
workdir through this module and nothing else, so the folder's layout and the
rules for "which parameters does this run translate with" live in one place::

  run = Run.open("runs/ende_small")
  run.config                     # the experiment config it was trained with
  run.tokenizer                  # its sentencepiece model
  run.model()                    # Transformer or LanguageModel of run.model_config
  params, step = run.params()    # averaged if present, else best, else last
  params, step = run.params("last", step=600)

The parameters a run *evaluates with* are its trained parameters, or their
moving average when the optimizer kept one (``optimizer.ema_decay`` > 0). Best
and averaged checkpoints already hold those; from a ``last`` checkpoint the
average is read out of the stored optimizer state (the ``{count, ema}`` node that
``training.state.params_ema`` writes), without building the optimizer, so
nothing here depends on ``training/``.

Layout of a workdir: see :mod:`flaxformer_lite.workdir.folder`.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.data.tokenizer import MODEL_NAME, Tokenizer
from flaxformer_lite.model import partitioning
from flaxformer_lite.model.build import build_model
from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location
from flaxformer_lite.workdir.folder import PREFERENCE, find_params_ema, read_config


class Run:
    """A training run's folder, read-only.

    ``Run.open(workdir)`` fails with a :class:`~flaxformer_lite.workdir.checkpoints.CheckpointError`
    that says how to train when the folder holds no run.
    """

    def __init__(self, workdir, config: ExperimentConfig):
        self.workdir = location.path(workdir)  # local, or a bucket's (gs://)
        self.config = config
        self.model_config = config.model

    @classmethod
    def open(cls, workdir) -> Run:
        config = read_config(workdir)
        if config is None:
            raise ckpt_lib.CheckpointError(
                f"{workdir} is not a training run (no {ckpt_lib.CONFIG_FILE}); train first: "
                f"python -m flaxformer_lite.main --config=configs/ende_small.py --workdir={workdir}"
            )
        return cls(workdir, config)

    # What the run is -------------------------------------------------------------------
    @property
    def task(self) -> str:
        return self.config.data.task

    @property
    def is_lm(self) -> bool:
        """A decoder-only model (a language model, or a generated recall task's)."""
        return self.task in ("lm", "recall")

    @property
    def has_ema(self) -> bool:
        """Whether the run evaluated a moving average of its parameters."""
        return self.config.optimizer.ema_decay > 0

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        path = self.workdir / MODEL_NAME
        if not path.is_file():
            raise ckpt_lib.CheckpointError(
                f"{path} is missing: the run's tokenizer is written before its first step; "
                "train (or resume) the run to write it"
            )
        return Tokenizer.load(path)

    def model(self) -> nn.Module:
        """The run's model (Transformer, or LanguageModel for ``data.task=lm``)."""
        return build_model(self.model_config, self.task)

    @functools.cached_property
    def abstract_params(self) -> Any:
        """Shapes and dtypes of the model's parameters (nothing allocated)."""
        model, dummy = self.model(), jnp.ones((1, 8), jnp.int32)
        args = (dummy, dummy) if self.task == "translation" else (dummy,)
        boxed = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
        return partitioning.unbox(boxed)

    # Checkpoints -----------------------------------------------------------------------
    def steps(self, kind: str = "last") -> list[int]:
        """The steps of the kept checkpoints of ``kind`` (last | best | averaged), sorted."""
        return ckpt_lib.steps(self.workdir, kind)

    def newest_kind(self) -> str:
        """The checkpoint inference uses by default: averaged, else best, else last."""
        for kind in PREFERENCE:
            if self.steps(kind):
                return kind
        raise ckpt_lib.CheckpointError(
            f"{self.workdir} holds no checkpoint yet; train first (or wait for the first save)"
        )

    def params(self, kind: str | None = None, step: int | None = None) -> tuple[Any, int]:
        """(parameters the run evaluates with, step) of a checkpoint on one device.

        ``kind``: averaged | best | last (default: :meth:`newest_kind`); ``step``:
        one of that kind's kept steps (default: the newest readable one, see
        :meth:`newest_params`). From a ``last`` checkpoint of a run with a parameter
        EMA this is the moving average.
        """
        if step is not None:
            return self._read(kind or self.newest_kind(), step)
        params, _, step = self.newest_params(kind)
        return params, step

    def newest_params(self, kind: str | None = None) -> tuple[Any, str, int]:
        """(parameters, kind, step) of the newest checkpoint that can be read: of
        ``kind``, or of the kinds in :data:`PREFERENCE` order. One that cannot (a
        truncated or deleted file, another model's shapes) is named in a warning on
        standard error and the one before it is used; none readable is an error."""
        if kind is not None and kind not in PREFERENCE:
            raise ckpt_lib.CheckpointError(
                f"checkpoint kind {kind!r}; choose one of {', '.join(PREFERENCE)}"
            )
        kinds = [kind] if kind else [k for k in PREFERENCE if self.steps(k)]
        if not kinds:
            self.newest_kind()  # raises: no checkpoint yet
        if not self.steps(kinds[0]):
            self._read(kinds[0], None)  # raises: no checkpoint of this kind
        errors = []
        for k in kinds:
            for step in reversed(self.steps(k)):
                try:
                    params, step = self._read(k, step)
                except ckpt_lib.CheckpointError as e:
                    print(f"warning: {e}; trying the checkpoint before it", file=sys.stderr)
                    errors.append(e)
                    continue
                return params, k, step
        raise ckpt_lib.CheckpointError(
            f"no checkpoint in {self.workdir} can be read ({len(errors)} tried; the newest: "
            f"{errors[0]}); use the config that trained it, or train again"
        )

    def _read(self, kind: str, step: int | None) -> tuple[Any, int]:
        if kind not in PREFERENCE:
            raise ckpt_lib.CheckpointError(
                f"checkpoint kind {kind!r}; choose one of {', '.join(PREFERENCE)}"
            )
        if kind == "last" and self.has_ema:
            return self._ema_params(step)
        return ckpt_lib.restore_params(self.workdir, self.abstract_params, kind, step)

    def _ema_params(self, step: int | None) -> tuple[Any, int]:
        opt_state, step = ckpt_lib.restore_state_part(self.workdir, "opt_state", step)
        ema = find_params_ema(opt_state)
        target = self.abstract_params
        if ema is None or jax.tree.structure(ema) != jax.tree.structure(target):
            raise ckpt_lib.CheckpointError(
                f"the checkpoint at step {step} in {self.workdir} holds no moving average of "
                "its parameters, though its config has optimizer.ema_decay > 0; the folder "
                "mixes runs: use the config it was trained with"
            )
        ckpt_lib.check_shapes(ema, target, f"the last checkpoint of step {step} in {self.workdir}")
        return jax.tree.map(lambda e, t: jnp.asarray(e, t.dtype), ema, target), step
