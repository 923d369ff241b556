"""The one-launch cost model equals the torch one bit for bit (interpreter on CPU, compiled on a GPU)."""
from __future__ import annotations

import pytest
import torch

from flatep import CostProfile, EPConfig
from flatep.plan.auto import choose
from flatep.plan.cost import Prediction, predict
from flatep.plan.cost_triton import choose_triton, predict_triton
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


@pytest.mark.parametrize("layer_fs, size", [
    ([5, 3, 9, 3], 10),  # a tie: the first of the least wins, as torch.argmin
    ([7], 1),
    ([2**50, 2**50 - 1, 2**50], 5000),  # a table wider than one program's block
    ([2**61 + 1, 2**62 + 2**61, 2**62], 7),  # times of a few link caps (2**60): no packing may overflow
    ([4, 4, 4, 4, 4, 4], 3),
])
def test_choose_triton_takes_the_first_least_and_copies_its_row(layer_fs, size):
    layer_fs = torch.tensor(layer_fs, dtype=torch.int64)
    moved = torch.arange(layer_fs.shape[0], dtype=torch.int64)
    tables = torch.randint(-2**31, 2**31 - 1, (layer_fs.shape[0], size), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(size))
    choice, chosen = choose_triton(layer_fs.to(DEVICE), moved.to(DEVICE), tables.to(DEVICE))
    assert int(choice) == int(torch.argmin(layer_fs)) and choice.dtype == torch.int64 and choice.dim() == 0
    assert torch.equal(chosen.cpu(), tables[int(torch.argmin(layer_fs))])


@pytest.mark.parametrize("margin_ppm", [0, 1, 40_000, 100_000, 999_999])
def test_choose_triton_charges_the_margin_to_moving_candidates_as_choose(margin_ppm):
    generator = torch.Generator().manual_seed(margin_ppm)
    for _ in range(20):
        classic = int(torch.randint(10**9, 2**61, (1,), generator=generator))
        # Movers around classic's time, some within the margin, some beyond; some move nothing.
        layer_fs = (classic * (0.85 + 0.3 * torch.rand(6, generator=generator, dtype=torch.float64))).long()
        layer_fs[0] = classic
        moved = torch.randint(0, 3, (6,), generator=generator, dtype=torch.int64)
        moved[0] = 0
        tables = torch.arange(6 * 4, dtype=torch.int32).view(6, 4)
        expected = int(choose(Prediction(layer_fs.view(1, -1).T, layer_fs, moved, moved), margin_ppm))
        penalty = (classic // 10**6) * margin_ppm
        scores = [int(t) + (penalty if int(m) > 0 else 0) for t, m in zip(layer_fs, moved)]
        assert expected == scores.index(min(scores))
        choice, chosen = choose_triton(layer_fs.to(DEVICE), moved.to(DEVICE), tables.to(DEVICE), margin_ppm)
        assert int(choice) == expected and torch.equal(chosen.cpu(), tables[expected])


def test_choose_triton_rejects_bad_arguments():
    layer_fs = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    tables = torch.zeros(3, 4, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="layer_fs must be"):
        choose_triton(layer_fs.int(), layer_fs, tables)
    with pytest.raises(ValueError, match="experts_moved must be"):
        choose_triton(layer_fs, layer_fs[:2], tables)
    with pytest.raises(ValueError, match="tables must be"):
        choose_triton(layer_fs, layer_fs, torch.zeros(2, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="margin_ppm must be"):
        choose_triton(layer_fs, layer_fs, tables, 10**6)
