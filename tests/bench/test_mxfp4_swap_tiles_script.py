"""``bench/scripts/mxfp4_swap_tiles.py`` on the CPU: the Triton short tile first, then the swapped
Gluon kernel's variants, each a config the launch accepts; the Gluon arms need a Hopper GPU, so the
CPU run swaps in a Triton tile for them (small shapes, under the interpreter)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from flatep.kernels.packed_tiles import GemmConfig, default_config
from flatep.kernels.quant_gemm import _check_mxfp4_wgmma


def test_the_triton_tile_comes_first_then_each_variant(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_swap_tiles")
    for rows_per_expert in (16, 32):
        base = script.MXFP4_SWAP[rows_per_expert]
        for config in [base, *(dataclasses.replace(base, programs_per_sm=programs, num_stages=stages)
                               for programs, stages in script.VARIANTS)]:
            assert config.block_m == rows_per_expert and config.wgmma and config.swap_ab
            with pytest.raises(ValueError, match="needs a Hopper"):  # only the device is refused here
                _check_mxfp4_wgmma(config, torch.device("cpu"))
    stand_in = GemmConfig(16, 128, 64, num_warps=2)
    monkeypatch.setattr(script, "MXFP4_SWAP", {16: stand_in})
    monkeypatch.setattr(script, "VARIANTS", [(stand_in.programs_per_sm, stand_in.num_stages)])
    out = tile_scripts.command_line("mxfp4_swap_tiles")
    script.main(script.__doc__, sorted(script.MXFP4_SWAP), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    assert [row["tiles"] for row in rows] == [default_config(2 * 16, 2, "mxfp4").label, stand_in.label]
    assert all(row["us"] > 0 for row in rows)
