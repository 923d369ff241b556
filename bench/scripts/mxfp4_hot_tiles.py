"""The mxfp4 tiles for groups of 64 to 192 rows (a skewed decode step's hot experts): 64-row against 128-row tiles.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 64, 96, 128
and 192 rows per expert. The first arm is :func:`flatep.kernels.packed_tiles.default_config`'s tile (64
rows on 4 warps, which a group of 65-128 rows takes twice, decoding its weights twice); the others
are 64-row tiles on more warps or fewer columns, and 128-row tiles on 8 or 4 warps, with one or two
programs an SM (two at most 128 registers a thread, ``GemmConfig.max_registers``). Every arm runs
:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` as the layer does (on Hopper, copies by
tensor descriptor), timed as :func:`mxfp4_rank.time_tiles` does; the same K step sums in the same
order, so each arm's bits equal the default's (``same_bits``). Compiling the 40-odd kernels takes a
few minutes before the first timing.

    python bench/scripts/mxfp4_hot_tiles.py --out mxfp4_hot_tiles.json      (on a GPU)
"""
from __future__ import annotations

from flatep.kernels.packed_tiles import GemmConfig
from mxfp4_rank import default_then, main

TALL = [
    GemmConfig(64, 256, 64, num_warps=8, num_stages=4, programs_per_sm=1),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4, programs_per_sm=3),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=3, programs_per_sm=1),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=4, programs_per_sm=1),
    GemmConfig(128, 128, 64, num_warps=8, num_stages=3, programs_per_sm=2, max_registers=128),
    GemmConfig(128, 256, 64, num_warps=8, num_stages=3, programs_per_sm=1),
    GemmConfig(128, 128, 128, num_warps=8, num_stages=3, programs_per_sm=1),
    GemmConfig(128, 128, 64, num_warps=4, num_stages=3, programs_per_sm=1),
    GemmConfig(128, 64, 128, num_warps=4, num_stages=3, programs_per_sm=2),
]
CANDIDATES = {64: TALL[:4], 96: TALL, 128: TALL, 192: TALL}  # at 64 rows a 128-row tile is half padding


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    return default_then(rows_per_expert, gemm, columns, inner, CANDIDATES[rows_per_expert])


if __name__ == "__main__":
    main(__doc__, list(CANDIDATES), time_cell)
