"""The run folder's layout and its config file; the parameter average it stores.

Layout of a workdir::

  config.json               the experiment config of the run (checked on resume)
  extensions/               copies of model.extensions' files, manifest.json their SHA-256
  tokenizer.model           the run's sentencepiece model (an imported pair: a zip)
  corpus.json               which files a files:PATH run trained on (their fingerprint)
  metrics.jsonl, tensorboard/   what training measured
  checkpoints/<step>/       the last K train states + the data iterator position
  checkpoints_best/<step>/  the state with the best validation metric
  checkpoints_averaged/<step>/  parameters averaged over the last n checkpoints (or
                            the newest alone, where validation preferred it)
  train.lock                the training process that holds the folder

Training writes it (:mod:`~flaxformer_lite.workdir.checkpoints`,
:mod:`~flaxformer_lite.workdir.lock`); inference reads it through
:class:`flaxformer_lite.inference.run.Run`.
"""

from __future__ import annotations

import json
from typing import Any

from flaxformer_lite.config import extensions
from flaxformer_lite.config.experiment import ExperimentConfig
from flaxformer_lite.config.fields import ConfigError
from flaxformer_lite.workdir import location, storage

CONFIG_FILE = "config.json"
# The order in which a run's checkpoints are preferred for inference.
PREFERENCE = ("averaged", "best", "last")


class CheckpointError(RuntimeError):
    """A run folder or checkpoint cannot be used; the message says why and what to do."""


def write_config(workdir, config_json: str) -> None:
    """Write ``config.json`` atomically (a kill leaves the old one or the new one)."""
    storage.write_atomic(location.path(workdir) / CONFIG_FILE, config_json)


def read_config(workdir) -> ExperimentConfig | None:
    """The experiment config saved in ``workdir`` (fields added since it was saved at
    their defaults), or None when the folder holds no run."""
    path = location.path(workdir) / CONFIG_FILE
    if not path.exists():
        return None
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore or delete it") from e
    try:
        # the run's copies stand for the files it names
        extensions.load_kept(path.parent, storage.local_copy)
        return ExperimentConfig.from_config(values)
    except extensions.ExtensionError as e:
        raise CheckpointError(str(e)) from e
    except ConfigError as e:
        registered = "(or register one" in str(e) or "unknown sparse pattern" in str(e)
        fix = (
            "if it is a name your own code registers, the run does not carry that code: name "
            f'its file in the "extensions" of "model" in {path} (e.g. "lab/my_ext.py"), or '
            "train in a new --workdir"
            if registered or "is not allowed" in str(e)
            else "restore it, or train in a new --workdir"
        )
        raise CheckpointError(f"{path} is not a config this version can read ({e}); {fix}") from e


def find_params_ema(opt_state: Any) -> Any | None:
    """The parameter average in a stored optimizer state: the value of ``ema`` in the
    first ``{count, ema}`` node (the on-disk form of ``training.state.ParamsEMAState``),
    found without building the optimizer."""
    if isinstance(opt_state, dict):
        if set(opt_state) == {"count", "ema"}:
            return opt_state["ema"]
        children = opt_state.values()
    elif isinstance(opt_state, list | tuple):
        children = opt_state
    else:
        return None
    for child in children:
        found = find_params_ema(child)
        if found is not None:
            return found
    return None
