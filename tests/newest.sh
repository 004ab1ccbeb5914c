#!/usr/bin/env bash
# The default suite on the newest JAX, Flax, Optax and Orbax that pyproject.toml's ranges
# admit (`make test-newest`, which CI runs after the whole suite).
#
# JAX 0.11 and later need Python >= 3.12, so on a Python 3.11 machine pip stops at jax
# 0.10.x while Colab's Python 3.12 gets the newest release under the same ranges. This
# leg installs the project with every dependency at its newest allowed version
# (`pip install --upgrade --upgrade-strategy eager`) into its own venv on a Python >= 3.12:
#   1. the machine's own (NEWEST_PYTHON, python3.14 .. python3.12 on the PATH, pyenv's);
#   2. else (or with NEWEST_PYTHON=debian) Debian trixie's (Python 3.13), installed from
#      Debian's packages with debootstrap into NEWEST_ROOT (root or sudo; ~1 minute) and
#      entered with chroot, the project folder bound inside.
# The extras (torch, transformers, wandb, papermill) are not installed here: their tests
# skip with one line, as on a machine without them; the corpora are the ones
# `make prepare` extracted (data/raw). Prints the versions it ran with.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NEWEST_VENV:-.venv-newest}
ROOT=${NEWEST_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/flaxformer_lite/trixie}
WORKERS=${TEST_WORKERS:-2}

find_python() {
  local pyenv_root candidates p
  pyenv_root=$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")
  candidates=("${NEWEST_PYTHON:-}" python3.14 python3.13 python3.12)
  while IFS= read -r p; do candidates+=("$p"); done < <(
    ls -d "$pyenv_root"/versions/3.1[2-9]*/bin/python3 2>/dev/null | sort -rV)
  for p in "${candidates[@]}"; do
    [ -n "$p" ] || continue
    # pyenv's shims answer for versions that are not selected, with an error: run it.
    if "$p" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
      command -v "$p"
      return 0
    fi
  done
  return 1
}

run_suite() {  # $1: a Python >= 3.12
  echo "test-newest: $("$1" --version) at $1, venv $VENV"
  [ -x "$VENV/bin/python" ] || "$1" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e '.[dev]'
  "$VENV/bin/python" - <<'PY'
import importlib.metadata as m, sys
names = ["jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain", "tensorstore", "numpy"]
print("test-newest: Python " + sys.version.split()[0] + "; "
      + ", ".join(f"{n} {m.version(n)}" for n in names))
PY
  local start status
  start=$(date +%s)
  set +e
  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
    "$VENV/bin/python" -m pytest -q -n "$WORKERS" --dist loadfile -m "not slow" \
    -p no:cacheprovider --durations=5
  status=$?
  set -e
  echo "make test-newest: $(( $(date +%s) - start )) s of tests ($WORKERS workers)"
  return $status
}

if [ "${NEWEST_PYTHON:-}" != debian ] && python=$(find_python); then
  run_suite "$python"
  exit $?
fi

# No Python >= 3.12 here: Debian trixie's, in a folder.
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
if [ ! -x "$ROOT/usr/bin/python3" ]; then
  echo "test-newest: no Python >= 3.12 on this machine; installing Debian trixie's into $ROOT"
  command -v debootstrap >/dev/null || {
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq debootstrap >/dev/null; }
  mkdir -p "$(dirname "$ROOT")"
  rm -rf "$ROOT.partial"
  $SUDO debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,gcc,g++,make,git,ca-certificates,procps \
    trixie "$ROOT.partial" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  mv "$ROOT.partial" "$ROOT"
fi
project=$(pwd)
$SUDO mkdir -p "$ROOT/project"
cleanup() {
  for m in "$ROOT/project" "$ROOT/proc" "$ROOT/dev"; do
    mountpoint -q "$m" && $SUDO umount -l "$m"
  done
  return 0
}
trap cleanup EXIT
$SUDO mount --bind "$project" "$ROOT/project"
$SUDO mount -t proc proc "$ROOT/proc"
$SUDO mount --bind /dev "$ROOT/dev"
$SUDO cp /etc/resolv.conf "$ROOT/etc/resolv.conf"
proxies=()  # PyPI through the machine's proxy and index, if it has them
for v in http_proxy https_proxy no_proxy HTTP_PROXY HTTPS_PROXY NO_PROXY PIP_INDEX_URL; do
  [ -n "${!v:-}" ] && proxies+=("$v=${!v}")
done
# The machine's trusted certificates (a proxy's own authority among them) for pip inside.
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  $SUDO cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/machine-ca.crt"
  proxies+=(PIP_CERT=/etc/ssl/certs/machine-ca.crt SSL_CERT_FILE=/etc/ssl/certs/machine-ca.crt)
fi
$SUDO chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root "${proxies[@]}" \
  TEST_WORKERS="$WORKERS" NEWEST_PYTHON=/usr/bin/python3 NEWEST_VENV=/root/venv-newest \
  /bin/bash /project/tests/newest.sh
