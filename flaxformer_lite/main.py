"""Command line: the command table and its flags; the work is in the layers below.

  python -m flaxformer_lite.main --config=configs/ende_small.py --workdir=runs/x \\
      [--config.model.num_heads=4 ...]
  python -m flaxformer_lite.main import --config=configs/ende_small.py --workdir=runs/opus \\
      --config.train.init_from=hf:opus-mt-en-de
  python -m flaxformer_lite.main average --workdir=runs/x --num=5
  python -m flaxformer_lite.main translate --workdir=runs/x "Where is the station?"
  python -m flaxformer_lite.main evaluate --workdir=runs/x --split=test
  python -m flaxformer_lite.main generate --workdir=runs/lm --temperature=0.8 "And God said"
  python -m flaxformer_lite.main attention --workdir=runs/x "Where is the station?"
  python -m flaxformer_lite.main diagnostics --workdir=runs/x --input=sentences.txt
  python -m flaxformer_lite.main sweep --config=configs/ende_small.py:debug --workdir=runs/s \
      --sweep=model.num_heads=1,2 --sweep=model.positional=sinusoidal,learned --seeds=3
  python -m flaxformer_lite.main fields

``train`` (the default command) trains or resumes (SIGTERM or Ctrl-C: it saves a
checkpoint after the current step and prints the command that resumes; Ctrl-C twice
stops at once); ``import`` builds a run from a Marian / OPUS-MT model
(``train.init_from``) as step 0; ``export`` writes a run for transformers or
CTranslate2; ``average`` writes the mean of the last ``--num`` checkpoints of the
run's late ``--window``; ``translate`` translates its arguments, ``--input`` or standard
input; ``evaluate`` translates a split and reports BLEU and chrF; ``generate``
continues prompts with a language-model run; ``attention`` draws every layer's and
head's attention on one sentence (PNG and HTML); ``diagnostics`` reports each head's
attention statistics over some texts; ``sweep`` trains (or resumes) a cross product of
config overrides times seeds and tabulates them (:mod:`flaxformer_lite.sweep`);
``fields`` lists every config field. Decoding flags left out take the run's
``decode`` section.

Above 400 lines on purpose: the eight commands' flags are declared here, once each,
so that ``--helpfull`` lists them all and a command refuses another command's flags.
"""

from __future__ import annotations

if __name__ == "__main__":
    # Before any other import (JAX's takes seconds): a SIGTERM or Ctrl-C from here on
    # is recorded, and training stops cleanly on it instead of dying with status 143.
    from flaxformer_lite.training import preemption as _preemption

    _preemption.install_at_start()

import dataclasses
import os
import re
import sys
from collections.abc import Callable

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    None,
    "Experiment config file, e.g. configs/ende_small.py[:debug].",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run folder: checkpoints, logs, tokenizer.")
_NUM = flags.DEFINE_integer("num", 5, "average: how many of the last checkpoints.")
_WINDOW = flags.DEFINE_float(
    "window",
    None,
    "average: the late share of the run's steps to take checkpoints from "
    "(default: the run's train.final_window, 0.25; 1 = any kept checkpoint).",
)
_VALIDATE = flags.DEFINE_bool("validate", True, "average: keep the mean only if its validation "
                              "loss is no worse than the newest checkpoint's alone.")  # fmt: skip
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "train: process 0's host:port.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "train: how many processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "train: this process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "train: join the processes JAX detects (TPU slice, SLURM, MPI)."
)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout", 60, "train: seconds without a peer's heartbeat before all stop."
)
# Decoding: None = the run's decode section (the paper's beam 4, alpha 0.6 by default).
_BEAM = flags.DEFINE_integer("beam_size", None, "translate/evaluate: beam size (1 = greedy).")
_ALPHA = flags.DEFINE_float("alpha", None, "translate/evaluate: length penalty exponent.")
_NO_REPEAT = flags.DEFINE_integer(
    "no_repeat_ngram", None, "translate/evaluate: forbid repeating any n tokens (0 = off)."
)
_MIN_RATIO = flags.DEFINE_float(
    "min_length_ratio", None, "translate/evaluate: outputs get >= ratio x source pieces (0 = off)."
)
_MAX_RATIO = flags.DEFINE_float(
    "max_length_ratio", None, "translate/evaluate: outputs get <= ratio x source pieces + 5."
)
_INPUT = flags.DEFINE_string(
    "input", None, "translate/generate: a file of sentences or prompts, one per line."
)
_SPLIT = flags.DEFINE_string("split", "test", "evaluate: the dataset split to translate.")
_LIMIT = flags.DEFINE_integer("limit", 0, "evaluate: only the first N sentences (0 = all).")
_ENSEMBLE = flags.DEFINE_list(
    "ensemble",
    [],
    "translate/evaluate/generate: more models to average next-token probabilities with: "
    "WORKDIR (its averaged/best/last checkpoint), WORKDIR@STEP or @STEP (a kept "
    "checkpoint of --workdir), comma-separated.",
)

_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens", None, "generate: pieces to add to each prompt (default 50, or max_len - 1)."
)
_TEMPERATURE = flags.DEFINE_float(
    "temperature", 1.0, "generate: sampling temperature (0 = greedy)."
)
_TOP_K = flags.DEFINE_integer("top_k", 0, "generate: sample from the k likeliest pieces (0 = off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "generate: nucleus sampling mass (1 = off).")
_SEED = flags.DEFINE_integer("seed", 0, "generate: sampling seed (the same seed, the same texts).")

_TRUST = flags.DEFINE_bool("trust_extensions", False, "Import the code a run carries "
                           "(extensions/) that is not this machine's: read it first.")  # fmt: skip
_DEBUG = flags.DEFINE_bool(
    "debug", False, "on an error, print its traceback and the libraries' error logs too."
)
_SWEEP = flags.DEFINE_multi_string(
    "sweep",
    [],
    "sweep: a field and its values, section.field=v1,v2 or section.field=[JSON list]; "
    "repeat for a cross product.",
)
_SEEDS = flags.DEFINE_integer("seeds", 3, "sweep: runs per point, seeds train.seed + 0..N-1.")
_PARALLEL = flags.DEFINE_integer("parallel", 1, "sweep: runs at a time.")
_WAIT = flags.DEFINE_bool("wait", False, "sweep on SLURM: wait for the jobs, then report.")
_STATUS = flags.DEFINE_bool("status", False, "sweep: say where each run is; start nothing.")
_BASELINE = flags.DEFINE_string(
    "baseline", "", "sweep: a point (e.g. model.ffn=standard) the report tests the others against."
)

_OUTPUT = flags.DEFINE_string(
    "output",
    None,
    "attention: path prefix of the PNG and HTML it writes (default WORKDIR/attention/attention).",
)
_PATTERN = flags.DEFINE_multi_string(
    "pattern",
    ["local:window=8", "topk:k=8"],
    "diagnostics: a sparse pattern whose share of the attention mass to report (repeat).",
)
_FORMAT = flags.DEFINE_string(
    "format", "hf", "export: hf (transformers), ctranslate2 or ctranslate2-int8."
)
_OUT = flags.DEFINE_string("out", None, "export: the folder to write (WORKDIR/export_FORMAT).")
_TARGET = flags.DEFINE_string(
    "target", None, "attention: the translation to draw (default: the model's own)."
)
_XLA_CACHE = flags.DEFINE_string(
    "compilation_cache", "~/.cache/flaxformer_lite/xla",
    "Folder of compiled programs kept for later processes ('' = off; JAX_COMPILATION_CACHE_DIR "
    "wins): a translate or evaluate of shapes compiled before skips compiling them.",
)  # fmt: skip

# The commands: what each runs, the flags it reads and whether it takes texts. A flag
# of another command is an error, not silently ignored.
DECODE = ("beam_size", "alpha", "no_repeat_ngram", "min_length_ratio", "max_length_ratio")
PROCESSES = ("coordinator_address", "num_processes", "process_id", "distributed",
             "heartbeat_timeout")  # fmt: skip
SAMPLING = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
SWEEPING = ("wait", "status", *DECODE)


@dataclasses.dataclass(frozen=True)
class Command:
    """A command of the table: ``run(texts)`` does the work (importing what it needs)."""

    run: Callable[[list[str]], None]
    flags: tuple[str, ...]
    texts: bool = False  # takes its arguments as texts (translate, generate, attention)
    workdir: bool = True  # needs --workdir


def _train(texts: list[str], import_only: bool = False) -> None:
    if _CONFIG.value is None:
        _fail("--config is required, e.g. --config=configs/ende_small.py")
    from flaxformer_lite.training import distributed
    from flaxformer_lite.training.train import train_and_evaluate

    distributed.initialize(
        _COORDINATOR.value,
        _NUM_PROCESSES.value,
        _PROCESS_ID.value,
        auto=_DISTRIBUTED.value,
        heartbeat_timeout=_HEARTBEAT.value,
    )
    train_and_evaluate(_CONFIG.value, _WORKDIR.value, import_only=import_only)


def _average(texts: list[str]) -> None:
    from flaxformer_lite.inference.average import average_workdir

    average_workdir(_WORKDIR.value, _NUM.value, _WINDOW.value, _VALIDATE.value)


def _export(texts: list[str]) -> None:
    from flaxformer_lite.exchange.export import export_workdir

    export_workdir(_WORKDIR.value, _FORMAT.value, _OUT.value)


def _translate(texts: list[str]) -> None:
    from flaxformer_lite.inference import streaming

    streaming.translate_main(
        _WORKDIR.value, texts, _INPUT.value, _ENSEMBLE.value, **_decode_options()
    )


def _generate(texts: list[str]) -> None:
    from flaxformer_lite.inference import streaming

    streaming.generate_main(
        _WORKDIR.value,
        texts,
        _INPUT.value,
        ensemble=_ENSEMBLE.value,
        max_new_tokens=_MAX_NEW.value,
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        seed=_SEED.value,
    )


def _attention(texts: list[str]) -> None:
    from flaxformer_lite.views import attention_maps

    attention_maps.main(_WORKDIR.value, texts, _OUTPUT.value, _TARGET.value, **_decode_options())


def _diagnostics(texts: list[str]) -> None:
    from flaxformer_lite.views import diagnostics

    diagnostics.main(
        _WORKDIR.value, texts, _INPUT.value, _PATTERN.value, _OUTPUT.value, **_decode_options()
    )


def _evaluate(texts: list[str]) -> None:
    from flaxformer_lite.inference.evaluation import evaluate_workdir

    evaluate_workdir(
        _WORKDIR.value,
        _SPLIT.value,
        limit=_LIMIT.value,
        ensemble=_ENSEMBLE.value,
        **_decode_options(),
    )


def _fields(texts: list[str]) -> None:
    from flaxformer_lite.config import ConfigError, ExperimentConfig  # no JAX: answers at once
    from flaxformer_lite.config.files import field_table

    try:  # a config's model.extensions: their registered names join the choices
        _CONFIG.value is None or ExperimentConfig.from_config(_CONFIG.value)
    except ConfigError as e:
        _fail(str(e))
    print(field_table())


def _decode_options() -> dict:
    return {name: flags.FLAGS[name].value for name in DECODE}


COMMANDS = {
    "train": Command(_train, ("config", *PROCESSES)),
    "import": Command(lambda texts: _train(texts, import_only=True), ("config",)),
    "average": Command(_average, ("num", "window", "validate")),
    "translate": Command(_translate, ("input", "ensemble", *DECODE), texts=True),
    "export": Command(_export, ("format", "out")),
    "evaluate": Command(_evaluate, ("split", "limit", "ensemble", *DECODE)),
    "generate": Command(_generate, ("input", "ensemble", *SAMPLING), texts=True),
    "attention": Command(_attention, ("output", "target", *DECODE), texts=True),
    "diagnostics": Command(_diagnostics, ("pattern", "input", "output", *DECODE), texts=True),
    "sweep": Command(
        lambda texts: _sweep(),
        ("config", "sweep", "seeds", "parallel", "baseline", "split", "limit", *SWEEPING),
    ),  # fmt: skip
    "fields": Command(_fields, ("config",), workdir=False),
}
EVERY_COMMAND = ("workdir", "debug", "compilation_cache", "trust_extensions")


def _check_flags(name: str, command: Command) -> None:
    """One line for a flag this command does not read (another command's)."""
    ours = {f for c in COMMANDS.values() for f in c.flags} | set(EVERY_COMMAND)
    for flag in sorted(ours - set(command.flags) - set(EVERY_COMMAND)):
        if flags.FLAGS[flag].present:
            owners = [n for n, c in COMMANDS.items() if flag in c.flags]
            _fail(
                f"--{flag} is a flag of {' / '.join(owners)}, not of {name}; drop it "
                f"(`python -m flaxformer_lite.main --helpfull` lists each command's flags)"
            )
    if not command.workdir and flags.FLAGS["workdir"].present:
        _fail(f"{name} takes no --workdir; drop it")
    if "config" not in command.flags and any(a.startswith("--config.") for a in sys.argv[1:]):
        _fail(f"{name} takes no --config overrides; they belong to train and sweep")


def _fail(message: str) -> None:
    """One ``error:`` line (a message of several lines keeps its first and last) and exit 1."""
    lines = [x.strip() for x in str(message).splitlines() if x.strip()]
    text = lines[0] if lines else "failed"
    if len(lines) > 1:
        text += f" ({lines[-1]})"
    print(f"error: {text}", file=sys.stderr)
    sys.exit(1)


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's to fix: reported in one line, no traceback."""
    from flaxformer_lite.config.fields import ConfigError
    from flaxformer_lite.data.prepare import PrepareError
    from flaxformer_lite.inference.translate import TranslateError
    from flaxformer_lite.sweep.spec import SweepError
    from flaxformer_lite.training.distributed import DistributedError
    from flaxformer_lite.training.startup import TrainingError
    from flaxformer_lite.workdir.folder import CheckpointError

    return (ConfigError, TrainingError, DistributedError, CheckpointError, PrepareError,
            SweepError, TranslateError, OSError, ValueError)  # fmt: skip


def main(argv: list[str]) -> None:
    if not any(a.startswith(("--verbosity", "-v=")) for a in sys.argv):
        logging.set_verbosity(logging.ERROR)  # orbax/absl INFO and WARNING lines are noise here
    if not _DEBUG.value:  # orbax logs each error it raises, with its traceback; we report it
        from flaxformer_lite.workdir.failures import NotFromOrbax

        logging.get_absl_logger().addFilter(NotFromOrbax())
    name = argv[1] if len(argv) > 1 else "train"
    if name != "train":  # the others keep the default signal handling
        from flaxformer_lite.training import preemption

        preemption.release_at_start()
    command = COMMANDS.get(name)
    if command is None or (len(argv) > 2 and not command.texts):
        _fail(f"unknown command {' '.join(argv[1:])!r}; commands: {', '.join(COMMANDS)}")
    _check_flags(name, command)
    if command.workdir and not _WORKDIR.value:
        _fail("--workdir is required (the run's folder)")
    if not command.workdir:  # fields: nothing to fail but the config's own import
        command.run(argv[2:])
        return
    from flaxformer_lite.config import trust
    from flaxformer_lite.workdir import location
    from flaxformer_lite.workdir.compile_cache import keep_compiled_programs

    trust.trust_all(_TRUST.value)

    errors = _user_errors()
    try:
        location.check(_WORKDIR.value)  # a bad or unreachable location: nothing written
        keep_compiled_programs(_XLA_CACHE.value)
        command.run(argv[2:])
    except errors as e:
        if _DEBUG.value:
            raise
        from flaxformer_lite.training.distributed import PeerLostError

        if isinstance(e, PeerLostError):
            print(f"error: {e}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)  # not sys.exit: JAX's shutdown at exit would wait for the lost peer
        if isinstance(e, OSError) and e.strerror:
            from flaxformer_lite.workdir.failures import os_error_line

            _fail(os_error_line(e))
        _fail(str(e))
    except Exception as e:
        if _DEBUG.value:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:300]
        _fail(
            f"{type(e).__name__}: {first} (unexpected: rerun with --debug for the traceback, "
            "and please report it)"
        )


def _sweep() -> None:
    if _CONFIG.value is None:
        _fail("--config is required, e.g. --config=configs/ende_small.py:debug")
    from flaxformer_lite.sweep.runner import sweep_main

    config_flag = flags.FLAGS["config"]
    sweep_main(
        config_flags.get_config_filename(config_flag), _SWEEP.value, _SEEDS.value,
        dict(config_flags.get_override_values(config_flag)), _WORKDIR.value,
        split=_SPLIT.value, limit=_LIMIT.value, parallel=_PARALLEL.value, baseline=_BASELINE.value,
        decode_flags=tuple(f"--{k}={v}" for k, v in _decode_options().items() if v is not None),
        wait=_WAIT.value, status=_STATUS.value,
    )  # fmt: skip


def _from_config_flags(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if "ml_collections" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parser with one ``error:`` line for a bad flag or config override."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        text = str(e)
        if "Traceback (most recent call last)" in text:  # a config file's own error
            lines = text.strip().splitlines()
            raised = [x for x in lines if re.match(r"^[\w.]+(Error|Exception): ", x)]
            message = raised[-1].split(": ", 1)[1] if raised else lines[-1]
            if lines[-1].strip() not in message:  # e.g. the file that could not be read
                message += f" ({lines[-1].strip()})"
            _fail(f"--config: {message}")
        _fail(f"{text}; `python -m flaxformer_lite.main --helpfull` lists the flags")
    except (AttributeError, KeyError, TypeError, IndexError, OSError) as e:
        if not _from_config_flags(e) or "--debug" in argv:
            raise
        if isinstance(e, OSError):  # the config file could not be loaded
            _fail(f"--config: {e}")
        text = str(e.args[0]) if e.args else str(e)
        from flaxformer_lite.config.files import below_a_value, unknown_field

        field = re.search(r"[A-Za-z_]\w*", text)
        paths = [a[len("--config.") :].split("=")[0] for a in argv if a.startswith("--config.")]
        _fail(below_a_value(paths) or unknown_field(field.group(0) if field else text, paths))


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def run() -> None:
    try:
        app.run(main, flags_parser=_parse_flags)
    except SystemExit as e:
        # absl exits 1 after printing the help it was asked for; asking is not an error
        if e.code == 1 and any(a.split("=")[0] in HELP_FLAGS for a in sys.argv[1:]):
            raise SystemExit(0) from None
        raise


if __name__ == "__main__":
    run()
