#!/usr/bin/env bash
# What an accelerator machine without a package index needs from here, made on a machine
# that has one (after `make setup prepare`):
#   .whl/                      the project's dependencies that the GPU image lacks, as
#                              wheels for its Python (3.12, x86-64), at the versions of
#                              this project's .venv
#   data/raw/usr/share/trans/  the Ding corpus's raw package (already there after
#                              `make prepare`; the run builds its TFDS dataset from it)
#   benchmarks/.peer/          flax's examples/wmt, the peer of the train-step benchmark
# .whl/ is git-ignored through .git/info/exclude; the rest already is. Prints the sizes:
# the device tool carries at most 64 MiB with the working tree.
#
#   make gpu-bundle            (PYTHON_TAG=3.12 by default)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
PYTHON_TAG=${PYTHON_TAG:-3.12}
[ -x "$PY" ] || { echo "error: no .venv: run 'make setup prepare' first"; exit 1; }
[ -f data/raw/usr/share/trans/de-en ] || { echo "error: no Ding corpus: run 'make prepare' first"; exit 1; }
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
# The runtime dependencies missing from the GPU image (its package list: python3 -m pip
# list there); everything else (jax, flax, optax, orbax, numpy, sentencepiece, sacrebleu,
# matplotlib, protobuf, etils, ...) is used as installed there.
MISSING="array-record dm-tree docstring-parser googleapis-common-protos grain immutabledict
importlib-resources ml-collections portpicker promise simple-parsing tensorboardx
tensorflow-datasets tensorflow-metadata termcolor toml tzdata"
rm -rf .whl && mkdir -p .whl
for p in $MISSING; do
  v=$("$PY" -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
  spec=$p${v:+==$v}
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_TAG" \
       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
       --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
       --platform manylinux2014_x86_64 -d .whl "$spec" 2>/dev/null; then
    # pure-Python source-only packages (promise): build the wheel here
    "$PY" -m pip wheel -q --no-deps -w .whl "$spec"
  fi
done
# tokamax (Mosaic-GPU flash attention that skips the key blocks outside a band) and its
# dependencies, for the benchmark's tokamax rows; versions as tried (it needs jax >= 0.11.1,
# so it has no place in this project's own environment). 6 MB.
for spec in tokamax==0.0.17 qwix==0.1.8 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
            pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYTHON_TAG" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$spec"
done
"$PY" benchmarks/peer.py >/dev/null
du -sh .whl data/raw/usr/share/trans benchmarks/.peer | sed 's/^/  /'
echo "bundle ready: carry .whl data/raw/usr/share/trans benchmarks/.peer (docs/accelerator.md)"
