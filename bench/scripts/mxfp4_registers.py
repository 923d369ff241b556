"""The mxfp4 decode tiles at other register limits and programs per SM: does occupancy bound them?

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16 and
32 rows per expert. For each row count, the default tile (:func:`flatep.kernels.packed_tiles.default_config`)
and variants launched with ptxas's register limit (``maxnreg``) lowered so that more programs fit an
SM, or with more stages or warps. Each variant runs both passes of
:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` with pointer copies, as the kernel copied
before it took tensor descriptors on Hopper, timed and compared with the default tile as
:func:`mxfp4_rank.time_arms` does.

    python bench/scripts/mxfp4_registers.py --out mx_registers.json      (on a GPU)
"""
from __future__ import annotations

import torch

from flatep.kernels import quant_gemm
from flatep.kernels.grouped_tiles import persistent_grid
from flatep.kernels.packed_tiles import GemmConfig
import mxfp4_rank
from mxfp4_rank import EXPERTS, main, rank_operands, time_arms

# (tiles, register limit or None); the first of each is the default tile. Local sm_90 compiles
# (Triton 3.6): the 16-row tile takes 168 registers (144 without spilling, 128 with 16 bytes of
# stack); the 32-row tile 234 (168: 104 bytes of stack, 160: 144 bytes); the 32 x 256 tile on
# 8 warps 180 (one program an SM), 128 with 32 bytes of stack.
VARIANTS = {
    16: [(GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True), None),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=7, lane_words=True), 144),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=8, lane_words=True), 128),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=6, programs_per_sm=7, lane_words=True), 144),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=3, programs_per_sm=8, lane_words=True), 128)],
    32: [(GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=2), None),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=3), 168),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=3), 160),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=4, programs_per_sm=2), None),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=3, programs_per_sm=1), None),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=3, programs_per_sm=2), 128),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=4, programs_per_sm=2), 128),
         (GemmConfig(32, 128, 64, num_warps=4, num_stages=3, programs_per_sm=4), 128)],
}


def launch(rows, values, scales, offsets, config: GemmConfig, out, max_registers: int | None, redo) -> None:
    """Both passes of the mxfp4 GEMM, as :func:`quant_gemm.mxfp4_grouped_mm_triton` launches them
    with pointer copies (no borrow slots), with ptxas's register limit ``max_registers``."""
    grid = persistent_grid(rows.shape[0], EXPERTS, values.shape[1], config, rows.device)
    limit = {"maxnreg": max_registers} if max_registers else {}
    for one_multiply in (True, False):
        quant_gemm._mxfp4_grouped_kernel[grid](
            rows, values.view(torch.int32), scales, values.view(torch.int32), scales, out, offsets, redo,
            EXPERTS, EXPERTS, 0, values.shape[1], rows.stride(0), out.stride(0), *scales.stride(), 0, 2**31 - 1,
            rows.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, GROUPS=128, SWAP_AB=False, NATURAL_K=False, LANE_WORDS=config.lane_words,
            ONE_MULTIPLY=one_multiply, TMA=False, INTERPRET=False, MMA=False, num_warps=config.num_warps,
            num_stages=config.num_stages, **limit)


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    values, scales, rows, offsets = rank_operands(rows_per_expert, columns, inner)
    redo = torch.zeros(1, dtype=torch.int32, device=mxfp4_rank.DEVICE)
    arms = [({"rows_per_expert": rows_per_expert, "gemm": gemm, "tiles": config.label, "max_registers": limit},
             lambda out, config=config, limit=limit: launch(rows, values, scales, offsets, config, out, limit, redo))
            for config, limit in VARIANTS[rows_per_expert]]
    return time_arms(arms, rows.shape[0], columns)


if __name__ == "__main__":
    main(__doc__, list(VARIANTS), time_cell)
