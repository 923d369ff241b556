"""The one-launch cost model equals the torch one bit for bit (interpreter on CPU, compiled on a GPU)."""
from __future__ import annotations

import pytest
import torch

from flatep import CostProfile, EPConfig
from flatep.plan.cost import predict
from flatep.plan.cost_triton import predict_triton
from tests.helpers import DEVICE

PROFILES = [
    CostProfile.preset("h200"),
    CostProfile.default(),
    # Extremes: a link of ~0 bandwidth (link terms at their 2**60 cap) and one-row tiles.
    CostProfile(link_gbps=1e-9, hbm_gbps=1.0, gemm_tflops=1.0, group_us=1.0, push_us=1.0, tile_rows=1, name="slow"),
]


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
@pytest.mark.parametrize("ranks, experts_per_rank, candidates", [(2, 2, 3), (8, 48, 6), (4, 3, 1), (16, 2, 6), (3, 5, 2)])
def test_predict_triton_equals_predict(ranks, experts_per_rank, candidates, profile):
    experts = ranks * experts_per_rank
    generator = torch.Generator().manual_seed(ranks * 100 + candidates)
    hist = torch.randint(0, 50, (ranks, experts), generator=generator, dtype=torch.int32)
    sparse = torch.rand(candidates, experts, ranks, generator=generator) < 0.3
    alloc = torch.randint(1, 60, (candidates, experts, ranks), generator=generator, dtype=torch.int32) * sparse
    alloc[0] = 0  # a candidate that computes nothing anywhere
    config = EPConfig(ranks=ranks, experts=experts, top_k=2, hidden=64, intermediate=32, capacity=64)
    constants = profile.constants(config)
    expected = predict(hist, alloc, constants)
    # Candidates as rows of a wider table buffer, as the Triton planners hold them (no copy).
    table = torch.full((candidates, experts * ranks + 9), -7, dtype=torch.int32)
    table[:, 5:5 + experts * ranks] = alloc.reshape(candidates, -1)
    strided = table.to(DEVICE)[:, 5:5 + experts * ranks].view(candidates, experts, ranks)
    for given in (alloc.to(DEVICE), strided):
        got = predict_triton(hist.to(DEVICE), given, constants)
        for field in ("rank_fs", "layer_fs", "experts_moved", "bytes_moved"):
            assert torch.equal(getattr(got, field).cpu(), getattr(expected, field)), field


def test_predict_triton_rejects_mismatched_shapes():
    constants = CostProfile.default().constants(EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=4))
    with pytest.raises(ValueError, match="alloc must be"):
        predict_triton(torch.zeros(2, 4, dtype=torch.int32), torch.zeros(1, 2, 4, dtype=torch.int32), constants)
