"""CostProfile validation and files, and the cost model's arithmetic on hand-made allocations."""
from __future__ import annotations

import json
import math

import pytest
import torch

from flatep import CostProfile, EPConfig
from flatep.plan.cost import CostConstants, local_entries, predict

FIELDS = dict(link_gbps=100.0, hbm_gbps=1000.0, gemm_tflops=10.0, group_us=2.0, push_us=5.0, tile_rows=4)


@pytest.mark.parametrize("name", sorted(FIELDS))
@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, "fast", True])
def test_bad_field_is_rejected_by_name(name, bad):
    with pytest.raises(ValueError, match=f"CostProfile.{name} "):
        CostProfile(**{**FIELDS, name: bad})


def test_tile_rows_must_be_an_integer():
    with pytest.raises(ValueError, match="CostProfile.tile_rows"):
        CostProfile(**{**FIELDS, "tile_rows": 2.5})


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_missing_field_in_a_file_is_named(tmp_path, name):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({key: value for key, value in FIELDS.items() if key != name}))
    with pytest.raises(ValueError, match=f"missing field.*{name}"):
        CostProfile.load(path)


def test_unknown_field_and_bad_json_are_rejected(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**FIELDS, "nvlink": 3}))
    with pytest.raises(ValueError, match="unknown field.*nvlink"):
        CostProfile.load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        CostProfile.load(path)
    path.write_text(json.dumps({**FIELDS, "hbm_gbps": None}))
    with pytest.raises(ValueError, match="CostProfile.hbm_gbps"):
        CostProfile.load(path)


def test_save_load_round_trip_and_presets(tmp_path):
    profile = CostProfile(**FIELDS, name="test")
    profile.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == profile
    assert CostProfile.default() == CostProfile.preset("generic")
    assert CostProfile.preset("h200").name == "h200"
    with pytest.raises(ValueError, match="preset must be one of"):
        CostProfile.preset("tpu")


@pytest.mark.parametrize("bad", [3, "wide", [[128]], [[0, 0.1]], [[128, 1.0]], [[128, -0.1]], [[math.nan, 0.1]],
                                 [[128, math.inf]], [[True, 0.1]], [[128, "a"]]])
def test_bad_margins_are_rejected_by_name(bad):
    with pytest.raises(ValueError, match="CostProfile.margins must be"):
        CostProfile(**FIELDS, margins=bad)


def test_margin_is_the_nearest_measured_step_in_log_rows(tmp_path):
    profile = CostProfile(**FIELDS, margins=[[20, 0.05], [150, 0.08], [600, 0.02]])
    assert profile.margins == ((20.0, 0.05), (150.0, 0.08), (600.0, 0.02))
    profile.save(tmp_path / "p.json")
    assert CostProfile.load(tmp_path / "p.json") == profile
    # Kimi-K2 sizes: T*K/E = 1, 22, 171, 683, 1366 rows per expert at R = 8 virtual ranks.
    config = EPConfig(ranks=8, experts=384, top_k=8, hidden=64, intermediate=32, capacity=8192)
    assert [profile.margin(config, 8 * s) for s in (1, 128, 1024, 4096, 8192)] == [0.05, 0.05, 0.08, 0.02, 0.02]
    # Sizes are matched within their regime (at most 64 rows per expert: the decode kernels'):
    # s = 384 (64 rows) takes the decode size's margin, s = 385 (65 rows) the nearest larger one.
    assert (profile.margin(config, 8 * 384), profile.margin(config, 8 * 385)) == (0.05, 0.08)
    grouped_only = CostProfile(**FIELDS, margins=[[150, 0.08]])
    assert [grouped_only.margin(config, 8 * s) for s in (1, 128, 1024)] == [0.0, 0.0, 0.08]
    assert profile.margin(config, None) == 0.0
    assert CostProfile(**FIELDS).margin(config, 8192) == CostProfile(**FIELDS, margins=[]).margin(config, 8192) == 0.0
    assert profile.constants(config, total_tokens=8 * 1024).margin_ppm == 80_000
    assert profile.constants(config).margin_ppm == 0
    nearly_whole = CostProfile(**FIELDS, margins=[[150, 0.9999999]])
    assert nearly_whole.constants(config, total_tokens=8 * 1024).margin_ppm == 999_999


def test_constants_are_integer_femtoseconds():
    config = EPConfig(ranks=2, experts=2, top_k=1, hidden=10, intermediate=5, capacity=4)
    constants = CostProfile(**FIELDS).constants(config)
    weight_bytes = 3 * 10 * 5 * 2
    assert constants == CostConstants(
        row_fs=round(6 * 10 * 5 / 10e12 * 1e15),  # 30 fs per row
        tile_rows=4,
        weight_fs=round(weight_bytes / 1000e9 * 1e15),
        group_fs=2 * 10**9,
        push_fs=5 * 10**9,
        byte_fs=round(1e15 / 100e9),
        weight_bytes=weight_bytes,
        row_bytes=2 * 10 * 2 + 4,
    )
    # A link of ~0 bandwidth is clamped so that no link term can overflow int64.
    slow = CostProfile(**{**FIELDS, "link_gbps": 1e-30}).constants(config)
    assert 0 < slow.byte_fs and slow.byte_fs * 2 * 4 * slow.row_bytes < 2**62


def brute_local(tpe, alloc):
    ranks, experts = len(tpe), len(tpe[0])
    local = [0] * ranks
    for e in range(experts):
        sources = [r for r in range(ranks) for _ in range(tpe[r][e])]
        destinations = [d for d in range(ranks) for _ in range(alloc[e][d])]
        for s, d in zip(sources, destinations):
            local[s] += s == d
    return local


def test_local_entries_match_a_brute_force_count():
    generator = torch.Generator().manual_seed(3)
    tpe = torch.randint(0, 6, (3, 6), generator=generator)
    counts = tpe.sum(0)
    alloc = torch.zeros(6, 3, dtype=torch.int64)
    for e in range(6):  # a random split of each expert's rows over the ranks
        cuts = sorted(torch.randint(0, int(counts[e]) + 1, (2,), generator=generator).tolist())
        alloc[e] = torch.tensor([cuts[0], cuts[1] - cuts[0], int(counts[e]) - cuts[1]])
    assert local_entries(tpe, alloc.unsqueeze(0))[0].tolist() == brute_local(tpe.tolist(), alloc.tolist())


def test_prediction_of_a_hand_made_step():
    # Two ranks, one expert each; rank 0 sends 3 entries of expert 0 and 1 of expert 1, rank 1
    # sends 5 of expert 0. Candidate 0 keeps everything home; candidate 1 moves 4 rows of expert 0
    # (rank 1's last 4 entries of it) to rank 1.
    constants = CostConstants(row_fs=10, tile_rows=4, weight_fs=50, group_fs=7, push_fs=1000,
                              byte_fs=3, weight_bytes=100, row_bytes=2)
    tpe = torch.tensor([[3, 1], [5, 0]])
    alloc = torch.tensor([[[8, 0], [0, 1]], [[4, 4], [0, 1]]])
    prediction = predict(tpe, alloc, constants)
    # classic: rank 0 computes 8 rows of e0 (2 tiles: 80 fs > weight 50) + 7, receives 5 entries
    # from rank 1 and sends 1 (e1) -> max 5; rank 1: 1 row of e1 (weight floor 50) + 7, sends 5.
    classic = [80 + 7 + 5 * 2 * 3, 50 + 7 + 5 * 2 * 3]
    # moved: rank 0: e0 4 rows (weight 50 > 40) + 7; entries: sends 1 (e1), receives 1 (rank 1's
    # first e0 entry) -> 1; lends one expert: push 1 * 100 * 3, plus push_fs.
    # rank 1: e0 4 rows + e1 1 row: (50 + 7) * 2; its 4 last e0 entries stay local, sends 1,
    # receives 1 (e1) -> 1; receives one expert.
    moved = [50 + 7 + 1 * 2 * 3 + 300 + 1000, 2 * (50 + 7) + 1 * 2 * 3 + 300 + 1000]
    assert prediction.rank_fs.tolist() == [classic, moved]
    assert prediction.layer_fs.tolist() == [max(classic), max(moved)]
    assert prediction.experts_moved.tolist() == [0, 1]
    assert prediction.bytes_moved.tolist() == [0, 100]


def test_predict_rejects_mismatched_shapes():
    constants = CostProfile(**FIELDS).constants(EPConfig(ranks=2, experts=2, top_k=1, hidden=4, intermediate=4, capacity=4))
    with pytest.raises(ValueError, match=r"alloc must be \[C, E, R\]"):
        predict(torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64), constants)


def test_expert_bytes_set_the_weight_terms_and_are_validated():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=256, intermediate=128, capacity=8)
    bf16 = CostProfile(**FIELDS).constants(config)
    packed = CostProfile(**FIELDS).with_expert_bytes(config.expert_bytes() // 2).constants(config)
    assert bf16.weight_bytes == config.expert_bytes() and packed.weight_bytes == config.expert_bytes() // 2
    assert packed.weight_fs * 2 == pytest.approx(bf16.weight_fs, abs=2)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="expert_bytes"):
            CostProfile(**FIELDS, expert_bytes=bad)
