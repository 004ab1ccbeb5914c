"""What the fused block-sparse kernel visits, per pattern and length: its tile plans.

  python benchmarks/tile_plans.py [--lengths 4096,16384,65536] [--tile 64]

For the patterns of the accelerator benchmark's block-sparse rows (BigBird,
Longformer, the Sparse Transformer's strided and fixed, dilated, the two-sided window)
and dense attention: the tiles a forward pass visits (of all tiles), how many of them
are full (no mask), the distinct partial masks the kernel reads, the allowed pairs
over the pairs of the visited tiles (how much of a visited tile is work), and the
time to build the plan (numpy, once per pattern and length). A stride is regrouped
by residue (sparse/ops/block_sparse/regroup.py): "(2 parts)" counts the window's tiles in the
original order and the stride's in the regrouped one. The visited share bounds
what skipping can gain over dense attention on any hardware; the GPU timings are in
benchmarks/accelerator.py. Writes benchmarks/results/tile_plans.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from flaxformer_lite.sparse.grammar import patterns as P  # noqa: E402
from flaxformer_lite.sparse.ops.block_sparse.regroup import pattern_parts  # noqa: E402

WINDOW, STRIDE = 256, 128  # as in benchmarks/accelerator.py

PATTERNS = {
    "dense": P.Full(),
    "causal": P.Full().causal(),
    "bigbird": P.bigbird(block_size=64, window_blocks=3, global_blocks=2, random_blocks=3),
    "longformer": P.longformer(WINDOW, (0,)),
    "strided (causal)": P.sparse_transformer_strided(STRIDE).causal(),
    "fixed (causal)": P.Fixed(STRIDE, 8).causal(),
    "dilated": P.Dilated(WINDOW // 8, 8),
    "local (two-sided)": P.Local(WINDOW),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--tile", type=int, default=64)
    args = parser.parse_args()
    tile = args.tile
    lines = [
        f"# Tile plans of the block-sparse kernel ({tile}x{tile} tiles)",
        "",
        f"`python benchmarks/tile_plans.py --lengths {args.lengths} --tile {tile}`",
        "",
        "| pattern | length | tiles visited | of all | full tiles | masks | work in visited "
        "tiles | plan built in |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in (int(x) for x in args.lengths.split(",")):
        for name, pattern in PATTERNS.items():
            start = time.perf_counter()
            parts = pattern_parts(pattern, n, tile, tile)
            seconds = time.perf_counter() - start
            tiles = sum(part.plan.tiles for part in parts)
            total = (-(-n // tile)) ** 2
            full = sum(int((part.plan.tile_mask() == 0).sum()) for part in parts)
            masks = sum(len(part.plan.masks) - 1 for part in parts)
            work = sum(part.plan.pairs for part in parts) / (tiles * tile * tile)
            regrouped = " (2 parts)" if len(parts) > 1 else ""
            regrouped = regrouped or (" (regrouped)" if parts[0].slots is not None else "")
            line = (
                f"| {name}{regrouped} | {n} | {tiles:,} | {tiles / total:.2%} | {full:,} | "
                f"{masks} | {work:.1%} | {seconds:.2f} s |"
            )
            print(line, flush=True)
            lines.append(line)
    out = ROOT / "benchmarks" / "results" / "tile_plans.md"
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
