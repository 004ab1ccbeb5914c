"""Obtain the local corpora's raw files (Debian packages) for the TFDS builders.

  python -m flaxformer_lite.data.prepare [--raw_dir=data/raw] [--source PACKAGE=PATH ...]
  make prepare

For each package the files are looked for, in order: at the path given with
``--source package=PATH`` (the file/folder itself, or a root holding the
package's layout), under ``raw_dir`` (already extracted), under ``/`` (the
package is installed). If none has them, ``apt-get download`` fetches the
.deb (after ``apt-get update`` if the first try fails) and ``dpkg -x`` extracts
it into ``raw_dir``. Nothing from the corpora is committed to the repository.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Package:
    """A Debian package a dataset is built from, and the path inside it that is read."""

    name: str  # Debian package
    relpath: str  # the file or folder the builders read, relative to the package root
    is_file: bool = False  # relpath is a file (else a non-empty folder)


PACKAGES = {
    "trans-de-en": Package("trans-de-en", "usr/share/trans/de-en", is_file=True),
    "sword-text-kjv": Package("sword-text-kjv", "usr/share/sword/modules/texts/ztext/engKJV2006eb"),
    "sword-text-sparv": Package(
        "sword-text-sparv", "usr/share/sword/modules/texts/ztext/spaRV1909eb"
    ),
}
DATASET_PACKAGES = {
    "ding_de_en": ("trans-de-en",),
    "bible_en_es": ("sword-text-kjv", "sword-text-sparv"),
}


class PrepareError(RuntimeError):
    """The raw corpus files could not be found or fetched; the message says how to fix it."""


def default_raw_dir() -> Path:
    return Path(os.environ.get("FLAXFORMER_RAW_DIR", "data/raw"))


def _candidate(path: Path, package: Package) -> Path | None:
    """``path`` itself if it is the wanted file/folder, else ``path/relpath``."""
    for p in (path / package.relpath, path):
        if package.is_file and p.is_file():
            return p
        if not package.is_file and p.is_dir() and any(p.glob("*.bz[svz]")):
            return p
    return None


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)


def _apt_download(package: str, into: Path) -> Path:
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise PrepareError(
            f"cannot fetch the Debian package {package!r}: apt-get/dpkg are not available on "
            f"this machine. Copy the extracted package here and pass "
            f"--source {package}=/path/to/extracted/root"
        )
    into.mkdir(parents=True, exist_ok=True)
    result = _run(["apt-get", "download", package], into)
    if result.returncode != 0:
        sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else [])
        _run([*sudo, "apt-get", "update", "-qq"], into)
        result = _run(["apt-get", "download", package], into)
    debs = sorted(into.glob(f"{package}_*.deb"))
    if result.returncode != 0 or not debs:
        raise PrepareError(
            f"`apt-get download {package}` failed: {result.stderr.strip()[-400:]}\n"
            f"Fix: run `sudo apt-get update` and retry, or pass "
            f"--source {package}=/path/to/extracted/root"
        )
    return debs[-1]


def locate_package(package: str, raw_dir: Path, source: Path | None = None) -> Path:
    """Path of the package's file/folder, fetching and extracting it if needed."""
    spec = PACKAGES[package]
    if source is not None:
        found = _candidate(Path(source), spec)
        if found is None:
            raise PrepareError(
                f"--source {package}={source}: neither {source} nor {source}/{spec.relpath} "
                f"holds the package's files"
            )
        return found
    for root in (raw_dir, Path("/")):
        found = _candidate(root, spec)
        if found is not None:
            return found
    with tempfile.TemporaryDirectory(dir=raw_dir.parent if raw_dir.parent.exists() else None) as t:
        tmp = Path(t).resolve()  # subprocesses run inside it: absolute paths only
        deb = _apt_download(package, tmp)
        staging = tmp / "root"
        result = _run(["dpkg", "-x", str(deb), str(staging)], tmp)
        if result.returncode != 0:
            raise PrepareError(f"`dpkg -x {deb.name}` failed: {result.stderr.strip()[-400:]}")
        # Move into place only once complete, so an interrupted run leaves nothing half-written.
        target = raw_dir / spec.relpath
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staging / spec.relpath), str(target))
    found = _candidate(raw_dir, spec)
    if found is None:
        raise PrepareError(f"package {package} did not contain {spec.relpath}")
    return found


def locate_dataset(
    dataset: str, raw_dir: Path | None = None, sources: dict[str, Path] | None = None
) -> dict[str, Path]:
    """``{package: path}`` for every package a local dataset needs."""
    if dataset not in DATASET_PACKAGES:
        raise PrepareError(
            f"unknown local dataset {dataset!r}; choose one of {', '.join(DATASET_PACKAGES)}"
        )
    raw_dir = Path(raw_dir) if raw_dir is not None else default_raw_dir()
    raw_dir.mkdir(parents=True, exist_ok=True)
    sources = sources or {}
    return {p: locate_package(p, raw_dir, sources.get(p)) for p in DATASET_PACKAGES[dataset]}


def _parse_sources(values: list[str]) -> dict[str, Path]:
    out = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or name not in PACKAGES:
            raise PrepareError(
                f"--source {value!r} must be PACKAGE=PATH with PACKAGE one of {', '.join(PACKAGES)}"
            )
        out[name] = Path(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch the local corpora's raw files.")
    parser.add_argument("--raw_dir", type=Path, default=default_raw_dir())
    parser.add_argument("--source", action="append", default=[], metavar="PACKAGE=PATH")
    parser.add_argument("--datasets", nargs="+", default=sorted(DATASET_PACKAGES))
    args = parser.parse_args(argv)
    try:
        sources = _parse_sources(args.source)
        for dataset in args.datasets:
            for package, path in locate_dataset(dataset, args.raw_dir, sources).items():
                print(f"{dataset}: {package} -> {path}")
    except PrepareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
