"""``bench/scripts/mxfp4_tile_sweep.py`` on the CPU: the default tile first, then each candidate
(a register limit among them), through the layer's launch (small shapes, under the interpreter)."""
from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from flatep.kernels.backend import interpreting
from flatep.kernels.quant_gemm import GemmConfig, default_config

SCRIPTS = Path(__file__).resolve().parents[2] / "bench" / "scripts"


@pytest.mark.skipif(not interpreting(), reason="runs the script's kernels under TRITON_INTERPRET=1")
def test_the_default_tile_comes_first_and_every_candidate_runs(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    rank = importlib.import_module("mxfp4_rank")
    script = importlib.import_module("mxfp4_tile_sweep")
    monkeypatch.setattr(rank, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(rank, "EXPERTS", 2)
    monkeypatch.setattr(rank, "GEMMS", {"w13": (256, 128)})
    monkeypatch.setattr(rank, "ROUNDS", 1)
    monkeypatch.setattr(rank, "CALLS", 1)
    candidates = [GemmConfig(32, 64, 128, num_warps=2, lane_words=True, max_registers=168), GemmConfig(16, 128, 64)]
    monkeypatch.setattr(script, "CANDIDATES", {32: candidates})
    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["mxfp4_tile_sweep.py", "--out", str(out)])
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    expected = [default_config(64, 2, "mxfp4"), *candidates]
    assert [row["tiles"] for row in rows] == [config.label for config in expected]
    assert rows[1]["tiles"].endswith("lanewords r168")
    assert [row["default"] for row in rows] == [True, False, False]
    assert all(row["us"] > 0 for row in rows)
    assert rows[2]["same_bits"]  # 64-wide K steps, as the default's: the same sums
