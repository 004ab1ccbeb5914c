#!/usr/bin/env bash
# Sparse vs dense attention on the KJV running-text LM at 1k and 4k context, 3 seeds:
# dense, local (128 keys), Sparse Transformer strided, BigBird and top-k, equal steps
# and tokens. Resumable; results (not weights) kept under experiments/sparse_vs_dense_lm/runs/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiments/sparse_vs_dense_lm/runs}
for length in 1024 4096; do
  stride=$([ "$length" = 1024 ] && echo 32 || echo 64)  # ~sqrt(n), Child et al.
  "$PY" -m flaxformer_lite.main sweep --config=experiments/sparse_vs_dense_lm/config.py:$length \
    --sweep="model.attention_pattern=[\"dense\",\"local:window=127\",\"sparse_strided:stride=$stride\",\"bigbird:block=64,window=3,global=1,random=1\",\"topk:k=128\"]" \
    --seeds=3 --parallel="${PARALLEL:-1}" --workdir="$OUT/context$length"
done
