"""The mxfp4 tiles against each other where the layer launches them: 32, 16 and 128 rows per expert.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072). At each row
count the first arm is :func:`flatep.kernels.packed_tiles.default_config`'s tile, the others are
candidates (the defaults before bench/results/2026-12-06-h100-f among them, where this sweep's
first two runs put them first): wider K steps (fewer instructions a weight, more registers), fewer columns or warps a
program, and register limits (``GemmConfig.max_registers``) that let more programs share an SM.
Every arm runs :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` as the layer does (on
Hopper, copies by tensor descriptor), timed as :func:`mxfp4_rank.time_tiles` does; a K step other
than the default's sums in another order, so its bits may differ (``same_bits``).
Registers, stack and resident programs of each tile: ``bench/scripts/gemm_kloop_sass.py``.

    python bench/scripts/mxfp4_tile_sweep.py --out mxfp4_tile_sweep.json      (on a GPU)
    python bench/scripts/mxfp4_tile_sweep.py --out FILE --rows 16 32         (some cells only)
"""
from __future__ import annotations

from flatep.kernels.packed_tiles import GemmConfig
from mxfp4_rank import default_then, main

# Candidates per row count; registers from a local sm_90 compile (Triton 3.6, copies by descriptor).
CANDIDATES = {
    32: [GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=3, lane_words=True,
                    max_registers=168),  # 198 unlimited; 80 bytes of stack
         GemmConfig(32, 128, 64, num_warps=2, num_stages=4, programs_per_sm=4, lane_words=True),  # 208
         GemmConfig(32, 64, 128, num_warps=2, num_stages=4, programs_per_sm=5, lane_words=True),  # 186
         GemmConfig(32, 64, 128, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True,
                    max_registers=168),  # 8 bytes of stack
         GemmConfig(32, 128, 128, num_warps=2, num_stages=3, programs_per_sm=4, lane_words=True),  # 215
         GemmConfig(32, 128, 128, num_warps=2, num_stages=3, programs_per_sm=5, lane_words=True,
                    max_registers=200),  # 88 bytes of stack
         GemmConfig(32, 128, 128, num_warps=4, num_stages=3, programs_per_sm=3, lane_words=True,
                    max_registers=168),  # 184 unlimited; 48 bytes of stack
         GemmConfig(32, 256, 128, num_warps=4, num_stages=2, lane_words=True),  # 218
         GemmConfig(32, 256, 64, num_warps=4, num_stages=3, lane_words=True),  # the default before 2026-12-06-h100-f
         GemmConfig(32, 256, 128, num_warps=4, num_stages=4, lane_words=True),  # 240
         GemmConfig(32, 128, 128, num_warps=2, num_stages=4, programs_per_sm=4, lane_words=True),  # 215
         GemmConfig(32, 128, 128, num_warps=2, num_stages=3, programs_per_sm=3, lane_words=True),
         GemmConfig(32, 256, 64, num_warps=8, num_stages=3, programs_per_sm=2, lane_words=True,
                    max_registers=128),  # 147 unlimited; 48 bytes of stack
         GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True)],  # two row tiles
    16: [GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True),  # the default before
         GemmConfig(16, 128, 128, num_warps=2, num_stages=4, programs_per_sm=5, lane_words=True),  # 152
         GemmConfig(16, 256, 128, num_warps=4, num_stages=3, programs_per_sm=3, lane_words=True),  # 139
         GemmConfig(16, 256, 128, num_warps=4, num_stages=4, programs_per_sm=3, lane_words=True),  # 141
         GemmConfig(16, 128, 128, num_warps=2, num_stages=2, programs_per_sm=6, lane_words=True),
         GemmConfig(16, 128, 256, num_warps=2, num_stages=2, programs_per_sm=4, lane_words=True),  # 234
         GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=7, lane_words=True),  # 142
         GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=8, lane_words=True,
                    max_registers=128)],  # no stack
    128: [GemmConfig(64, 256, 64, num_warps=4, num_stages=3),  # the default before
          GemmConfig(64, 256, 128, num_warps=4, num_stages=2, programs_per_sm=1),  # 255
          GemmConfig(64, 128, 64, num_warps=4, num_stages=4, programs_per_sm=3),  # 165
          GemmConfig(64, 128, 64, num_warps=4, num_stages=5, programs_per_sm=3)],
}


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    return default_then(rows_per_expert, gemm, columns, inner, CANDIDATES[rows_per_expert])


if __name__ == "__main__":
    main(__doc__, list(CANDIDATES), time_cell)
