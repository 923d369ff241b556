"""The Gluon mxfp4 kernel (:mod:`flatep.kernels.mxfp4_wgmma`) against the Triton tiles, at 16 to 192 rows per expert.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16, 32, 48,
64, 96, 128 and 192 rows per expert: a decode step's groups (from 48 rows on, a skewed step's hot
experts, which take the tall launch). The first arm is the Triton tile
:func:`flatep.kernels.packed_tiles.default_config` gives without a device (16 and 32 rows: the
``mma.sync`` tiles; from 48 on the 64 x 256 x 64 tile on 4 warps), the others the Gluon kernel
(``GemmConfig.wgmma``) at 3, 4 and 6 stages of copies in flight. Every arm runs
:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` as the layer does, timed as
:func:`mxfp4_rank.time_tiles` does (interleaved CUDA-graph replays, the read ceiling measured in the
same run, the packed weight bytes counted once); ``same_bits`` says whether an arm's bits equal the
Triton tile's.

    python bench/scripts/mxfp4_wgmma_tiles.py --out mxfp4_wgmma_tiles.json      (on a Hopper GPU)
"""
from __future__ import annotations

import dataclasses

from flatep.kernels.packed_tiles import MXFP4_WGMMA
from mxfp4_rank import default_then, main

GLUON = [dataclasses.replace(MXFP4_WGMMA, num_stages=stages) for stages in (3, 4, 6)]
ROWS_PER_EXPERT = [16, 32, 48, 64, 96, 128, 192]


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    return default_then(rows_per_expert, gemm, columns, inner, GLUON)


if __name__ == "__main__":
    main(__doc__, ROWS_PER_EXPERT, time_cell)
