"""The quantized-experts benchmark runs end to end at tiny sizes (CPU: interpreter; timings meaningless)."""
from __future__ import annotations

import torch

from flatep.quant import bench
from tests.helpers import DEVICE


def test_bench_cells_at_tiny_sizes(monkeypatch):
    monkeypatch.setattr(bench, "CANDIDATES", bench.CANDIDATES[:1])
    monkeypatch.setattr(bench, "REPLAYS", 1)
    hidden = intermediate = 128
    for format in ("fp8", "mxfp4"):
        w13 = bench._random_bf16((2, 2 * intermediate, hidden), hidden**-0.5, DEVICE)
        w2 = bench._random_bf16((2, hidden, intermediate), intermediate**-0.5, DEVICE)
        q13, q2 = bench._quantize_by_expert(w13, format), bench._quantize_by_expert(w2, format)
        cell = bench.experts_cell("tiny", format, hidden, intermediate, 2, 16, w13, w2, q13, q2, DEVICE, rounds=1)
        assert cell["w13_relative_error"] < 4e-3 and cell["w2_relative_error"] < 4e-3
        assert cell["w13"]["ratio"] > 0 and cell["experts_step"]["ratio"] > 0
    cells = bench.push_cells(DEVICE, rounds=1, borrowed=2, models=(("kimi-k2", ("bf16", "fp8", "mxfp4")),),
                             sizes=(128, 128))
    byte_ratios = [cell["byte_ratio"] for cell in cells]
    assert byte_ratios[0] == 1.0 and byte_ratios[1] < 0.51 and byte_ratios[2] < 0.27
    assert all(cell["us_per_expert"] > 0 for cell in cells)
    assert torch.tensor([cell["expert_bytes"] for cell in cells]).tolist() == [
        3 * 128 * 128 * 2, 3 * 128 * 128 + 4 * 3, 3 * 128 * 128 // 2 + 3 * 128 * 128 // 32]
