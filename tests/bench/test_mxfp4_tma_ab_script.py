"""``bench/scripts/mxfp4_tma_ab.py`` on the CPU: each tile with descriptor and pointer copies, the
same bits, timed against each other (small shapes, under the interpreter)."""
from __future__ import annotations

import json

from flatep.kernels import quant_gemm
from flatep.kernels.packed_tiles import GemmConfig


def test_each_tile_runs_with_both_copies_and_gives_the_same_bits(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_tma_ab")
    monkeypatch.setattr(script, "TILES", {16: [GemmConfig(16, 128, 64, num_warps=2, lane_words=True)],
                                          32: [GemmConfig(32, 256, 64)]})
    monkeypatch.setattr(quant_gemm, "_mxfp4_descriptors", quant_gemm._mxfp4_descriptors)  # restored after
    described = []  # the descriptor sets the "tma" arms were given
    real = script.DESCRIPTORS
    monkeypatch.setattr(script, "DESCRIPTORS", lambda *operands: described.append(real(*operands)) or described[-1])
    out = tile_scripts.command_line("mxfp4_tma_ab")
    script.main(script.__doc__, list(script.TILES), script.time_cell)
    result = json.loads(out.read_text())
    assert result["device"].startswith("CPU") and result["read_ceiling_gbps"] is None  # measured on GPUs only
    assert all(row["weight_bytes"] == 2 * 256 * (64 + 4) for row in result["results"])
    arms = [(row["rows_per_expert"], row["copies"]) for row in result["results"]]
    assert arms == [(16, "pointers"), (16, "tma"), (32, "pointers"), (32, "tma")]
    assert all(row["same_bits"] and row["us"] > 0 for row in result["results"]), result
    assert described and all(descriptors is not None for descriptors in described)  # the tma arms copied by TMA
