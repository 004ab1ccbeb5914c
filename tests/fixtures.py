"""Small corpora in the real formats, written by the tests (nothing is committed)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

DING_HEADER = "# Version :: test\n# Copyright (c) :: nobody\n"

DING_LINES = [
    "Aal {m} [cook.] | Aale {pl} :: eel | eels",
    "Haus {n}; Gebäude {n} | Häuser {pl} :: house; building | houses",
    "Wo ist der Bahnhof? [ugs.] :: Where is the station? [coll.]",
    "Komm her! :: Come here!",
    "Er kommt morgen. | Sie kam gestern. :: He comes tomorrow. | She came yesterday.",
    "das ist kaputt <kaput> :: it is broken /ib/",
    "no separator here",
    "zwei | Teile :: only one part",
    "Satz {m} | Nummer {f} :: sentence | number",
]


def write_ding(path: Path, extra_sentences: int = 0) -> Path:
    """A Ding file: the lines above, plus ``extra_sentences`` numbered sentence pairs."""
    lines = list(DING_LINES)
    for i in range(extra_sentences):
        lines.append(f"Das ist Satz Nummer {i}. :: This is sentence number {i}.")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(DING_HEADER + "\n".join(lines) + "\n", encoding="utf-8")
    return path


def _testament(books: list[tuple[str, list[list[str]]]]) -> list[tuple[int, str]]:
    """Entries (block, text) in SWORD order: two header entries, then per book
    an intro, per chapter an intro and its verses; one block per book."""
    entries = [(0, ""), (0, '<milestone type="x-importer"/>')]
    for b, (book, chapters) in enumerate(books, start=1):
        entries.append((b, f'<div osisID="{book}" sID="{book.lower()}1" type="book"/>'))
        for c, verses in enumerate(chapters, start=1):
            entries.append((b, f'<chapter osisID="{book}.{c}" sID="{book}.{c}"/>'))
            entries += [(b, v) for v in verses]
    return entries


def write_sword_module(directory: Path, ot_books, nt_books=()) -> Path:
    """A zText module folder (ot.bzs/bzv/bzz, nt.*) holding the given books."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, books in (("ot", ot_books), ("nt", nt_books)):
        if not books:
            continue
        entries = _testament(list(books))
        blocks: dict[int, bytearray] = {}
        bzv = bytearray()
        for block, text in entries:
            data = text.encode("utf-8")
            buf = blocks.setdefault(block, bytearray())
            bzv += struct.pack("<IIH", block, len(buf), len(data))
            buf += data
        bzs, bzz = bytearray(), bytearray()
        for block in range(max(blocks) + 1):
            raw = bytes(blocks.get(block, b""))
            packed = zlib.compress(raw)
            bzs += struct.pack("<III", len(bzz), len(packed), len(raw))
            bzz += packed
        (directory / f"{name}.bzs").write_bytes(bytes(bzs))
        (directory / f"{name}.bzv").write_bytes(bytes(bzv))
        (directory / f"{name}.bzz").write_bytes(bytes(bzz))
    return directory


KJV_BOOKS = [
    (
        "Gen",
        [
            [
                'In the <w lemma="strong:H7225">beginning</w> God created the heaven.',
                'And the earth was without form<note type="x">a note</note>.',
            ],
            ["Thus the heavens were finished."],
        ],
    ),
    ("Ruth", [["Now it came to pass in the days when the judges ruled."]]),
    ("Obad", [["The vision of Obadiah."]]),
]
KJV_NT = [("Jude", [["Jude, the servant of Jesus Christ."]])]
RV_BOOKS = [
    (
        "Gen",
        [
            ["EN el principio crió Dios los cielos.", "Y la tierra estaba desordenada."],
            ["Y fueron acabados los cielos."],
        ],
    ),
    ("Ruth", [["Y ACONTECIÓ en los días que gobernaban los jueces."]]),
    ("Obad", [["Visión de Abdías."]]),
]
RV_NT = [("Jude", [["Judas, siervo de Jesucristo."]])]


def write_raw_root(root: Path, ding_sentences: int = 1600) -> Path:
    """A raw_dir laid out like the extracted Debian packages."""
    write_ding(root / "usr/share/trans/de-en", ding_sentences)
    write_sword_module(root / "usr/share/sword/modules/texts/ztext/engKJV2006eb", KJV_BOOKS, KJV_NT)
    write_sword_module(root / "usr/share/sword/modules/texts/ztext/spaRV1909eb", RV_BOOKS, RV_NT)
    return root


def build_ding_dataset(root: Path, ding_sentences: int = 1600) -> tuple[Path, Path]:
    """The fixture packages in ``root/raw`` and their ding_de_en TFDS build in ``root/tfds``."""
    from flaxformer_lite.data.builders import build_local_dataset

    raw = write_raw_root(root / "raw", ding_sentences)
    data_dir = root / "tfds"
    build_local_dataset("ding_de_en", data_dir, raw_dir=raw)
    return raw, data_dir


ROOT = Path(__file__).resolve().parents[1]


def xla_flags(devices: int | None) -> str:
    """The suite's XLA_FLAGS (tests/conftest.py) for a subprocess with ``devices``
    simulated CPU devices (None: the default, one). A command-line test whose point is
    not the device count runs on one device: a :debug run trains data-parallel over
    every device it sees, and on 8 it costs twice the CPU (multi-device behaviour has
    its own tests: test_sharding, test_steps, test_multiprocess)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
    if devices is not None:
        flags.append(f"--xla_force_host_platform_device_count={devices}")
    return " ".join(flags)


# XLA's default backend optimization, for a jitted function whose run time dominates
# its compile time (the suite compiles without it: tests/conftest.py).
OPTIMIZED = {"xla_backend_optimization_level": 3}


def load_config(name: str = "ende_small", arg: str | None = "debug"):
    """The ml_collections config of ``configs/<name>.py`` with its ``arg`` variant."""
    from flaxformer_lite.config import files

    return files.load_config(str(ROOT / "configs" / f"{name}.py"), arg)


def debug_config(data_dir, **train):
    """The default config's ``:debug`` variant on the fixture Ding dataset in ``data_dir``,
    with ``train`` fields overridden."""
    config = load_config()
    config.model.vocab_size = 100  # the fixture corpus supports ~108 pieces
    # Dropout on, whatever the default config says, so that the resume and averaging
    # tests always exercise the dropout keys.
    config.model.residual_dropout = 0.1
    config.model.embedding_dropout = 0.1
    config.data.data_dir = str(data_dir)
    for k, v in train.items():
        config.train[k] = v
    return config


def train_on_one_device(monkeypatch) -> None:
    """train_and_evaluate in this process on its first device only (startup's Parallel
    takes every device it sees, here 8), for tests whose point is not the device
    count: a :debug run on 8 simulated devices costs twice the CPU. Multi-device
    training has its own tests (test_sharding, test_steps, test_multiprocess)."""
    import functools

    import jax

    from flaxformer_lite.training import parallel, startup

    one = functools.partial(parallel.Parallel, devices=jax.devices()[:1])
    monkeypatch.setattr(startup, "Parallel", one)


def shared_folder(tmp_path_factory, name: str, build: Callable[[Path], None]) -> Path:
    """``build(folder)`` once per test session, whichever pytest-xdist worker asks first
    (under a file lock; the others wait for it and reuse the folder). Its users only
    read it: a test that changes a run copies it first."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    folder = root / f"shared-{name}"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            build(folder)
            (folder / ".built").touch()
    return folder


def trained_translation_run(tmp_path_factory, fixture_data) -> Path:
    """A 6-step :debug translation run on the fixture corpus, trained by the command a
    user types (``python -m flaxformer_lite.main``, on one device), shared by the tests
    that only read a trained run (the command line's own checks, translate, evaluate,
    attention maps, export): 2 encoder layers (the attention grid's rows), max_len 32
    (the too-long input tests), the best checkpoint chosen by validation BLEU,
    ``model.remat=full`` and a profile of steps 2-3. Its console output is kept beside
    it, in ``stdout.txt``."""
    raw, data_dir = fixture_data

    def build(folder: Path) -> None:
        command = [
            sys.executable, "-m", "flaxformer_lite.main", "--config=configs/ende_small.py:debug",
            f"--workdir={folder / 'run'}", f"--config.data.data_dir={data_dir}",
            "--config.model.vocab_size=100",  # the fixture corpus supports ~108 pieces
            # dropout on, whatever the default config says (its keys are part of a run)
            "--config.model.residual_dropout=0.1", "--config.model.embedding_dropout=0.1",
            "--config.model.max_len=32", "--config.model.num_encoder_layers=2",
            # transformers' fixed LayerNorm epsilon, so that this run's exports compute
            # its logits to round-off and translate as it does (tests/test_export.py)
            "--config.model.layer_norm_epsilon=1e-5",
            "--config.train.num_steps=6", "--config.train.eval_bleu_sentences=8",
            "--config.train.best_metric=bleu",
            # the accelerator knobs on the CPU: layers recomputed, steps 2-3 traced
            "--config.model.remat=full", "--config.train.profile=2:2",
        ]  # fmt: skip
        env = dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), XLA_FLAGS=xla_flags(None))
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert out.returncode == 0, out.stderr[-3000:]
        (folder / "stdout.txt").write_text(out.stdout)

    return shared_folder(tmp_path_factory, "translation-run", build) / "run"


def kill_when(
    child, ready: Callable[[], bool], timeout: float = 120, moment: str = "", poll: float = 0.05
) -> None:
    """SIGKILL ``child`` (a Popen) as soon as ``ready()`` (looked at every ``poll``
    seconds); fails, naming the ``moment`` it awaited, if it ends first."""
    import signal
    import time

    deadline = time.monotonic() + timeout
    while not ready():
        if child.poll() is not None:
            err = child.communicate()[1] if child.stderr else ""
            raise AssertionError(f"the child ended before {moment or 'it was killed'}: {err}")
        assert time.monotonic() < deadline, f"not at {moment or 'the moment'} after {timeout} s"
        time.sleep(poll)
    child.send_signal(signal.SIGKILL)
    child.communicate()


def triton_lowering(loss, *shapes) -> str:
    """The MLIR of ``jax.value_and_grad(loss)`` exported for the cuda platform, on an
    abstract H100 where jax asks for one (jax >= 0.11): the lowering a GPU's jit does,
    Pallas' Triton kernels included, run on a CPU so that a construct Triton cannot
    express fails here rather than on a lease."""
    import contextlib

    import jax
    from jax import export

    triton = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    target = contextlib.nullcontext()
    if hasattr(jax.sharding, "AbstractDevice"):
        h100 = jax.sharding.AbstractDevice(
            device_kind="NVIDIA H100", num_cores=None, platform="cuda"
        )
        target = jax.sharding.use_abstract_mesh(
            jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
        )
    grad = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(len(shapes)))))
    with target:
        exported = export.export(grad, platforms=["cuda"], disabled_checks=[triton])(*shapes)
    return exported.mlir_module()


class Compiles:
    """The threads of the XLA compilations started while the ``with`` block runs (jax's
    own compile event, which also fires where the persistent cache supplies the
    program): ``len(compiles.threads)`` counts them. Unlike a jitted function's
    in-memory cache size, it does not depend on which dispatch path a call took."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.threads: list[str] = []

    def _listen(self, event, duration, **kw):
        import threading

        if event == self.EVENT:
            self.threads.append(threading.current_thread().name)

    def __enter__(self) -> Compiles:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def __exit__(self, *exc) -> None:
        import jax

        jax.monitoring.unregister_event_duration_listener(self._listen)


def debug_command(fixture_data, workdir, num_steps, checkpoint_every=3, *extra) -> list[str]:
    """The command line of a :debug translation run on the fixture corpus that logs every
    step and its examples (the faults' and the buckets' tests compare runs by them)."""
    _, data_dir = fixture_data
    return [
        sys.executable, "-m", "flaxformer_lite.main",
        f"--config={ROOT / 'configs/ende_small.py'}:debug", f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}", "--config.model.vocab_size=100",
        "--config.model.residual_dropout=0.1", "--config.model.embedding_dropout=0.1",
        f"--config.train.num_steps={num_steps}",
        f"--config.train.checkpoint_every={checkpoint_every}",
        "--config.train.eval_bleu_sentences=0", "--config.train.log_every=1",
        "--config.train.log_examples=true", *extra,
    ]  # fmt: skip


def debug_env(fixture_data, **extra) -> dict[str, str]:
    """The environment of such a run: the fixture packages, the CPU, one device."""
    raw, _ = fixture_data
    return dict(os.environ, FLAXFORMER_RAW_DIR=str(raw), JAX_PLATFORMS="cpu",
                XLA_FLAGS=xla_flags(None), **extra)  # fmt: skip


def train_losses(workdir) -> dict[int, float]:
    """Each step's training loss in a run's ``metrics.jsonl`` (local or in a bucket); a
    step trained again after a restart must repeat it."""
    losses: dict[int, float] = {}
    for line in (workdir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["split"] == "train":
            assert losses.setdefault(r["step"], r["loss"]) == r["loss"], r["step"]
    return losses


def step_examples(workdir) -> dict[int, list[int]]:
    """Each step's example ids (epoch << 32 | index); a step trained again after a
    restart must see the same examples."""
    seen: dict[int, list[int]] = {}
    for line in (workdir / "examples.jsonl").read_text().splitlines():
        r = json.loads(line)
        assert seen.setdefault(r["step"], r["ids"]) == r["ids"], f"step {r['step']}"
    return seen


def assert_same_params(a, b) -> None:
    import jax
    import numpy as np

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
