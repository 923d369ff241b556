"""The swapped Gluon mxfp4 kernel's K steps one by one against unrolled chunks whose decode runs beside the MMAs.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16, 32
and 64 rows per expert, a decode step's groups and a skewed step's hot ones. The first arm is the
swapped kernel
(:data:`flatep.kernels.packed_tiles.MXFP4_SWAP` of that row tile) as it runs by default,
:data:`flatep.kernels.mxfp4_swap.CHUNK_STEPS` = 1: each K step waits for its own MMAs before the
next step's decode. The next arms unroll :data:`CHUNKS` steps at a time, each half's decode beside
the MMA issued before it (:func:`flatep.kernels.mxfp4_swap._overlapped_steps`); the last arm is
the Triton tile :func:`flatep.kernels.packed_tiles.default_config` gives without a device (the short
tiles at 16 and 32 rows, the 64 x 256 tile at 64).
Every arm runs :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` as the layer does, timed
as :func:`mxfp4_rank.time_arms` does (interleaved CUDA-graph replays, the read ceiling measured in
the same run, the packed weight bytes counted once). ``same_bits`` compares each arm with the
first: the chunks issue the same MMAs in the same order, so they must give its bits; the Triton
tile sums over K in another order, so it need not.

    python bench/scripts/mxfp4_swap_chunks.py --out mxfp4_swap_chunks.json      (on a Hopper GPU)
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from flatep.kernels import mxfp4_swap
from flatep.kernels.packed_tiles import MXFP4_SWAP, GemmConfig, default_config
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton
import mxfp4_rank
from mxfp4_rank import main, rank_operands, time_arms

CHUNKS = (1, 2, 4, 8)


def chunked(config: GemmConfig, chunk: int, operands: tuple[torch.Tensor, ...]) -> Callable[[torch.Tensor], None]:
    """An arm: ``config``'s GEMM over ``operands`` into ``out`` with ``CHUNK_STEPS = chunk`` while it
    launches (a CUDA graph holds the kernel compiled for it)."""
    values, scales, rows, offsets = operands

    def run(out: torch.Tensor) -> None:
        default = mxfp4_swap.CHUNK_STEPS
        mxfp4_swap.CHUNK_STEPS = chunk
        try:
            mxfp4_grouped_mm_triton(rows, values, scales, offsets, config, out)
        finally:
            mxfp4_swap.CHUNK_STEPS = default
    return run


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    operands = rank_operands(rows_per_expert, columns, inner)
    triton_tile = default_config(operands[2].shape[0], mxfp4_rank.EXPERTS, "mxfp4")
    cell = {"rows_per_expert": rows_per_expert, "gemm": gemm}
    arms = [({**cell, "tiles": MXFP4_SWAP[rows_per_expert].label, "chunk_steps": chunk,
              "default": chunk == mxfp4_swap.CHUNK_STEPS}, chunked(MXFP4_SWAP[rows_per_expert], chunk, operands))
            for chunk in CHUNKS]
    arms.append(({**cell, "tiles": triton_tile.label, "chunk_steps": None, "default": False},
                 chunked(triton_tile, 1, operands)))
    return time_arms(arms, operands[2].shape[0], columns)


if __name__ == "__main__":
    main(__doc__, sorted(MXFP4_SWAP), time_cell)
