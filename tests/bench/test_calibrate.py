"""flatep calibrate: the fit's arithmetic with a fake timer, and a clear error without a GPU."""
from __future__ import annotations

import math

import pytest
import torch

from flatep import CostProfile, EPConfig
from flatep.bench.calibrate import calibrate, fit_profile
from flatep.cli import main

CONFIG = EPConfig(ranks=8, experts=64, top_k=8, hidden=1024, intermediate=512, capacity=64)
TRUE = CostProfile(link_gbps=150.0, hbm_gbps=2000.0, gemm_tflops=400.0, group_us=3.0, push_us=30.0, tile_rows=128, name="x")


def model_us(profile: CostProfile, rows: int) -> float:
    """The cost model's per-group GEMM time, in floating point."""
    weight = CONFIG.expert_bytes() / (profile.hbm_gbps * 1e3)
    row = 6 * CONFIG.hidden * CONFIG.intermediate / (profile.gemm_tflops * 1e6)
    return profile.group_us + max(weight, math.ceil(rows / profile.tile_rows) * profile.tile_rows * row)


def fake_timer(measurement):
    """Times the profile ``TRUE`` implies; never runs the measurement."""
    if measurement.kind == "gemm":
        return measurement.params["groups"] * model_us(TRUE, measurement.params["rows"])
    if measurement.kind == "read":
        return measurement.params["bytes"] / (TRUE.hbm_gbps * 1e3)
    raise AssertionError(f"no peer on this machine, yet {measurement.kind} was timed")


def test_calibrate_recovers_the_profile_from_fake_times():
    lines = []
    profile = calibrate(CONFIG, "cpu", timer=fake_timer, base=CostProfile.default(), log=lines.append)
    assert profile.tile_rows == TRUE.tile_rows
    for name in ("hbm_gbps", "gemm_tflops", "group_us"):
        assert getattr(profile, name) == pytest.approx(getattr(TRUE, name), rel=1e-9), name
    # Unmeasured here: kept from the base profile, and said so.
    assert profile.link_gbps == CostProfile.default().link_gbps and profile.push_us == CostProfile.default().push_us
    assert any("no peer GPU" in line for line in lines)


def test_local_link_is_a_copy_within_the_device():
    """``link="local"`` times a copy within the measured device (virtual ranks' link) and takes it."""
    copies = []

    def timer(measurement):
        if measurement.kind == "link":
            copies.append(measurement)
            return measurement.params["bytes"] / (1800.0 * 1e3)
        return fake_timer(measurement)

    lines = []
    profile = calibrate(CONFIG, "cpu", timer=timer, base=CostProfile.default(), log=lines.append, link="local")
    assert len(copies) == 1 and profile.link_gbps == pytest.approx(1800.0, rel=1e-12)
    assert profile.push_us == CostProfile.default().push_us
    assert any("a copy within it" in line for line in lines)
    with pytest.raises(ValueError, match="link must be one of"):
        calibrate(CONFIG, "cpu", timer=timer, link="nvlink")


def test_fit_takes_a_measured_link_and_rejects_too_few_samples():
    gemm = {rows: 8 * model_us(TRUE, rows) for rows in (1, 64, 4096)}
    profile = fit_profile(CONFIG, gemm, 8, TRUE.hbm_gbps, 321.0, CostProfile.default(), "m")
    assert profile.link_gbps == 321.0 and profile.name == "m"
    with pytest.raises(ValueError, match="gemm_us must hold n=1"):
        fit_profile(CONFIG, {64: 1.0}, 8, 1000.0, None, CostProfile.default(), "m")


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


def test_fit_follows_grouped_gemms_that_stream_weights_faster_at_more_rows():
    """Times measured on an H200 (Kimi-K2 shapes, 8 groups; ``flatep calibrate``): one-row groups
    are slower than 128-row ones. Fitting group_us to n=1 alone missed n=128 by 28%; the joint
    fit keeps every n within 15%."""
    from flatep import preset

    config = preset("kimi-k2", ranks=8)
    measured = {1: 316.3, 16: 293.4, 64: 274.4, 128: 246.0, 256: 314.1, 320: 524.5, 512: 560.1, 1024: 1107.0,
                1088: 1321.2, 2048: 2269.0, 2112: 2575.0, 4096: 4350.7}
    profile = fit_profile(config, measured, 8, 3882.3, None, CostProfile.preset("h200"), "h200")
    weight = config.expert_bytes() / (profile.hbm_gbps * 1e3)
    row = 6 * config.hidden * config.intermediate / (profile.gemm_tflops * 1e6)
    for rows, us in measured.items():
        predicted = 8 * (profile.group_us + max(weight, math.ceil(rows / profile.tile_rows) * profile.tile_rows * row))
        assert abs(predicted / us - 1) <= 0.15, (rows, us, predicted)
