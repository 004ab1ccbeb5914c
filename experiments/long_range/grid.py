"""The long-range grid: which tasks, which attention patterns, how long.

Shared by run.py (trains them), cost.py (prices a step of each) and report.py (tables
and figures). A pattern reads about 32-80 keys per query at a row of 512 (dense: all
512); the decoder-only recall tasks take each pattern's causal variant.
"""

from __future__ import annotations

# name: attention_pattern spec (sparse/spec.py)
PATTERNS = {
    "dense": "dense",
    "local": "local:window=32",
    "dilated": "dilated:window=16,dilation=4",
    "strided": "sparse_strided:stride=16",
    "longformer": "longformer:window=32,global=2",
    "bigbird": "bigbird:block=16,window=3,global=1,random=1",
    "topk": "topk:k=32",
}
# name: config.py argument (task and its size)
TASKS = {
    "mqar_p8": "mqar,l512,p8",
    "mqar_p32": "mqar,l512,p32",
    "mqar_p128": "mqar,l512,p128",
    "needle": "needle,l512",
    "listops": "listops,l512",
}
SEEDS = 3
