#!/usr/bin/env bash
# Sparse vs dense attention on the KJV running-text LM. Quality: a sweep at 1,024 context
# over dense, local (128 keys), Sparse Transformer strided, BigBird, top-k (k 128) and the
# block-routed moba (4 blocks of 32) and nsa, equal steps and tokens, 3 seeds (21 runs,
# ~1 hour on 2 CPU cores). Cost: one
# process times and sizes the train step of each pattern at 1k, 2k and 4k context.
# Resumable: the record of the runs (results.jsonl, curves.jsonl here) is restored into
# runs/ first, so recorded runs are not repeated; FRESH=1 runs everything again.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiments/sparse_vs_dense_lm/runs}
[ "${FRESH:-0}" = 1 ] || "$PY" experiments/sparse_vs_dense_lm/report.py --restore --runs="$OUT"
"$PY" -m flaxformer_lite.main sweep --config=experiments/sparse_vs_dense_lm/config.py:1024 \
  --sweep='model.attention_pattern=["dense","local:window=127","sparse_strided:stride=32","bigbird:block=64,window=3,global=1,random=1","topk:k=128","moba:block=32,k=4","nsa:block=32,k=2,window=64"]' \
  --seeds=3 --split= --parallel="${PARALLEL:-1}" --workdir="$OUT/context1024"
"$PY" experiments/sparse_vs_dense_lm/cost.py --lengths=1024,2048,4096 --rounds=3
"$PY" experiments/sparse_vs_dense_lm/report.py --runs="$OUT"
