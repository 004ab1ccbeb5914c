#!/usr/bin/env bash
# The worked lab of docs/extending.md at full size: the demo's small EN->DE model with
# the paper's feed-forward block against the lab's SwiGLU block (examples/lab/my_ext.py,
# registered from outside the package), 600 steps each, 3 seeds, scored on the test
# split and compared by sweep --baseline (~10 minutes a run on 2 CPU cores, ~1 hour).
# Resumable: the record (results.jsonl, curves.jsonl, sweeps.json here) is restored into
# runs/ first, so recorded runs are not repeated; FRESH=1 runs everything again. The
# significance column needs the runs' translations (runs/, not committed): a restored
# sweep keeps its recorded results.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
HERE=experiments/lab_swiglu
OUT=${OUT:-$HERE/runs}
record() { "$PY" -c "import sys; from pathlib import Path; from flaxformer_lite.sweep import record; record.$1(Path(sys.argv[1]), Path(sys.argv[2]))" "$2" "$3"; }
[ "${FRESH:-0}" = 1 ] || [ ! -f "$HERE/sweeps.json" ] || record restore "$HERE" "$OUT"
"$PY" -m flaxformer_lite.main sweep --config=examples/lab/config.py --workdir="$OUT/ffn" \
  --sweep=model.ffn=standard,swiglu --seeds=3 --baseline=model.ffn=standard
record collect "$OUT" "$HERE"
cp "$OUT/ffn/results.md" "$OUT/ffn/results.png" "$HERE/"
