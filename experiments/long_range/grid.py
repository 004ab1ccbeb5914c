"""The long-range grid: which tasks, which attention patterns, how long.

Shared by cost.py (prices a step of each), report.py and recall_distance.py (tables
and figures); the sweeps in this folder's README train them. A pattern reads about
32-80 keys per query at a row of 512 (dense: all 512); the decoder-only recall tasks
take each pattern's causal variant.
"""

from __future__ import annotations

# name: attention_pattern spec (sparse/grammar/spec.py)
PATTERNS = {
    "dense": "dense",
    "local": "local:window=32",
    "dilated": "dilated:window=16,dilation=4",
    "strided": "sparse_strided:stride=16",
    "longformer": "longformer:window=32,global=2",
    "bigbird": "bigbird:block=16,window=3,global=1,random=1",
    "topk": "topk:k=32",
}
# The same patterns scaled to rows of 64 tokens (the recall grid a CPU can train):
# windows of 16 instead of 32, strides and blocks of 8; dilated and top-k read 16 keys.
PATTERNS_64 = {
    "dense": "dense",
    "local": "local:window=16",
    "dilated": "dilated:window=16,dilation=4",
    "strided": "sparse_strided:stride=8",
    "longformer": "longformer:window=16,global=2",
    "bigbird": "bigbird:block=8,window=3,global=1,random=1",
    "topk": "topk:k=16",
}
# name: config.py argument (task and its size)
TASKS = {
    "mqar_p8": "mqar,l512,p8",
    "mqar_p32": "mqar,l512,p32",
    "mqar_p128": "mqar,l512,p128",
    "needle": "needle,l512",
    "listops": "listops,l512",
    "mqar_l64": "mqar,l64,p8,k16",
}
# The patterns of each task whose rows are not 512 tokens long.
PATTERNS_OF = {"mqar_l64": PATTERNS_64}
SEEDS = 3
