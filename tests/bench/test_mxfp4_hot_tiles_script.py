"""``bench/scripts/mxfp4_hot_tiles.py`` on the CPU: the default tile first, then each 64- and 128-row
candidate (a register limit among them), through the layer's launch (small shapes, under the interpreter)."""
from __future__ import annotations

import json

from flatep.kernels.packed_tiles import GemmConfig, default_config


def test_the_default_tile_comes_first_and_each_tall_candidate_gives_its_bits(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_hot_tiles")
    assert all(GemmConfig(64, 256, 64, num_warps=4, num_stages=4) not in tiles for tiles in script.CANDIDATES.values())
    candidates = [GemmConfig(128, 128, 64, num_warps=8, num_stages=3, programs_per_sm=2, max_registers=128),
                  GemmConfig(64, 128, 64, num_stages=4, programs_per_sm=3)]
    monkeypatch.setattr(script, "CANDIDATES", {96: candidates})
    out = tile_scripts.command_line("mxfp4_hot_tiles")
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    expected = [default_config(2 * 96, 2, "mxfp4"), *candidates]
    assert [row["tiles"] for row in rows] == [config.label for config in expected]
    assert rows[0]["tiles"].startswith("m64 ") and rows[1]["tiles"].endswith("r128")
    assert [row["default"] for row in rows] == [True, False, False]
    assert all(row["us"] > 0 and row["same_bits"] for row in rows)  # 64-wide K steps in every tile: the same sums
