"""The quantized-experts benchmark runs end to end at tiny sizes (CPU: interpreter; timings meaningless)."""
from __future__ import annotations

import torch

from flatep.quant import QuantizedTensor, bench
from tests.helpers import DEVICE

HIDDEN = 128  # hidden and intermediate sizes alike


def tiny_experts(format: str) -> tuple[torch.Tensor, torch.Tensor, QuantizedTensor, QuantizedTensor]:
    """Two fresh random experts at :data:`HIDDEN`: ``w13 [2, 2 * HIDDEN, HIDDEN]`` and ``w2 [2, HIDDEN,
    HIDDEN]`` bf16, and both quantized to ``format`` by expert."""
    w13 = bench._random_bf16((2, 2 * HIDDEN, HIDDEN), HIDDEN**-0.5, DEVICE)
    w2 = bench._random_bf16((2, HIDDEN, HIDDEN), HIDDEN**-0.5, DEVICE)
    return w13, w2, bench.quantize_by_expert(w13, format), bench.quantize_by_expert(w2, format)


def test_bench_cells_at_tiny_sizes(monkeypatch):
    monkeypatch.setattr(bench, "CANDIDATES", {format: configs[:1] for format, configs in bench.CANDIDATES.items()})
    monkeypatch.setattr(bench, "REPLAYS", 1)
    hidden = intermediate = HIDDEN
    for format in ("fp8", "mxfp4"):
        w13, w2, q13, q2 = tiny_experts(format)
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


def test_quick_cells_at_tiny_sizes(monkeypatch):
    monkeypatch.setattr(bench, "CANDIDATES", {format: configs[:1] for format, configs in bench.CANDIDATES.items()})
    monkeypatch.setattr(bench, "REPLAYS", 1)
    hidden = intermediate = HIDDEN
    for format in ("fp8", "mxfp4"):
        w13, w2, q13, q2 = tiny_experts(format)
        entries = bench.quick_cells("tiny", format, hidden, intermediate, 2, w13, w2, q13, q2, DEVICE, (16,))
        arms = [("bf16", None)] + [("through_bf16", None)] * (format == "mxfp4")
        arms += [("tiles", vars(config)) for config in bench._candidates(format, 16, DEVICE)]
        assert [(entry["gemm"], entry["path"], entry["config"]) for entry in entries] == [
            (gemm, *arm) for gemm in ("w13", "w2") for arm in arms]
        packed = [entry for entry in entries if entry["path"] != "bf16"]
        assert all(entry["relative_error"] < 4e-3 and entry["us"] > 0 and entry["ratio"] > 0 for entry in packed)
        summary = bench.best_configs(entries)
        assert [entry["gemm"] for entry in summary] == ["w13", "w2", "w13+w2"]
        assert all(entry["ratio"] > 0 for entry in summary)
        late = bench.quick_cells("tiny", format, hidden, intermediate, 2, w13, w2, q13, q2, DEVICE, (16,), deadline=0.0)
        assert all(entry.get("skipped") == "deadline" and entry["us"] is None
                   for entry in late if entry["path"] != "bf16")


def test_quick_cells_run_the_tall_fp8_candidates(monkeypatch):
    """The sweep's rescaled prefill candidates run through quick_cells as any other config, each
    checked against the torch path."""
    tall = tuple(config for config in bench.CANDIDATES["fp8"] if config.rescale and config.block_m >= 128)
    assert len(tall) == 3
    monkeypatch.setattr(bench, "CANDIDATES", {**bench.CANDIDATES, "fp8": tall})
    monkeypatch.setattr(bench, "REPLAYS", 1)
    hidden = intermediate = HIDDEN
    w13, w2, q13, q2 = tiny_experts("fp8")
    entries = bench.quick_cells("tiny", "fp8", hidden, intermediate, 2, w13, w2, q13, q2, DEVICE, (128,))
    packed = [entry for entry in entries if entry["path"] == "tiles"]
    assert sum(entry["config"]["rescale"] for entry in packed) == 2 * len(tall)  # both GEMMs, beside the default
    assert all(entry["relative_error"] < 4e-3 and entry["us"] > 0 for entry in packed)
