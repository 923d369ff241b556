"""``bench/scripts/mxfp4_tile_sweep.py`` on the CPU: the default tile first, then each candidate
(a register limit among them), through the layer's launch (small shapes, under the interpreter)."""
from __future__ import annotations

import json

from flatep.kernels.packed_tiles import GemmConfig, default_config


def test_the_default_tile_comes_first_and_every_candidate_runs(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_tile_sweep")
    candidates = [GemmConfig(32, 64, 128, num_warps=2, lane_words=True, max_registers=168), GemmConfig(16, 128, 64)]
    monkeypatch.setattr(script, "CANDIDATES", {32: candidates})
    out = tile_scripts.command_line("mxfp4_tile_sweep")
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    expected = [default_config(64, 2, "mxfp4"), *candidates]
    assert [row["tiles"] for row in rows] == [config.label for config in expected]
    assert rows[1]["tiles"].endswith("lanewords r168")
    assert [row["default"] for row in rows] == [True, False, False]
    assert all(row["us"] > 0 for row in rows)
    assert rows[1]["same_bits"]  # 128-wide K steps in the lane order, as the default's: the same sums


def test_rows_picks_the_cells(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_tile_sweep")
    candidate = GemmConfig(16, 128, 64, num_warps=2)
    monkeypatch.setattr(script, "CANDIDATES", {32: [GemmConfig(32, 64, 128, num_warps=2)], 16: [candidate]})
    out = tile_scripts.command_line("mxfp4_tile_sweep", "--rows", "16")
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    assert [row["rows_per_expert"] for row in rows] == [16, 16]
    assert [row["tiles"] for row in rows] == [default_config(32, 2, "mxfp4").label, candidate.label]
