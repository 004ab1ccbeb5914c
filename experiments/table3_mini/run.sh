#!/usr/bin/env bash
# The paper's Table 3 in miniature: configs/ding_mini.py cut to 400 steps, one sweep per
# row, 3 seeds each, test BLEU on the first 300 test sentences. Two lanes of sweeps, each
# pinned to one core (1.3x the throughput of one run on both cores on a 2-core machine);
# 45 runs, ~2 hours on 2 cores. Resumable: re-run to continue; the record of the runs
# (results.jsonl here) is restored into runs/ first, so recorded runs are not repeated;
# FRESH=1 runs everything again.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiments/table3_mini/runs}
STEPS=${STEPS:-400}
sweep() {  # sweep CORE NAME [--sweep=...]; pinned to CORE on a machine with 2+ cores
  local core=$1 name=$2; shift 2
  local pin=(); [ "$(nproc)" -ge 2 ] && pin=(taskset -c "$core")
  "${pin[@]}" "$PY" -m flaxformer_lite.main sweep --config=configs/ding_mini.py \
    --config.train.num_steps="$STEPS" --config.train.eval_every=200 \
    --seeds=3 --split=test --limit=300 --workdir="$OUT/$name" "$@"
}
lane0() {
  sweep 0 base
  sweep 0 A_heads --sweep=model.num_heads=1,2,8                     # d_k = d_v = 128 / h
  sweep 0 C_layers --sweep=model.num_encoder_layers+model.num_decoder_layers=1,3
  sweep 0 D_smoothing --sweep=train.label_smoothing=0.0              # base 0.1
}
lane1() {
  sweep 1 B_dk --sweep=model.d_k=16                                  # 4 heads, d_v 32
  sweep 1 C_width --sweep=model.d_model=64                           # d_k = d_model / 4
  sweep 1 D_dropout --sweep=model.embedding_dropout+model.residual_dropout=0.0,0.3
  sweep 1 E_positions --sweep=model.positional=learned
  sweep 1 tying --sweep=model.tie_embeddings=none
  sweep 1 ln --sweep=model.ln_position=pre
}
mkdir -p "$OUT"
[ "${FRESH:-0}" = 1 ] || "$PY" experiments/table3_mini/report.py --restore --runs="$OUT"
if [ "$(nproc)" -ge 2 ]; then
  lane0 > "$OUT/lane0.log" 2>&1 & first=$!
  lane1 > "$OUT/lane1.log" 2>&1 & second=$!
  status=0; wait $first || status=1; wait $second || status=1
  [ $status = 0 ] || { echo "a sweep failed: see $OUT/lane*.log" >&2; exit 1; }
else
  lane0; lane1
fi
"$PY" experiments/table3_mini/report.py --runs="$OUT"
