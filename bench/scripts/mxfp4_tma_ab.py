"""The mxfp4 GEMMs' copies by tensor descriptor (TMA) against pointer copies, tile by tile.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16, 32,
128 and 256 rows per expert, with the tiles the layer takes there (:func:`default_config`) and a
few neighbours. Each tile runs both ways through :func:`mxfp4_grouped_mm_triton`: as it stands (on
Hopper, descriptors), and with ``_mxfp4_descriptors`` replaced by one that returns None (pointer
copies, as before descriptors), timed and compared with the first arm as
:func:`mxfp4_rank.time_arms` does.

    python bench/scripts/mxfp4_tma_ab.py --out mxfp4_tma_ab.json      (on a Hopper GPU)
"""
from __future__ import annotations

from flatep.kernels import quant_gemm
from flatep.kernels.packed_tiles import GemmConfig
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton
from mxfp4_rank import main, rank_operands, time_arms

TILES = {
    16: [GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True)],
    32: [GemmConfig(32, 256, 64, num_warps=4, num_stages=3), GemmConfig(32, 256, 64, num_warps=4, num_stages=3,
                                                                       lane_words=True)],
    128: [GemmConfig(64, 256, 64, num_warps=4, num_stages=3)],
    256: [GemmConfig(64, 256, 64, num_warps=4, num_stages=3), GemmConfig(64, 256, 64, num_warps=4, num_stages=4)],
}
DESCRIPTORS = quant_gemm._mxfp4_descriptors


def gemm_with(copies: str, rows, values, scales, offsets, config: GemmConfig, out) -> None:
    """The GEMM with ``copies`` (``tma``: as it stands; ``pointers``: no descriptors). The choice is
    made on the host as the call is captured, so a graph keeps it."""
    previous = quant_gemm._mxfp4_descriptors
    quant_gemm._mxfp4_descriptors = DESCRIPTORS if copies == "tma" else (lambda *operands: None)
    try:
        mxfp4_grouped_mm_triton(rows, values, scales, offsets, config, out)
    finally:
        quant_gemm._mxfp4_descriptors = previous


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    values, scales, rows, offsets = rank_operands(rows_per_expert, columns, inner)
    arms = [({"rows_per_expert": rows_per_expert, "gemm": gemm, "copies": copies, "tiles": config.label},
             lambda out, copies=copies, config=config: gemm_with(copies, rows, values, scales, offsets, config, out))
            for config in TILES[rows_per_expert] for copies in ("pointers", "tma")]
    return time_arms(arms, rows.shape[0], columns)


if __name__ == "__main__":
    main(__doc__, list(TILES), time_cell)
