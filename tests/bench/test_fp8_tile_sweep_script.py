"""``bench/scripts/fp8_tile_sweep.py`` on the CPU: the default tile first, then each candidate,
through the layer's launch, with the packed fp8 bytes counted (small shapes, under the interpreter)."""
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
def test_the_default_tile_comes_first_and_the_fp8_bytes_are_counted(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    rank = importlib.import_module("mxfp4_rank")
    script = importlib.import_module("fp8_tile_sweep")
    monkeypatch.setattr(rank, "DEVICE", torch.device("cpu"))
    monkeypatch.setattr(rank, "ROUNDS", 1)
    monkeypatch.setattr(rank, "CALLS", 1)
    monkeypatch.setattr(script, "EXPERTS", 2)
    candidates = [GemmConfig(16, 128, 128, num_warps=4, num_stages=5, swap_ab=True)]
    monkeypatch.setattr(script, "CANDIDATES", {16: candidates})
    out = tmp_path / "sweep.json"
    monkeypatch.setattr(sys, "argv", ["fp8_tile_sweep.py", "--out", str(out)])
    script.main(script.__doc__, list(script.CANDIDATES), script.time_cell, {"w13": (128, 256)}, script.fp8_bytes)
    rows = json.loads(out.read_text())["results"]
    assert [row["tiles"] for row in rows] == [config.label for config in (default_config(32, 2, "fp8"), *candidates)]
    assert all(row["weight_bytes"] == 2 * (128 * 256 + 4 * 1 * 2) and row["us"] > 0 for row in rows)
    assert rows[1]["same_bits"]  # the default's tile at another depth: the same sums
