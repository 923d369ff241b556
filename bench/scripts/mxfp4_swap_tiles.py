"""The swapped Gluon mxfp4 kernel (:mod:`flatep.kernels.mxfp4_swap`) against the Triton short tiles, at 16 and 32 rows per expert.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16 and 32
rows per expert, a decode step's groups. The first arm is the Triton tile
:func:`flatep.kernels.packed_tiles.default_config` gives without a device (the ``mma.sync`` tiles),
the others the Gluon kernel of the same row tile (``GemmConfig(swap_ab=True, wgmma=True)``) at 2 or
3 programs an SM (3 fit at its registers) and 3, 4 or 6 stages of copies in flight. Every arm runs
:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` as the layer does, timed as
:func:`mxfp4_rank.time_tiles` does (interleaved CUDA-graph replays, the read ceiling measured in the
same run, the packed weight bytes counted once); ``same_bits`` says whether an arm's bits equal the
Triton tile's (the kernel sums over K in another order, so they need not).

    python bench/scripts/mxfp4_swap_tiles.py --out mxfp4_swap_tiles.json      (on a Hopper GPU)
"""
from __future__ import annotations

import dataclasses

from flatep.kernels.packed_tiles import MXFP4_SWAP
from mxfp4_rank import default_then, main

VARIANTS = [(programs, stages) for programs in (2, 3) for stages in (3, 4, 6)]


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    tiles = [dataclasses.replace(MXFP4_SWAP[rows_per_expert], programs_per_sm=programs, num_stages=stages)
             for programs, stages in VARIANTS]
    return default_then(rows_per_expert, gemm, columns, inner, tiles)


if __name__ == "__main__":
    main(__doc__, [16, 32], time_cell)
