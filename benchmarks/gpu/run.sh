#!/usr/bin/env bash
# On the accelerator machine (no package index), from the project root, with the bundle
# of benchmarks/gpu/bundle.sh carried along (docs/accelerator.md):
#
#   benchmarks/gpu/run.sh tests OUT     the tests marked gpu (real cuDNN) -> OUT/gpu_tests.log
#   benchmarks/gpu/run.sh bench OUT     benchmarks/accelerator.py         -> OUT/accelerator.md
#   benchmarks/gpu/run.sh train OUT     benchmarks/accelerator_train.py   -> OUT/train_run.md
#   benchmarks/gpu/run.sh decode OUT    the test split at batches of 1 and 64 sentences, on
#                                       train's run (DECODE_WORKDIR)     -> OUT/decode_batches.md
#   benchmarks/gpu/run.sh routing OUT   benchmarks/routing_cost.py (MoBA's routing: XLA
#                                       or the fused kernel)           -> OUT/routing_cost.txt
#   benchmarks/gpu/run.sh dry OUT       all four, tiny, on whatever is here (CPU included)
#
# Extra arguments go to the command (e.g. `bench OUT --only train --minutes 3`).
set -uo pipefail
what=${1:?usage: run.sh tests|bench|routing|train|decode|dry OUT [args]}; out=${2:?usage: run.sh ... OUT}
shift 2
cd "$(dirname "$0")/../.."
mkdir -p "$out"
PY=${PY:-python3}
if [ -d .whl ] && [ -z "${FLAXFORMER_NO_WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/flaxformer_site .whl/*.whl || { echo "error: installing .whl failed"; exit 1; }
  export PYTHONPATH=/tmp/flaxformer_site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 FLAXFORMER_TEST_OPTIMIZE=1
status=0
if [ "$what" = tests ] || [ "$what" = dry ]; then
  platform=cuda; [ "$what" = dry ] && platform=${JAX_PLATFORMS:-cpu}
  # With pytest-xdist, four workers share the GPU (each allocating as it goes): the tests
  # are compile-bound, so this cuts their time on a short lease.
  par=(); [ "$what" = tests ] && "$PY" -c "import xdist" 2>/dev/null && par=(-n 4)
  XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_PLATFORMS=$platform "$PY" -m pytest -q \
    -p no:cacheprovider -m gpu -rs "${par[@]}" tests/test_kernels.py tests/test_precision.py tests/test_band_gpu.py tests/test_block_sparse_gpu.py tests/test_routed_gpu.py tests/test_route_gpu.py tests/test_compressed_gpu.py "$@" \
    2>&1 | tee "$out/gpu_tests.log" || status=1
fi
tiny=(); [ "$what" = dry ] && tiny=(--tiny)
if [ "$what" = bench ] || [ "$what" = dry ]; then
  "$PY" benchmarks/accelerator.py --out "$out" "${tiny[@]}" "$@" || status=1
fi
if [ "$what" = routing ] || [ "$what" = dry ]; then
  "$PY" benchmarks/routing_cost.py "${tiny[@]}" "$@" 2>&1 | tee "$out/routing_cost.txt" || status=1
fi
if [ "$what" = train ] || [ "$what" = dry ]; then
  "$PY" benchmarks/accelerator_train.py --out "$out" "${tiny[@]}" "$@" || status=1
fi
if [ "$what" = decode ] || [ "$what" = dry ]; then
  few=(); [ "$what" = dry ] && few=(--limit 16 --rounds 1)
  "$PY" benchmarks/decode_engines.py --workdir "${DECODE_WORKDIR:-/tmp/flaxformer_accelerator_run}" \
    --batch_sizes 1,64 --out "$out" "${few[@]}" "$@" || status=1
fi
exit $status
