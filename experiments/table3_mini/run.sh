#!/usr/bin/env bash
# The paper's Table 3 in miniature: configs/ding_mini.py (600 steps) and one sweep per row,
# 3 seeds each, test BLEU on the full test split. Resumable: re-run to continue; the runs'
# results (not their checkpoints) are kept under experiments/table3_mini/runs/.
# ~57 runs of ~3.5 minutes on 2 CPU cores; PARALLEL=2 on a machine with more cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-experiments/table3_mini/runs}  # OUT=runs/t3 re-runs all from scratch
sweep() {  # sweep NAME --sweep=... [--sweep=...]
  local name=$1; shift
  "$PY" -m flaxformer_lite.main sweep --config=configs/ding_mini.py --seeds=3 \
    --parallel="${PARALLEL:-1}" --workdir="$OUT/$name" "$@"
}
sweep base
sweep A_heads --sweep=model.num_heads=1,2,8                      # d_k = d_v = 128 / h
sweep B_dk --sweep=model.d_k=8,16                                 # smaller keys, 4 heads
sweep C_layers --sweep=model.num_encoder_layers+model.num_decoder_layers=1,3
sweep C_width --sweep=model.d_model=64,256                       # d_k = d_model / 4
sweep C_ffn --sweep=model.d_ff=256,1024
sweep D_dropout --sweep=model.embedding_dropout+model.residual_dropout=0.0,0.2
sweep D_smoothing --sweep=train.label_smoothing=0.0,0.2
sweep E_positions --sweep=model.positional=learned
sweep ln --sweep=model.ln_position=pre
sweep tying --sweep=model.tie_embeddings=none
"$PY" experiments/table3_mini/report.py
