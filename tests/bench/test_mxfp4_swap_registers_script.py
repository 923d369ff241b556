"""``bench/scripts/mxfp4_swap_registers.py`` on the CPU: the default tile first, then the Triton tile,
then each (producer registers, stages) variant, each launch under its own producer registers; the
Gluon arms need a Hopper GPU, so the CPU run swaps in Triton tiles for them (small shapes, under the
interpreter)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flatep.kernels import mxfp4_swap
from flatep.kernels.packed_tiles import GemmConfig
from flatep.kernels.quant_gemm import _check_mxfp4_wgmma


def test_each_arm_launches_under_its_producer_registers(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_swap_registers")
    base = script.MXFP4_SWAP[32]
    for _, stages in script.VARIANTS:
        config = dataclasses.replace(base, num_stages=stages)
        with pytest.raises(ValueError, match="needs a Hopper"):  # only the device is refused here
            _check_mxfp4_wgmma(config, torch.device("cpu"))
    swap_stand_in, triton_stand_in = GemmConfig(32, 128, 64, num_warps=2), GemmConfig(32, 64, 64, num_warps=2)
    monkeypatch.setattr(script, "MXFP4_SWAP", {32: swap_stand_in})
    monkeypatch.setattr(script, "MXFP4_SHORT", {32: triton_stand_in})
    monkeypatch.setattr(script, "VARIANTS", [(40, 2), (24, 3)])
    launched = []

    def recording(*args, **kwargs):
        launched.append((mxfp4_swap.PRODUCER_REGISTERS, kwargs["config"].num_stages))
        return real(*args, **kwargs)

    real = script.mxfp4_grouped_mm_triton
    monkeypatch.setattr(script, "mxfp4_grouped_mm_triton", recording)
    default_registers = mxfp4_swap.PRODUCER_REGISTERS
    out = tile_scripts.command_line("mxfp4_swap_registers")
    script.main(script.__doc__, [32], script.time_cell)
    rows = json.loads(out.read_text())["results"]
    assert [row["tiles"] for row in rows] == [
        f"default: {swap_stand_in.label} r{default_registers}", f"triton: {triton_stand_in.label}",
        f"{dataclasses.replace(swap_stand_in, num_stages=2).label} r40",
        f"{dataclasses.replace(swap_stand_in, num_stages=3).label} r24"]
    assert all(row["us"] > 0 for row in rows) and rows[2]["same_bits"] and rows[3]["same_bits"]
    # the first launch of each arm (the poisoned run) under that arm's registers, the constant restored
    assert launched[:4] == [(default_registers, swap_stand_in.num_stages),
                            (default_registers, triton_stand_in.num_stages), (40, 2), (24, 3)]
    assert mxfp4_swap.PRODUCER_REGISTERS == default_registers
