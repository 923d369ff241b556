"""The fp8 Triton tiles against each other at decode sizes: 16, 32, 64, 96 and 192 rows per expert.

One Kimi-K2 rank's experts (48; gate/up N = 4096, K = 7168; down N = 7168, K = 2048; e4m3 values
with one fp32 scale per 128 x 128 block). At each row count the first arm is
:func:`flatep.kernels.packed_tiles.default_config`'s tile (the Triton tiles: below
:data:`flatep.kernels.packed_tiles.WGMMA_ROWS` rows per expert), the others are candidates, chiefly
other pipeline depths and programs an SM (the defaults before bench/results/2026-12-06-h100-f
among them, where that set's run put them first). The 192-row cell's first arm is the tile of
:func:`flatep.kernels.packed_tiles.packed_launches`' hot launch (the groups of more than
:data:`flatep.kernels.packed_tiles.HOT_ROWS` rows in a decode step), which takes
:func:`flatep.kernels.packed_tiles.default_config` without a device; the 96-row cell times the
depths of the tile that short launches run at that size. Every arm runs
:func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton` as the layer does with bf16 rows (each
call quantizes them, then multiplies), timed as :func:`mxfp4_rank.time_tiles` does.

    python bench/scripts/fp8_tile_sweep.py --out fp8_tile_sweep.json      (on a GPU)
"""
from __future__ import annotations

import torch

from flatep.kernels.packed_tiles import GemmConfig, default_config
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton
import mxfp4_rank
from mxfp4_rank import main, time_tiles

EXPERTS, HIDDEN, INTERMEDIATE = 48, 7168, 2048  # a Kimi-K2 rank's experts at R = 8
GEMMS = {"w13": (2 * INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}  # (N, K) of gate/up and down

CANDIDATES = {
    16: [GemmConfig(16, 128, 128, num_warps=4, num_stages=5, swap_ab=True),  # the default before
         GemmConfig(16, 128, 128, num_warps=4, num_stages=4, swap_ab=True),
         GemmConfig(16, 128, 128, num_warps=4, num_stages=6, swap_ab=True),
         GemmConfig(16, 128, 128, num_warps=4, num_stages=3, swap_ab=True, programs_per_sm=3)],
    32: [GemmConfig(64, 128, 128, num_warps=4, num_stages=4),  # the default before
         GemmConfig(64, 128, 128, num_warps=4, num_stages=5),
         GemmConfig(32, 128, 128, num_warps=4, num_stages=4, swap_ab=True),
         GemmConfig(32, 128, 128, num_warps=4, num_stages=4),
         GemmConfig(32, 128, 128, num_warps=4, num_stages=3, swap_ab=True),
         GemmConfig(64, 128, 128, num_warps=4, num_stages=2, programs_per_sm=4),  # more programs, fewer stages
         GemmConfig(64, 64, 128, num_warps=4, num_stages=3, programs_per_sm=4)],
    64: [GemmConfig(64, 128, 128, num_warps=4, num_stages=4),  # the default before
         GemmConfig(64, 128, 128, num_warps=4, num_stages=5),
         GemmConfig(64, 128, 128, num_warps=4, num_stages=2, programs_per_sm=4),
         GemmConfig(64, 64, 128, num_warps=4, num_stages=3, programs_per_sm=4)],
    96: [GemmConfig(64, 128, 128, num_warps=4, num_stages=4)],
    192: [GemmConfig(64, 128, 128, num_warps=4, num_stages=3)],
}


def fp8_bytes(columns: int, inner: int) -> int:
    """Packed bytes of :data:`EXPERTS` fp8 weights ``[N, K]``: e4m3 values and fp32 block scales."""
    return EXPERTS * (columns * inner + 4 * -(-columns // 128) * (inner // 128))


def rank_operands(rows_per_expert: int, columns: int, inner: int) -> tuple[torch.Tensor, ...]:
    """Random e4m3 values ``[E, N, K]`` (any byte but NaN's), block scales ``[E, N/128, K/128]``
    float32, rows ``[E * rows_per_expert, K]`` bf16 and their offsets ``[E]`` int32."""
    device = mxfp4_rank.DEVICE
    codes = torch.randint(0, 256, (EXPERTS, columns, inner), dtype=torch.uint8, device=device)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # e4m3fn's NaN codes, as a checkpoint never holds them
    scales = torch.rand(EXPERTS, -(-columns // 128), inner // 128, device=device) * 1e-3 + 1e-4
    rows = torch.randn(EXPERTS * rows_per_expert, inner, device=device).to(torch.bfloat16)
    offsets = torch.arange(1, EXPERTS + 1, device=device, dtype=torch.int32) * rows_per_expert
    return codes.view(torch.float8_e4m3fn), scales, rows, offsets


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    operands = rank_operands(rows_per_expert, columns, inner)
    tiles = [default_config(operands[2].shape[0], EXPERTS, "fp8"), *CANDIDATES[rows_per_expert]]
    return time_tiles(rows_per_expert, gemm, tiles, fp8_grouped_mm_triton, operands)


if __name__ == "__main__":
    main(__doc__, list(CANDIDATES), time_cell, GEMMS, fp8_bytes)
