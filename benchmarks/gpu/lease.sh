#!/usr/bin/env bash
# Everything of benchmarks/gpu/run.sh in one call of a short lease (docs/accelerator.md):
# the gpu tests, the benchmark, MoBA's routing cost, a training run and the decoding table on that run
# (batches of 1 and 64 sentences), each under its own time limit so the call ends by
# itself inside SECONDS_TOTAL, then every output packed into OUT/results.tgz (the
# device tool brings back few files) with the tables beside it.
#
#   benchmarks/gpu/lease.sh OUT [SECONDS_TOTAL=560] [TRAIN_MINUTES=2]
#
# BENCH_ARGS (default "--minutes 1.0") and TRAIN_ARGS (e.g. "--set train.batch_size=512")
# go to the benchmark and the training run, split at spaces; BENCH_ROWS and BENCH_KERNELS
# (comma-separated names that hold spaces) become the benchmark's --rows and --kernels;
# TEST_ARGS go to pytest (e.g. "-k band"); BENCH_SECONDS (250) caps the benchmark;
# ROUTING_ARGS go to benchmarks/routing_cost.py (default "--lengths 65536,16384", capped
# at 90 s); DECODE_SECONDS (100) is kept for the decoding table, DECODE_ARGS go to it (default
# "--limit 400 --rounds 2"); SKIP="tests bench routing train decode" leaves steps out (decode
# needs train's run). The decoding table alone after a minute of training:
#   SKIP="tests bench routing" benchmarks/gpu/lease.sh OUT 420 1
set -uo pipefail
out=${1:?usage: lease.sh OUT [SECONDS_TOTAL] [TRAIN_MINUTES]}; total=${2:-560}; train_min=${3:-2}
cd "$(dirname "$0")/../.."
start=$(date +%s); work=/tmp/lease; rm -rf "$work"; mkdir -p "$work" "$out"
left() { echo $(( total - ($(date +%s) - start) )); }
PY=${PY:-python3}
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/flaxformer_site .whl/*.whl || { echo "error: installing .whl failed"; exit 1; }
export PYTHONPATH=/tmp/flaxformer_site:$PWD FLAXFORMER_NO_WHEELS=1 PYTHONUNBUFFERED=1
{ nvidia-smi; "$PY" -c "import sys, jax, flax, optax, orbax.checkpoint as o, jaxlib; print(sys.version); print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__); print(jax.devices()); from jax._src.lib import cuda_versions as c; print('cudnn', c.cudnn_get_version() if c else None)"; } > "$work/env.txt" 2>&1
cat "$work/env.txt"
# the corpus's TFDS build needs only the CPU: done meanwhile, so the training run starts at once
( JAX_PLATFORMS=cpu "$PY" -c "from flaxformer_lite.data.builders import build_local_dataset as b; b('ding_de_en')" > "$work/prepare.log" 2>&1 & )
skip=" ${SKIP:-} "
read -ra bench_args <<< "${BENCH_ARGS:---minutes 1.0}"
[ -n "${BENCH_ROWS:-}" ] && bench_args+=(--rows "$BENCH_ROWS")
[ -n "${BENCH_KERNELS:-}" ] && bench_args+=(--kernels "$BENCH_KERNELS")
read -ra test_args <<< "${TEST_ARGS:-}"
read -ra train_args <<< "${TRAIN_ARGS:-}"
read -ra routing_args <<< "${ROUTING_ARGS:---lengths 65536,16384}"
read -ra decode_args <<< "${DECODE_ARGS:---limit 400 --rounds 2}"
keep=0; [[ $skip == *" decode "* ]] || keep=${DECODE_SECONDS:-100}
[[ $skip == *" tests "* ]] || { echo "== tests ($(left) s left)"; timeout 150 benchmarks/gpu/run.sh tests "$work" "${test_args[@]}"; }
[[ $skip == *" bench "* ]] || { echo "== bench ($(left) s left)"; timeout "${BENCH_SECONDS:-250}" benchmarks/gpu/run.sh bench "$work" "${bench_args[@]}" 2>&1 | tee "$work/bench.log"; }
[[ $skip == *" routing "* ]] || { echo "== routing ($(left) s left)"; timeout 90 benchmarks/gpu/run.sh routing "$work" "${routing_args[@]}"; }
[[ $skip == *" train "* ]] || { echo "== train ($(left) s left)"; timeout $(( $(left) - 15 - keep )) benchmarks/gpu/run.sh train "$work" --minutes "$train_min" "${train_args[@]}"; }
[[ $skip == *" decode "* ]] || { echo "== decode ($(left) s left)"; timeout $(( $(left) - 10 )) benchmarks/gpu/run.sh decode "$work" "${decode_args[@]}"; }
tar czf "$out/results.tgz" -C "$work" . ; cp "$work"/*.md "$work/env.txt" "$out"/ 2>/dev/null
echo "== done in $(( $(date +%s) - start )) s"; ls "$out"
