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
import signal
import socket
import subprocess
import sys
import time

import pytest

from flaxformer_lite.workdir import checkpoints as ckpt_lib
from flaxformer_lite.workdir import location, lock
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


def _kill_when(command, env, ready, moment: str, timeout: float = 240) -> None:
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if ready():
            proc.send_signal(signal.SIGKILL)
            break
        assert time.monotonic() < deadline, f"the run never reached {moment}"
        time.sleep(0.02)
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before {moment}: {err[-2000:]}"


def _no_local_gs_folder(*folders) -> None:
    for folder in folders:
        assert not (pathlib.Path(folder) / "gs:").exists(), f"a local gs: folder in {folder}"


def test_train_killed_resumed_translated_and_evaluated_in_a_bucket(gcs, fixture_data):
    run = _bucket_path("killed")
    env = fixtures.debug_env(fixture_data)
    command = fixtures.debug_command(fixture_data, run, 6)
    _kill_when(command, env, lambda: ckpt_lib.steps(run) == [3], "checkpoint 3")
    assert (run / lock.LOCK_FILE).exists()  # the killed run's lock, left behind
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "took over" in out.stdout and "resumed from step 3" in out.stdout
    assert ckpt_lib.steps(run) == [3, 6]
    assert not (run / lock.LOCK_FILE).exists()  # released at the end
    losses = fixtures.train_losses(run)  # steps 4.. trained twice: the same losses
    assert sorted(losses) == list(range(1, 7))
    assert sorted(fixtures.step_examples(run)) == list(range(1, 7))
    names = {p.name for p in run.iterdir()}
    assert {"config.json", "tokenizer.model", "metrics.jsonl", "tensorboard"} <= names
    assert any((run / "tensorboard").iterdir())
    out = _cli(fixture_data, "translate", f"--workdir={run}", "Wo ist der Bahnhof?")
    assert out.stdout.count("\n") == 1  # one line (6 steps may translate it to nothing)
    _cli(fixture_data, "evaluate", f"--workdir={run}", "--limit=4", "--beam_size=1")
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
    log = location.AppendFile(root / "metrics.jsonl")
    log.write("a\n")
    log.flush()
    log.write("b\n")
    log.close()
    again = location.AppendFile(root / "metrics.jsonl")  # a resumed run appends
    again.write("c\n")
    again.close()
    assert (root / "metrics.jsonl").read_text() == "a\nb\nc\n"
    location.write_atomic(root / "staging/sub/x.txt", "x")
    location.write_atomic(root / "staging/done.txt", "done")
    location.write_atomic(root / "target/old.txt", "old")
    location.replace_folder(root / "staging", root / "target", last=("done.txt",))
    assert (root / "target/sub/x.txt").read_text() == "x"
    assert (root / "target/done.txt").read_text() == "done"
    assert not (root / "target/old.txt").exists() and not (root / "staging").exists()
    assert location.local_copy(root / "target/sub/x.txt") != location.local_copy(
        root / "target/done.txt"
    )


def test_a_corpus_and_a_data_folder_in_a_bucket(gcs, monkeypatch, tmp_path, capsys):
    """``files:gs://...`` is read through a local copy; a data folder in the bucket
    receives the build, and a machine with an empty cache takes it from there instead of
    building again; a bad bucket in either field is one line."""
    from flaxformer_lite.data import files, sources

    corpus, data_dir = _bucket_path("corpus"), _bucket_path("tfds")
    location.write_atomic(corpus / "train.en", "".join(f"a house {i}\n" for i in range(300)))
    location.write_atomic(corpus / "train.de", "".join(f"ein Haus {i}\n" for i in range(300)))
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
    location.write_atomic(corpus / "train.de", "ein Haus\n")  # the files changed
    with pytest.raises(files.CorpusError, match=f"{corpus}/train.de has 1 lines"):
        files.build(dataset, ("en", "de"), str(data_dir))
    with pytest.raises(location.StorageError, match="data.data_dir=gs://nowhere/tfds: the"):
        sources.load_texts(dataset, "train", ("en", "de"), "gs://nowhere/tfds")
    with pytest.raises(files.CorpusError, match="is named --config.data.dataset=files:gs://"):
        sources.load_texts(str(corpus), "train", ("en", "de"), str(data_dir))
