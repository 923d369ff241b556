"""flatep calibrate: the fit's arithmetic with a fake timer, and a clear error without a GPU."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from flatep import CostProfile, EPConfig, preset
from flatep.bench.calibrate import (
    STEP_POLICIES, STEP_SIGMAS, TFLOPS_GRID, GemmFit, calibrate, fit_margins, fit_profile, gemm_us,
)
from flatep.cli import main
from flatep.plan.cost import few_rows_per_expert

CONFIG = EPConfig(ranks=8, experts=64, top_k=8, hidden=1024, intermediate=512, capacity=64)
# Compute-bound enough at 32-row tiles that the decode tile shows in the times (weight read 1.57 us,
# a 32-row tile 2.0 us); gemm_tflops on the fit's grid, so that it is recovered exactly.
TRUE = CostProfile(link_gbps=150.0, hbm_gbps=2000.0, gemm_tflops=TFLOPS_GRID[40], group_us=3.0, push_us=30.0,
                   tile_rows=128, name="x", decode_gemm_tflops=TFLOPS_GRID[0], decode_group_us=1.5, decode_tile_rows=32)
DATA = Path(__file__).parent / "data"
# Steps of CONFIG: 8 and 32 tokens per rank hold 8 and 32 rows per expert (decode kernels), 256 hold 256.
TOKENS = (8, 32, 256)


def model_us(profile: CostProfile, config: EPConfig, groups: list[int], total_tokens: int) -> float:
    """The cost model's GEMM term of one rank, in floating point."""
    few = few_rows_per_expert(config, total_tokens)
    group = profile.decode_group_us if few else profile.group_us
    tile = profile.decode_tile_rows if few else profile.tile_rows
    tflops = profile.decode_gemm_tflops if few else profile.gemm_tflops
    weight = (config.expert_bytes() if profile.expert_bytes is None else profile.expert_bytes) / (profile.hbm_gbps * 1e3)
    row = 6 * config.hidden * config.intermediate / (tflops * 1e6)
    return sum(group + max(weight, math.ceil(rows / tile) * tile * row) for rows in groups)


def fake_timer(measurement):
    """Times the profile ``TRUE`` implies; never runs the measurement."""
    if measurement.kind == "experts":
        return model_us(TRUE, CONFIG, measurement.params["groups"], measurement.params["total_tokens"])
    if measurement.kind == "read":
        return measurement.params["bytes"] / (TRUE.hbm_gbps * 1e3)
    raise AssertionError(f"no peer on this machine, yet {measurement.kind} was timed")


def test_calibrate_recovers_the_profile_from_fake_times():
    lines = []
    profile = calibrate(CONFIG, "cpu", timer=fake_timer, base=CostProfile.default(), log=lines.append, tokens=TOKENS)
    # The times are the model's own: no rank is off against another, so no margin, at the one
    # measured size beyond the decode regime (s = 256: 256 rows per expert; 8 and 32 are decode steps).
    assert [rows for rows, _ in profile.margins] == [256.0]
    assert all(margin < 1e-12 for _, margin in profile.margins)
    assert (profile.tile_rows, profile.decode_tile_rows) == (TRUE.tile_rows, TRUE.decode_tile_rows)
    for name in ("hbm_gbps", "gemm_tflops", "group_us", "decode_gemm_tflops", "decode_group_us"):
        assert getattr(profile, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    # Unmeasured here: kept from the base profile, and said so.
    assert profile.link_gbps == CostProfile.default().link_gbps and profile.push_us == CostProfile.default().push_us
    assert any("no peer GPU" in line for line in lines)
    # Every planned step's ranks were timed: both policies, both regimes, borrowed slots included.
    timed = [line for line in lines if line.startswith("experts")]
    assert len(timed) == len(TOKENS) * len(STEP_SIGMAS) * len(STEP_POLICIES) * CONFIG.ranks


def test_margins_are_the_ranks_spread_against_each_other_per_step_size():
    """Two steps of one size: in each, one rank is 10% slower than the model and one 10% faster,
    on top of a step-wide factor (which the margin leaves out)."""
    fit = GemmFit(tile_rows=128, row_us=0.01, group_us=1.0, worst=0.0)
    groups = [[100, 50], [100, 50], [300], [300]]
    samples = []
    for total_tokens, scale in ((1024, 1.3), (4096, 0.7)):
        for sigma in (0.0, 1.0):
            for factor, rank_groups in zip((1.0, 1.1, 0.9, 1.0), groups):
                params = {"groups": rank_groups, "total_tokens": total_tokens, "sigma": sigma, "policy": "none"}
                samples.append((params, scale * factor * gemm_us(rank_groups, 2.0, fit)))
    margins = fit_margins(CONFIG, samples, 2.0, fit)
    # Deviations from the median (1.0): 0, +0.1, -0.1, 0 per step: rms sqrt(0.005), margin sqrt(2)*rms = 0.1.
    assert [rows for rows, _ in margins] == [1024 * 8 / 64, 4096 * 8 / 64]
    assert all(margin == pytest.approx(0.1, rel=1e-9) for _, margin in margins)
    # Decode steps (at most 64 rows per expert: s = 8 holds 8) get none, however far off their ranks are.
    decode_step = [({**params, "total_tokens": 64}, us * (1.5 if index % 2 else 1.0))
                   for index, (params, us) in enumerate(samples)]
    assert fit_margins(CONFIG, decode_step, 2.0, fit) == ()


def test_local_link_is_a_copy_within_the_device():
    """``link="local"`` times a copy within the measured device (virtual ranks' link) and takes it."""
    copies = []

    def timer(measurement):
        if measurement.kind == "link":
            copies.append(measurement)
            return measurement.params["bytes"] / (1800.0 * 1e3)
        return fake_timer(measurement)

    lines = []
    profile = calibrate(CONFIG, "cpu", timer=timer, base=CostProfile.default(), log=lines.append, link="local",
                        tokens=TOKENS)
    assert len(copies) == 1 and profile.link_gbps == pytest.approx(1800.0, rel=1e-12)
    assert profile.push_us == CostProfile.default().push_us
    assert any("a copy within it" in line for line in lines)
    with pytest.raises(ValueError, match="link must be one of"):
        calibrate(CONFIG, "cpu", timer=timer, link="nvlink")


def test_fit_takes_a_measured_link_and_needs_both_regimes():
    samples = [({"groups": [rows] * 8, "total_tokens": tokens, "sigma": 0.0, "policy": "none"},
                model_us(TRUE, CONFIG, [rows] * 8, tokens))
               for rows, tokens in ((1, 8), (32, 256), (4096, 32768))]
    profile = fit_profile(CONFIG, samples, TRUE.hbm_gbps, 321.0, CostProfile.default(), "m")
    assert profile.link_gbps == 321.0 and profile.name == "m"
    with pytest.raises(ValueError, match="few rows per expert .* and with many"):
        fit_profile(CONFIG, samples[2:], 1000.0, None, CostProfile.default(), "m")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_calibrate_on_cpu_is_a_clear_error(capsys):
    with pytest.raises(ValueError, match="must be a CUDA device"):
        calibrate(CONFIG, "cpu")
    assert main(["calibrate", "--device", "cpu"]) == 2
    assert "must be a CUDA device" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_on_the_gpu_writes_a_loadable_profile(tmp_path):
    path = tmp_path / "profile.json"
    assert main(["calibrate", "--model", "qwen3-235b", "--out", str(path)]) == 0
    profile = CostProfile.load(path)
    assert profile.gemm_tflops > 1 and profile.hbm_gbps > 10


def test_fit_to_ranks_measured_on_an_h200_keeps_every_rank_within_15_percent():
    """Kimi-K2 ranks of a sweep on an H200 (decode kernels at s = 1 and 128, ``torch._grouped_mm``
    at s >= 1024; mixed group sizes, borrowed slots included): the fitted model is within 15% of
    every rank. The uniform-group calibration it replaces fitted 128-row tiles at 635 TFLOP/s and
    missed these ranks by up to 24%."""
    data = json.loads((DATA / "h200_kimi_k2_ranks.json").read_text())
    config = preset("kimi-k2", ranks=8)
    samples = [({"groups": rank["groups"], "total_tokens": rank["total_tokens"], "sigma": rank["maxvio_target"],
                 "policy": rank["arm"]}, rank["experts_us"]) for rank in data["ranks"]]
    profile = fit_profile(config, samples, data["read_gbps"], None, CostProfile.preset("h200"), "h200")
    # Ranks of one step are off against each other by a few percent, more where groups fit one tile.
    margins = dict(profile.margins)
    assert sorted(margins) == [171.0, 683.0, 1366.0]  # s = 1024, 4096, 8192 (s = 1 and 128: decode regime)
    assert all(0 < margin < 0.2 for margin in margins.values()) and margins[171.0] > margins[1366.0]
    assert profile.tile_rows == 256 and 700 < profile.gemm_tflops < 850
    for params, us in samples:
        predicted = model_us(profile, config, params["groups"], params["total_tokens"])
        assert abs(predicted / us - 1) <= 0.15, (params["total_tokens"], us, predicted)
    # The profile's integer constants give the same per-rank times (the model auto evaluates).
    for params, us in samples[:6]:
        constants = profile.constants(config, total_tokens=params["total_tokens"])
        alloc = torch.zeros(1, config.experts, config.ranks, dtype=torch.int64)
        alloc[0, :len(params["groups"]), 0] = torch.tensor(params["groups"])
        gemm = torch.where(alloc > 0, torch.clamp_min(-(-alloc // constants.tile_rows) * constants.tile_rows
                                                       * constants.row_fs, constants.weight_fs) + constants.group_fs, 0)
        assert int(gemm.sum()) / 1e9 == pytest.approx(model_us(profile, config, params["groups"], params["total_tokens"]),
                                                      rel=1e-6)


def test_decode_fields_apply_to_steps_with_few_rows_per_expert_only():
    config = preset("kimi-k2", ranks=8)  # ceil(T*K/E) <= 64 up to s = 384 tokens per rank
    few, many = TRUE.constants(config, total_tokens=8 * 384), TRUE.constants(config, total_tokens=8 * 385)
    assert (few.tile_rows, few.group_fs) == (32, 1_500_000_000) and (many.tile_rows, many.group_fs) == (128, 3_000_000_000)
    assert few.row_fs > many.row_fs  # the decode kernels' slower compute
    assert TRUE.constants(config) == many
    plain = CostProfile(**{**TRUE.to_dict(), "decode_gemm_tflops": None, "decode_group_us": None, "decode_tile_rows": None})
    assert plain.constants(config, total_tokens=8) == many
    for field, bad in (("decode_gemm_tflops", -1.0), ("decode_group_us", 0.0), ("decode_tile_rows", 0), ("decode_tile_rows", 2.5)):
        with pytest.raises(ValueError, match=f"CostProfile.{field} must be"):
            CostProfile(**{**TRUE.to_dict(), field: bad})


def test_every_planned_step_runs_its_ranks_experts_on_their_own_shards():
    """The functions calibrate times (one rank's experts of one planned step) run as the layer runs
    them; here on the CPU at a tiny shape. Classic and exact plans, with borrowed slots."""
    from flatep.bench.calibrate import _Steps

    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=64, intermediate=32, capacity=16)
    steps = _Steps(config, "cpu", tokens=(8,))
    measurements = steps.measurements()
    assert len(measurements) == len(STEP_SIGMAS) * len(STEP_POLICIES) * config.ranks
    assert any(plan.slot_base for *_, plan in steps.plans)  # some step borrows experts
    for index, measurement in enumerate(measurements):
        shard, weights, out = steps.inputs(index // config.ranks)
        rows = shard.clone()
        measurement.make()()
        plan = steps.plans[index // config.ranks][3]
        assert shard.shape == (config.ranks, plan.shard_rows, config.hidden) and weights.shape == shard.shape[:2]
        # The experts write into their own buffer: every timed call computes on the same random rows.
        assert torch.equal(shard, rows) and out.shape == shard.shape
        assert sum(measurement.params["groups"]) == int(plan.alloc[:, measurement.params["rank"]].sum())


@pytest.mark.parametrize("weights", ["fp8", "mxfp4"])
def test_packed_steps_run_a_packed_pool_and_the_profile_records_its_bytes(weights):
    """calibrate --weights: the timed steps run the experts of a pool in that format, and the
    fitted profile reads packed bytes per expert (its weight term) and keeps them."""
    from flatep.bench.calibrate import _Steps
    from flatep.quant import expert_weight_nbytes

    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=128, intermediate=128, capacity=16)
    steps = _Steps(config, "cpu", tokens=(8,), weights=weights)
    assert steps.pool().weights == weights and "w13_scale" in steps.pool().names
    steps.measurements()[0].make()()
    packed = expert_weight_nbytes(weights, config.hidden, config.intermediate)
    samples = [({"groups": [rows] * 8, "total_tokens": tokens, "sigma": 0.0, "policy": "none"},
                model_us(TRUE.with_expert_bytes(packed), CONFIG, [rows] * 8, tokens))
               for rows, tokens in ((1, 8), (32, 256), (4096, 32768))]
    profile = fit_profile(CONFIG, samples, TRUE.hbm_gbps, None, CostProfile.default(), "m", packed)
    assert profile.expert_bytes == packed
    for params, us in samples:
        assert model_us(profile, CONFIG, params["groups"], params["total_tokens"]) == pytest.approx(us, rel=0.05)
    assert fit_profile(CONFIG, samples, TRUE.hbm_gbps, None, CostProfile.default(), "m").expert_bytes is None
    with pytest.raises(ValueError, match="weights"):
        calibrate(CONFIG, "cpu", timer=lambda measurement: 1.0, weights="int4")
