"""``bench/scripts/fp8_tile_sweep.py`` on the CPU: the default tile first, then each candidate,
through the layer's launch, with the packed fp8 bytes counted (small shapes, under the interpreter)."""
from __future__ import annotations

import json

from flatep.kernels.packed_tiles import GemmConfig, default_config


def test_the_default_tile_comes_first_and_the_fp8_bytes_are_counted(tile_scripts, monkeypatch):
    script = tile_scripts.load("fp8_tile_sweep")
    monkeypatch.setattr(script, "EXPERTS", 2)
    candidates = [GemmConfig(16, 128, 128, num_warps=4, num_stages=5, swap_ab=True)]
    monkeypatch.setattr(script, "CANDIDATES", {16: candidates})
    out = tile_scripts.command_line("fp8_tile_sweep")
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell, {"w13": (128, 256)}, script.fp8_bytes)
    rows = json.loads(out.read_text())["results"]
    assert [row["tiles"] for row in rows] == [config.label for config in (default_config(32, 2, "fp8"), *candidates)]
    assert all(row["weight_bytes"] == 2 * (128 * 256 + 4 * 1 * 2) and row["us"] > 0 for row in rows)
    assert rows[1]["same_bits"]  # the default's tile at another depth: the same sums
