"""A researcher's own corpus (``data.dataset=files:PATH``): the layouts it reads, the
splits it carves, the build it reuses, the run folder's record of it, and one clear
error for each way a corpus can be wrong."""

import gzip
import io
import json
import os
import random
import re
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from flaxformer_lite.data import assembly, files, sources
from tests.fixtures import kill_when

ROOT = Path(__file__).resolve().parents[1]
WORDS = {"house": "Haus", "tree": "Baum", "water": "Wasser", "dog": "Hund", "cat": "Katze"}


def _pairs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [rng.choice(list(WORDS)) for _ in range(rng.randint(1, 5))]
        out.append((f"{i} the " + " ".join(words), f"{i} die " + " ".join(WORDS[w] for w in words)))
    return out


def _write(path, lines, gz: bool = False) -> None:
    text = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(text) if gz else text)


def _parallel(folder, split: str, pairs, gz: bool = False) -> None:
    folder.mkdir(exist_ok=True)
    suffix = ".gz" if gz else ""
    _write(folder / f"{split}.en{suffix}", [en for en, _ in pairs], gz)
    _write(folder / f"{split}.de{suffix}", [de for _, de in pairs], gz)


def _load(dataset, split, data_dir, features=("en", "de")):
    return sources.load_texts(dataset, split, features, data_dir)


def test_line_aligned_files_build_once_carve_what_is_missing_and_rebuild_on_change(
    tmp_path, capsys
):
    corpus, data_dir = tmp_path / "corpus", tmp_path / "tfds"
    train, valid = _pairs(500), _pairs(20, seed=1)
    _parallel(corpus, "train", train, gz=True)
    _parallel(corpus, "valid", valid)  # 'valid' is the validation split
    dataset = f"files:{corpus}"
    assert _load(dataset, "validation", data_dir) == valid
    said = capsys.readouterr().out
    assert "building" in said and "test is 50 pairs carved off train" in said
    test, kept = _load(dataset, "test", data_dir), _load(dataset, "train", data_dir)
    assert len(test) == 50 and len(kept) == 450 and not set(test) & set(kept)
    assert sorted(test + kept) == sorted(train)
    assert kept == [p for p in train if p not in set(test)]  # the file's order
    assert "building" not in capsys.readouterr().out  # built once, then read
    # The carving depends on the pairs alone: the same on any machine, any run.
    assert files.carve(train, ["test"])[1]["test"] == test
    # Changed content is another corpus: a new build, with the new line in it.
    _parallel(corpus, "valid", valid[:-1] + [("a new line", "eine neue Zeile")])
    assert _load(dataset, "validation", data_dir)[-1] == ("a new line", "eine neue Zeile")
    assert "building" in capsys.readouterr().out
    assert len(list((data_dir / "local_files").iterdir())) == 2


def test_tsv_columns_by_header_or_by_position_and_plain_text_for_a_language_model(tmp_path, capsys):
    pairs = _pairs(300)
    by_header = tmp_path / "header.tsv"
    _write(by_header, ["id\tde\ten"] + [f"{i}\t{de}\t{en}" for i, (en, de) in enumerate(pairs)])
    assert _load(f"files:{by_header}", "train", tmp_path / "a")[:3] == pairs[:3]
    said = capsys.readouterr().out
    assert f"{by_header}: columns by header: en = column 3, de = column 2" in said
    assert said.count("columns by header") == 1  # once per file, however often it is read
    by_position = tmp_path / "tsv"
    by_position.mkdir()
    _write(by_position / "train.tsv", [f"{en}\t{de}" for en, de in pairs])
    _write(by_position / "test.tsv", [f"{en}\t{de}" for en, de in pairs[:5]])
    assert _load(f"files:{by_position}", "test", tmp_path / "b") == pairs[:5]
    said = capsys.readouterr().out
    for split in ("train", "test"):
        assert (
            f"{by_position / split}.tsv: columns by position: no header names en and de; "
            "column 1 = en, column 2 = de" in said
        )
    assert len(_load(f"files:{by_position}", "validation", tmp_path / "b")) == 30
    text = tmp_path / "book.txt"
    _write(text, [en for en, _ in pairs])
    lines = _load(f"files:{text}", "train", tmp_path / "c", features=("en",))
    assert len(lines) == 240 and lines[0] == (pairs[0][0],)


def test_a_byte_order_mark_is_not_text_and_never_hides_a_header(tmp_path, capsys):
    """A file saved by a Windows tool starts with U+FEFF: the header "<BOM>de<TAB>en" is
    still a header (trained en -> de, not German as English with the header as a pair),
    and a line-aligned file's first line loses the mark."""
    pairs = _pairs(300)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rows = ["de\ten"] + [f"{de}\t{en}" for en, de in pairs]
    (corpus / "train.tsv").write_bytes("\ufeff".encode() + "\n".join(rows).encode() + b"\n")
    loaded = _load(f"files:{corpus}", "train", tmp_path / "a")
    assert set(loaded) <= set(pairs) and len(loaded) == 240  # 30 + 30 carved off: valid, test
    assert ("de", "en") not in loaded and ("en", "de") not in loaded
    assert "train.tsv: columns by header: en = column 2, de = column 1" in capsys.readouterr().out
    lines = tmp_path / "lines"
    _parallel(lines, "train", pairs)
    (lines / "train.en").write_bytes("\ufeff".encode() + (lines / "train.en").read_bytes())
    loaded = [
        p
        for s in ("train", "validation", "test")
        for p in _load(f"files:{lines}", s, tmp_path / "b")
    ]
    assert sorted(loaded) == sorted(pairs)  # the first line's English without the mark


def test_the_run_folder_records_the_corpus_and_refuses_other_files(tmp_path):
    corpus = tmp_path / "corpus"
    _parallel(corpus, "train", _pairs(200))
    dataset = f"files:{corpus}"
    fingerprint = files.corpus_fingerprint(dataset, ("en", "de"))
    assembly.check_corpus(tmp_path / "run", dataset, fingerprint)
    assembly.check_corpus(tmp_path / "run", dataset, fingerprint)  # a resume: the same
    _parallel(corpus, "train", _pairs(200, seed=3))
    other = files.corpus_fingerprint(dataset, ("en", "de"))
    with pytest.raises(files.CorpusError, match="its files changed"):
        assembly.check_corpus(tmp_path / "run", dataset, other)


@pytest.mark.parametrize(
    "case, message",
    [
        ("lengths", r"train\.en has 200, .*train\.de has 199 lines"),
        ("empty", "empty"),
        ("utf8", r"train\.de line 3 is not UTF-8"),
        ("columns", r"train\.tsv line 4 has 3 tab-separated column\(s\), the first line 2"),
        ("partner", r"train\.en has no partner .*train\.de is missing"),
        ("no train", "no training split in"),
        ("missing", "no such file or folder"),
        ("one text file", "a translation corpus is a folder"),
        ("too few to carve", "too few to carve"),
    ],
)
def test_a_bad_corpus_is_one_clear_error_and_builds_nothing(tmp_path, case, message):
    corpus, data_dir = tmp_path / "corpus", tmp_path / "tfds"
    corpus.mkdir()
    pairs = _pairs(200)
    if case == "lengths":
        _write(corpus / "train.en", [en for en, _ in pairs])
        _write(corpus / "train.de", [de for _, de in pairs[:-1]])
    elif case == "empty":
        _write(corpus / "train.en", [])
        _write(corpus / "train.de", [])
    elif case == "utf8":
        _parallel(corpus, "train", pairs)
        lines = (corpus / "train.de").read_bytes().split(b"\n")
        lines[2] = "Straße".encode("latin-1")
        (corpus / "train.de").write_bytes(b"\n".join(lines))
    elif case == "columns":
        _write(corpus / "train.tsv", [f"{en}\t{de}" for en, de in pairs[:3]] + ["a\tb\tc"])
    elif case == "partner":
        _write(corpus / "train.en", [en for en, _ in pairs])
    elif case == "no train":
        _parallel(corpus, "test", pairs)
    elif case == "missing":
        corpus = tmp_path / "nowhere"
    elif case == "one text file":
        corpus = corpus / "train.txt"
        _write(corpus, ["a line"])
    elif case == "too few to carve":
        _parallel(corpus, "train", pairs[:5])
    with pytest.raises(files.CorpusError, match=message):
        _load(f"files:{corpus}", "train", data_dir)
    built = data_dir / "local_files"
    assert not built.exists() or not any(p.name.startswith("fp") for p in built.rglob("*"))


def _readme_commands() -> list[list[str]]:
    """The commands of the README's "Your own data" block, continuation lines joined."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("### Your own data", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and line[0] != "#"]


def test_the_readmes_own_data_commands_name_real_flags_and_fields():
    """The cheap form of the test below (slow: it runs them): every flag of the README's
    commands is one its command reads, every --config.x.y a field."""
    from flaxformer_lite import main
    from flaxformer_lite.config.files import field_table

    fields = {line.split(":")[0].strip() for line in field_table().splitlines() if ": " in line}
    for command in _readme_commands():
        args = command[3:]
        name = args[0] if args and not args[0].startswith("-") else "train"
        allowed = {*main.COMMANDS[name].flags, *main.EVERY_COMMAND}
        for arg in (a for a in args if a.startswith("--")):
            flag = arg[2:].split("=")[0]
            if flag.startswith("config."):
                assert flag[len("config.") :] in fields, arg
            else:
                assert flag in allowed, (name, arg)


@pytest.mark.slow  # ~30 s of command lines; the cheap form above checks their flags
def test_the_readmes_own_data_commands_run_as_written(tmp_path):
    """The README's commands on a generated corpus, each as written but for the config's
    `:debug` variant (seconds, not minutes), the corpus's and run's folders, and a
    vocabulary that 5 words and the digits support."""
    commands = _readme_commands()
    assert [c[:3] for c in commands] == [
        ["python", "-m", "flaxformer_lite.main"],
        ["python", "-m", "flaxformer_lite.main"],
    ]
    corpus, run = tmp_path / "my_corpus", tmp_path / "mine"
    _parallel(corpus, "train", _pairs(400))
    cases = []
    for command in commands:
        args = [
            a.replace("configs/ding_mini.py", "configs/ding_mini.py:debug")
            .replace("files:my_corpus", f"files:{corpus}")
            .replace("runs/mine", str(run))
            for a in command[3:]
        ]
        if any(a.startswith("--config=") for a in args):
            args += ["--config.model.vocab_size=40", f"--config.data.data_dir={tmp_path / 'tfds'}"]
        cases.append({"args": args, "cwd": str(ROOT)})
    spec, results = tmp_path / "cases.json", tmp_path / "results.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run(
        [sys.executable, "-m", "tests.cli_cases", str(spec), str(results)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    train, evaluate = json.loads(results.read_text())
    assert train["code"] == 0, train["stderr"][-3000:]
    assert "test is 40 pairs carved off train" in train["stdout"]
    assert (run / assembly.CORPUS_FILE).exists()
    assert evaluate["code"] == 0, evaluate["stderr"][-3000:]
    assert "test (en->de, beam 4" in evaluate["stdout"] and "40 sentences" in evaluate["stdout"]


BUILD = """
import sys
from flaxformer_lite.data import sources
print(len(sources.load_texts(sys.argv[1], "train", ("en", "de"), sys.argv[2])), flush=True)
"""


@pytest.mark.slow
def test_a_build_killed_midway_is_never_read_and_the_next_start_builds_it_whole(tmp_path):
    """SIGKILL while TFDS writes the corpus (its incomplete folder exists): the next
    start finds no prepared build, builds it again, and reads every pair."""
    corpus, data_dir = tmp_path / "corpus", tmp_path / "tfds"
    pairs = _pairs(200_000)
    _parallel(corpus, "train", pairs)
    args = [sys.executable, "-c", BUILD, f"files:{corpus}", str(data_dir)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    built = data_dir / "local_files"

    def writing() -> bool:
        return built.exists() and any("incomplete" in p.name for p in built.rglob("*"))

    kill_when(child, writing)
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    carved = 2 * files.CARVED_MAX  # validation and test come off train
    assert out.stdout.strip().splitlines()[-1] == str(len(pairs) - carved)


def test_a_corpus_past_tfds_memory_buffer_builds_without_tensorflow(tmp_path, monkeypatch):
    """Past 1 GB of examples TFDS spills them to bucket files through tf.io.gfile; with
    the buffer made tiny, the spill happens here, without TensorFlow, and the split
    reads back whole and in file order."""
    from tensorflow_datasets.core import shuffle

    monkeypatch.setattr(shuffle, "MAX_MEM_BUFFER_SIZE", 1000)  # bytes: spill at once
    corpus = tmp_path / "corpus"
    train = _pairs(3000)
    _parallel(corpus, "train", train)
    _parallel(corpus, "valid", _pairs(20, seed=1))
    _parallel(corpus, "test", _pairs(20, seed=2))
    assert _load(f"files:{corpus}", "train", tmp_path / "tfds") == train


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bars_only_on_a_terminal(tmp_path, capfd, monkeypatch):
    """A build whose output is a log or a pipe (here: pytest's capture) holds no
    carriage return or cursor-up escape of TFDS's bars; on a terminal they stay."""
    corpus = tmp_path / "corpus"
    _parallel(corpus, "train", _pairs(300))
    _load(f"files:{corpus}", "train", tmp_path / "a")
    out, err = capfd.readouterr()
    assert "building" in out and not re.search(r"\r|\x1b\[", out + err)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    _parallel(corpus, "train", _pairs(300, seed=1))  # other content: built again
    _load(f"files:{corpus}", "train", tmp_path / "a")
    assert "\r" in terminal.getvalue() and "examples" in terminal.getvalue()


def test_a_large_split_is_sorted_a_bucket_at_a_time(tmp_path, monkeypatch):
    """Past its memory buffer TFDS spills a split to 1,000 buckets chosen by the example
    key and sorts each in memory; keys 0..n-1 put every example in the first bucket (the
    whole split in memory: 2.4 GB at 4.5M pairs). Spread keys fill many, in file order."""
    from tensorflow_datasets.core import shuffle

    from flaxformer_lite.data import tfds_spill

    monkeypatch.setattr(tfds_spill, "BUFFER_BYTES", 4096)  # spill at once
    filled = Counter()
    add = shuffle._Bucket.add
    monkeypatch.setattr(
        shuffle._Bucket, "add", lambda b, k, d: (filled.update([id(b)]), add(b, k, d))
    )
    corpus = tmp_path / "corpus"
    pairs = _pairs(3000)
    _parallel(corpus, "train", pairs)
    _parallel(corpus, "valid", pairs[:10])
    _parallel(corpus, "test", pairs[10:20])
    assert _load(f"files:{corpus}", "train", tmp_path / "tfds") == pairs  # the file's order
    assert len(filled) > 100 and max(filled.values()) <= 60, filled.most_common(3)
