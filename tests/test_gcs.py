"""Run folders in a bucket (``gs://``), against a real GCS server on the loopback
(tests/gcs_server.py: PyPI's emulator with GCS's preconditions and 403s), reached the
way a user reaches one: ``STORAGE_EMULATOR_HOST`` alone.

The default suite trains a :debug run in the bucket, kills it, resumes it, translates
and evaluates it; the bad locations are one line each; the lock and the file helpers
work on objects. The slow tier runs every other command, a kill inside a checkpoint
save followed by a resume on a machine with nothing but the bucket (bit-exact against
an uninterrupted local run), and a 2-process run.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import pytest

from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location, lock, storage
from tests import fixtures, gcs_server

ROOT = pathlib.Path(__file__).resolve().parents[1]
BUCKET = "runs"
FORBIDDEN = "locked"


@pytest.fixture(scope="module")
def gcs():
    """The server's URL, exported as STORAGE_EMULATOR_HOST for this module (its
    subprocesses inherit it) and removed after, with the server."""
    server, url = gcs_server.start([BUCKET], [FORBIDDEN])
    before = os.environ.get("STORAGE_EMULATOR_HOST")
    os.environ["STORAGE_EMULATOR_HOST"] = url
    try:
        yield url
    finally:
        if before is None:
            os.environ.pop("STORAGE_EMULATOR_HOST", None)
        else:
            os.environ["STORAGE_EMULATOR_HOST"] = before
        location.configure()
        server.terminate()
        server.wait()


def _bucket_path(name: str) -> location.Path:
    return location.path(f"gs://{BUCKET}/{name}-{time.monotonic_ns()}")


def _cli(fixture_data, *args, cwd=ROOT, env=None, check=True):
    out = subprocess.run(
        [sys.executable, "-m", "flaxformer_lite.main", *args],
        cwd=cwd, env=env or fixtures.debug_env(fixture_data), capture_output=True, text=True,
    )  # fmt: skip
    if check:
        assert out.returncode == 0, out.stderr[-3000:]
    return out


def _kill_when(command, env, ready, moment: str) -> None:
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    fixtures.kill_when(proc, ready, 240, moment, poll=0.02)


def _no_local_gs_folder(*folders) -> None:
    for folder in folders:
        assert not (pathlib.Path(folder) / "gs:").exists(), f"a local gs: folder in {folder}"


def test_train_killed_resumed_translated_and_evaluated_in_a_bucket(gcs, fixture_data):
    run = _bucket_path("killed")
    env = fixtures.debug_env(fixture_data)
    command = fixtures.debug_command(fixture_data, run, 9)
    _kill_when(command, env, lambda: ckpt_lib.steps(run) == [3], "checkpoint 3")
    assert (run / lock.LOCK_FILE).exists()  # the killed run's lock, left behind
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "took over" in out.stdout and "resumed from step 3" in out.stdout
    assert ckpt_lib.steps(run) == [3, 6, 9]
    assert not (run / lock.LOCK_FILE).exists()  # released at the end
    losses = fixtures.train_losses(run)  # steps 4.. trained twice: the same losses
    assert sorted(losses) == list(range(1, 10))
    assert sorted(fixtures.step_examples(run)) == list(range(1, 10))
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "tokenizer.model", "metrics.jsonl", "tensorboard"} <= names
    assert any((run / "tensorboard").iterdir())
    # translate and evaluate read it in this process (the slow tier runs their commands)
    from flaxformer_lite.inference.evaluation import evaluate_workdir
    from flaxformer_lite.inference.translate import Translator

    translator = Translator.from_workdir(run)
    assert len(translator.translate(["Wo ist der Bahnhof?"], beam_size=1)) == 1
    assert translator.checkpoint.startswith("best checkpoint")
    evaluate_workdir(run, "test", limit=4, beam_size=1)
    scores = json.loads((run / "test_scores.json").read_text())
    assert scores["beam_size"] == 1 and "bleu" in scores
    assert (run / "test_translations.tsv").read_text().count("\n") == 5
    _no_local_gs_folder(ROOT)


@pytest.mark.parametrize(
    "url, said",
    [
        ("gs:/runs/x", "is not a bucket URL; write gs://BUCKET/PATH"),
        ("gs://", "is not a bucket URL; write gs://BUCKET/PATH"),
        ("gs://Runs/x", "'Runs' is not a valid bucket name"),
        ("s3://runs/x", "s3:// is not a storage this codebase writes"),
        ("gs://nowhere/x", "the bucket 'nowhere' does not exist at http://127.0.0.1:"),
        (f"gs://{FORBIDDEN}/x", f"no permission to read gs://{FORBIDDEN} (caller does not"),
    ],
)
def test_a_bad_location_is_named_in_one_line(gcs, url, said):
    with pytest.raises(location.StorageError) as e:
        location.check(url)
    assert said in str(e.value) and str(e.value).startswith(f"--workdir={url}")
    assert "\n" not in str(e.value)


def test_an_unreachable_server_and_missing_credentials(gcs, monkeypatch, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]  # nothing listens there once the socket is closed
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{closed}")
    started = time.monotonic()
    with pytest.raises(location.StorageError, match="cannot reach the storage server") as e:
        location.check(f"gs://{BUCKET}/x")
    assert f"http://127.0.0.1:{closed} after {location.TRIES} tries (connection refused)" in str(
        e.value
    )
    assert time.monotonic() - started < 30  # bounded: a few tries with backoff
    # No server named and no credentials (no key file, no gcloud login, no metadata
    # server: google-auth's lookup of one is pointed at the closed port).
    monkeypatch.delenv("STORAGE_EMULATOR_HOST")
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{closed}")
    monkeypatch.setenv("GCE_METADATA_IP", f"127.0.0.1:{closed}")
    monkeypatch.setenv("NO_GCE_CHECK", "true")  # and no wait for it
    with pytest.raises(location.StorageError, match="no Google Cloud credentials for gs://"):
        location.check(f"gs://{BUCKET}/x")


def test_a_bad_location_on_the_command_line_creates_nothing(gcs, fixture_data, tmp_path):
    """The user's mistake from the report (one slash), and a missing bucket: one line,
    exit 1, no traceback, and nothing written, locally or in the bucket."""
    config = f"--config={ROOT / 'configs/ende_small.py'}:debug"
    data = f"--config.data.data_dir={fixture_data[1]}"
    before = {p.name for p in location.path(f"gs://{BUCKET}").iterdir()}
    for url, said in (("gs:/runs/x", "not a bucket URL"), ("gs://nowhere/x", "does not exist")):
        out = _cli(fixture_data, config, f"--workdir={url}", data, cwd=tmp_path, check=False)
        assert out.returncode == 1
        assert out.stderr.startswith("error: --workdir=") and said in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert list(tmp_path.iterdir()) == []
    assert {p.name for p in location.path(f"gs://{BUCKET}").iterdir()} == before


def test_the_lock_is_an_object_with_preconditions(gcs, capsys):
    run = _bucket_path("lock")
    with lock.WorkdirLock(run):
        held = json.loads((run / lock.LOCK_FILE).read_text())
        assert held["pid"] == os.getpid()
        with pytest.raises(lock.WorkdirBusyError, match=f"PID {os.getpid()} on host"):
            lock.WorkdirLock(run).__enter__()
    assert not (run / lock.LOCK_FILE).exists()
    # Another host's lock: busy while it beats, stale once silent for LEASE seconds.
    other = {"pid": 1, "host": "elsewhere", "started": time.time(), "command": "train"}
    (run / lock.LOCK_FILE).write_text(json.dumps({**other, "beat": time.time()}))
    with pytest.raises(lock.WorkdirBusyError, match="on host elsewhere .* last heard 0 s ago"):
        lock.WorkdirLock(run).__enter__()
    (run / lock.LOCK_FILE).write_text(json.dumps({**other, "beat": time.time() - lock.LEASE - 1}))
    with lock.WorkdirLock(run):
        assert "took over" in capsys.readouterr().out
    # This host's lock of a process that is gone: stale at once, as a dead flock is.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # fmt: skip
    mine = {"pid": int(dead), "host": socket.gethostname(), "started": 0, "beat": time.time()}
    (run / lock.LOCK_FILE).write_text(json.dumps(mine))
    with lock.WorkdirLock(run):
        assert f"from PID {dead} on host" in capsys.readouterr().out


def test_files_and_folders_in_a_bucket(gcs):
    root = _bucket_path("files")
    log = storage.AppendFile(root / "metrics.jsonl")
    log.write("a\n")
    log.flush()
    log.write("b\n")
    log.close()
    again = storage.AppendFile(root / "metrics.jsonl")  # a resumed run appends
    again.write("c\n")
    again.close()
    assert (root / "metrics.jsonl").read_text() == "a\nb\nc\n"
    from flaxformer_lite.sweep import logs  # a sweep's log in a bucket: appended, read back

    assert logs.run_logged([sys.executable, "-c", "print('\\xe9t\\xe9')"], root / "x.log") == 0
    assert logs.tail(root / "x.log", 1) == "été"
    storage.write_atomic(root / "staging/sub/x.txt", "x")
    storage.write_atomic(root / "staging/done.txt", "done")
    storage.write_atomic(root / "target/old.txt", "old")
    storage.replace_folder(root / "staging", root / "target", last=("done.txt",))
    assert (root / "target/sub/x.txt").read_text() == "x"
    assert (root / "target/done.txt").read_text() == "done"
    assert not (root / "target/old.txt").exists() and not (root / "staging").exists()
    assert storage.local_copy(root / "target/sub/x.txt") != storage.local_copy(
        root / "target/done.txt"
    )


def test_a_corpus_and_a_data_folder_in_a_bucket(gcs, monkeypatch, tmp_path, capsys):
    """``files:gs://...`` is read through a local copy; a data folder in the bucket
    receives the build, and a machine with an empty cache takes it from there instead of
    building again; a bad bucket in either field is one line."""
    from flaxformer_lite.data import files, sources

    corpus, data_dir = _bucket_path("corpus"), _bucket_path("tfds")
    storage.write_atomic(corpus / "train.en", "".join(f"a house {i}\n" for i in range(300)))
    storage.write_atomic(corpus / "train.de", "".join(f"ein Haus {i}\n" for i in range(300)))
    dataset = f"files:{corpus}"
    monkeypatch.setenv("FLAXFORMER_CACHE", str(tmp_path / "first"))
    texts = sources.load_texts(dataset, "train", ("en", "de"), str(data_dir))
    assert "files: building" in capsys.readouterr().out
    assert len(texts) == 240 and texts[0] == ("a house 0", "ein Haus 0")  # 60 carved off
    folders = [p.name for p in (data_dir / "local_files").iterdir()]
    assert len(folders) == 1 and folders[0].startswith("fp")
    monkeypatch.setenv("FLAXFORMER_CACHE", str(tmp_path / "fresh"))  # another machine
    assert sources.load_texts(dataset, "train", ("en", "de"), str(data_dir)) == texts
    assert "files: building" not in capsys.readouterr().out  # fetched, not built
    storage.write_atomic(corpus / "train.de", "ein Haus\n")  # the files changed
    with pytest.raises(files.CorpusError, match=f"{corpus}/train.de has 1 lines"):
        files.build(dataset, ("en", "de"), str(data_dir))
    with pytest.raises(location.StorageError, match="data.data_dir=gs://nowhere/tfds: the"):
        sources.load_texts(dataset, "train", ("en", "de"), "gs://nowhere/tfds")
    with pytest.raises(files.CorpusError, match="is named --config.data.dataset=files:gs://"):
        sources.load_texts(str(corpus), "train", ("en", "de"), str(data_dir))


def _objects(folder) -> set[str]:
    """The names of the files under ``folder`` (a bucket's), relative to it."""
    names = set()
    for root, _, files in folder.walk():
        relative = os.path.relpath(storage._bare(root), storage._bare(folder))
        names |= {name if relative == "." else f"{relative}/{name}" for name in files}
    return names


@pytest.mark.slow
def test_every_command_on_a_bucket(gcs, fixture_data, tmp_path):
    """Each command a user runs on a run folder, with the folder (and a sweep's) in the
    bucket: what each writes lands there, and nothing in a local ``gs:`` folder."""
    run = _bucket_path("every")
    env = fixtures.debug_env(fixture_data)
    subprocess.run(fixtures.debug_command(fixture_data, run, 4, 2), cwd=ROOT, env=env,
                   check=True, capture_output=True)  # fmt: skip
    _cli(fixture_data, "average", f"--workdir={run}", "--num=2", "--window=1")
    assert ckpt_lib.steps(run, "averaged") == [4]
    out = _cli(fixture_data, "translate", f"--workdir={run}", "--ensemble=@2", "Komm her!")
    assert out.stdout.count("\n") == 1
    # Compiled programs kept in the bucket (the suite's own cache variable would win).
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    xla = _bucket_path("xla")
    _cli(fixture_data, "translate", f"--workdir={run}", f"--compilation_cache={xla}",
         "Komm her!", env=env)  # fmt: skip
    assert _objects(xla)
    _cli(fixture_data, "attention", f"--workdir={run}", "Komm her!")
    _cli(fixture_data, "diagnostics", f"--workdir={run}", "--pattern=local:window=2", "Komm her!")
    _cli(fixture_data, "export", f"--workdir={run}")
    _cli(fixture_data, "export", f"--workdir={run}", f"--out={tmp_path / 'hf'}")
    _cli(fixture_data, "export", f"--workdir={run}", f"--out={run}-hf")
    names = _objects(run)
    for name in ("checkpoints_averaged/4/commit_success.txt", "attention/attention.png",
                 "attention/attention.html", "diagnostics/attention_stats.md",
                 "diagnostics/attention_stats.png", "export_hf/model.safetensors",
                 "export_hf/vocab.json"):  # fmt: skip
        assert name in names, name
    local = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert local == sorted(name for name in _objects(location.path(f"{run}-hf")))
    assert "model.safetensors" in local
    # A language model: trained in the bucket, continued with `generate`.
    lm = _bucket_path("lm")
    _cli(fixture_data, f"--config={ROOT / 'configs/lm_small.py'}:debug", f"--workdir={lm}",
         f"--config.data.data_dir={fixture_data[1]}", "--config.data.dataset=ding_de_en",
         "--config.model.vocab_size=80", "--config.model.max_len=32",
         "--config.train.num_steps=2")  # fmt: skip
    out = _cli(fixture_data, "generate", f"--workdir={lm}", "--max_new_tokens=3", "This is")
    assert out.stdout.count("\n") == 1
    # A sweep whose folder and runs are in the bucket, scored and tabulated there.
    sweep = _bucket_path("sweep")
    _cli(fixture_data, "sweep", f"--config={ROOT / 'configs/ende_small.py'}:debug",
         f"--workdir={sweep}", "--sweep=model.num_heads=1,2", "--seeds=1", "--limit=4",
         "--beam_size=1", f"--config.data.data_dir={fixture_data[1]}",
         "--config.model.vocab_size=100", "--config.train.num_steps=2")  # fmt: skip
    names = _objects(sweep)
    assert {"results.jsonl", "results.md", "results.png", "sweep.json"} <= names
    for point in ("num_heads=1", "num_heads=2"):
        for name in ("train.log", "evaluate.log", "command.txt", "test_scores.json",
                     "sweep_result.json", "metrics.jsonl"):  # fmt: skip
            assert f"{point}/seed0/{name}" in names, (point, name)
    rows = [json.loads(x) for x in (sweep / "results.jsonl").read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    _no_local_gs_folder(ROOT, tmp_path)


@pytest.mark.slow
def test_import_into_a_bucket(gcs, fixture_data, tmp_path):
    """``main import`` of a Marian model writes its run (step 0, tokenizer, config) in
    the bucket, and the run translates from there."""
    pytest.importorskip("transformers")
    from tests.test_hf_import import opus_like

    folder = tmp_path / "opus-mt-de-en"
    opus_like(folder)
    run = _bucket_path("imported")
    _cli(fixture_data, "import", f"--config={ROOT / 'configs/ende_small.py'}:debug",
         f"--workdir={run}", f"--config.data.data_dir={fixture_data[1]}",
         f"--config.train.init_from=hf:{folder}", "--config.data.aux_tag=")  # fmt: skip
    assert ckpt_lib.steps(run) == [0] and (run / "tokenizer.model").exists()
    out = _cli(fixture_data, "translate", f"--workdir={run}", "das haus ist groß")
    assert out.stdout.count("\n") == 1


@pytest.mark.slow
def test_killed_in_a_save_resumes_bit_exact_from_nothing_but_the_bucket(
    gcs, fixture_data, tmp_path
):
    """SIGKILL while orbax uploads a checkpoint (its step folder there, no commit file
    yet); the resume runs on a "fresh machine": another working folder, an empty home,
    machine cache and compilation cache, so the run's files come from the bucket alone.
    It ends as an uninterrupted local run does: the same losses and examples at every
    step, bit-identical parameters."""
    steps = 12
    straight = tmp_path / "straight"
    env = fixtures.debug_env(fixture_data)
    subprocess.run(fixtures.debug_command(fixture_data, straight, steps), cwd=ROOT, env=env,
                   check=True, capture_output=True)  # fmt: skip
    run = _bucket_path("killed-in-save")
    folder = run / "checkpoints"

    def uploading() -> bool:  # a step folder in the bucket without orbax's commit file
        try:
            names = _objects(folder)
        except FileNotFoundError:
            return False
        steps_seen = {n.split("/")[0] for n in names if n.split("/")[0].isdigit()}
        return any(f"{s}/{ckpt_lib.COMMITTED}" not in names for s in steps_seen)

    _kill_when(fixtures.debug_command(fixture_data, run, steps), env, uploading, "an upload")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    env = fixtures.debug_env(fixture_data, HOME=str(fresh), FLAXFORMER_CACHE=str(fresh / "c"),
                             JAX_COMPILATION_CACHE_DIR=str(fresh / "xla"))  # fmt: skip
    out = subprocess.run(fixtures.debug_command(fixture_data, run, steps), cwd=fresh, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "an incomplete checkpoint of an interrupted save" in out.stdout
    assert "took over" in out.stdout
    assert fixtures.train_losses(run) == fixtures.train_losses(straight)
    assert fixtures.step_examples(run) == fixtures.step_examples(straight)
    from flaxformer_lite.training.state import abstract_train_state

    target = abstract_train_state(fixtures.debug_config(fixture_data[1])).params
    fixtures.assert_same_params(
        ckpt_lib.restore_params(straight, target, "last", steps)[0],
        ckpt_lib.restore_params(run, target, "last", steps)[0],
    )
    _no_local_gs_folder(ROOT, fresh)


@pytest.mark.slow
def test_two_processes_write_one_run_to_the_bucket(gcs, fixture_data):
    """2 processes x 4 devices train a run in the bucket: one checkpoint per step (both
    processes' shards in it), one log line per step, the lock released."""
    from tests.test_multiprocess import _finish, _launch

    run = _bucket_path("two")
    _finish(_launch(fixture_data, run, 3))
    assert ckpt_lib.steps(run) == [3]
    state = {n.split("/")[0] for n in _objects(run / "checkpoints/3/state")}
    assert {"ocdbt.process_0", "ocdbt.process_1", "manifest.ocdbt"} <= state
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in lines if r["split"] == "train") == [1, 2, 3]
    assert not (run / lock.LOCK_FILE).exists()


@pytest.mark.slow
def test_the_tpu_command_of_the_scaling_guide_runs_on_the_local_server(gcs, fixture_data):
    """docs/scaling.md's TPU command, as written but for --distributed (one machine) and
    what makes it a CPU-sized run (:debug, two steps, the fixture corpus)."""
    text = (ROOT / "docs/scaling.md").read_text()
    block = text[text.index("# TPU VM slice") :].split("# One GPU node")[0]
    command = block[block.index(".venv/bin/python -m flaxformer_lite.main") :]
    args = command.replace("\\\n", " ").replace('"', " ").split()[3:]
    bucket = location.path(f"gs://{BUCKET}").name
    args = [a.replace("$BUCKET", f"{bucket}/tpu-{time.monotonic_ns()}") for a in args]
    assert "--distributed" in args and any(a.startswith("--workdir=gs://") for a in args)
    args = [a + ":debug" if a.startswith("--config=") else a for a in args if a != "--distributed"]
    _cli(fixture_data, *args, f"--config.data.data_dir={fixture_data[1]}",
         "--config.model.vocab_size=100", "--config.train.num_steps=2")  # fmt: skip
    workdir = location.path(next(a for a in args if a.startswith("--workdir=")).split("=", 1)[1])
    assert ckpt_lib.steps(workdir) == [2]


def test_a_runs_extensions_kept_in_a_bucket(gcs, tmp_path, monkeypatch):
    """A run in a bucket keeps its extensions' copies there; with the lab folder gone
    a reader imports the bucket's copy through a local file."""
    import shutil

    from flaxformer_lite.config import extensions, trust
    from flaxformer_lite.workdir.folder import read_config, write_config
    from tests.test_extensions import _config, _lab

    path = _lab(tmp_path / "lab")
    run = _bucket_path("extensions")
    extensions.keep(str(path), run)
    kept = json.loads((run / "extensions/manifest.json").read_text())
    assert (run / "extensions" / kept[0]["copy"]).read_text() == path.read_text()
    write_config(run, json.dumps(_config(path, ffn="t_glu")))
    shutil.rmtree(path.parent)  # the lab gone: the bucket's copy, on the user's word
    monkeypatch.setattr(extensions, "_LOADED", {})
    monkeypatch.setattr(extensions, "_MODULES", {})
    monkeypatch.setattr(trust, "_TRUST_ALL", [True])
    assert read_config(run).model.ffn == "t_glu"
    imported = [m for m in sys.modules.values() if getattr(m, "__name__", "").startswith(
        "flaxformer_extension_lab_ext")]  # fmt: skip
    assert any(storage.cache_folder() in (m.__file__ or "") for m in imported)
