"""``bench/scripts/mxfp4_wgmma_tiles.py`` on the CPU: the Triton tile first, then the Gluon kernel's
configs, each a config the launch accepts; the Gluon arms need a Hopper GPU, so the CPU run swaps in
a Triton tile for them (small shapes, under the interpreter) to check the script's cells and output."""
from __future__ import annotations

import json

import torch

from flatep.kernels import mxfp4_wgmma
from flatep.kernels.packed_tiles import GemmConfig, default_config
from flatep.kernels.quant_gemm import _check_mxfp4_wgmma


def test_the_triton_tile_comes_first_then_each_gluon_config(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_wgmma_tiles")
    assert [config.num_stages for config in script.GLUON] == [3, 4, 6]
    for config in script.GLUON:
        assert config.wgmma and config.num_stages in mxfp4_wgmma.STAGES
        try:
            _check_mxfp4_wgmma(config, torch.device("cpu"))
        except ValueError as error:  # only the device may be refused here
            assert "needs a Hopper" in str(error)
    stand_in = GemmConfig(64, 128, 64, num_stages=3)
    monkeypatch.setattr(script, "GLUON", [stand_in])
    monkeypatch.setattr(script, "ROWS_PER_EXPERT", [48])
    out = tile_scripts.command_line("mxfp4_wgmma_tiles")
    script.main(script.__doc__, script.ROWS_PER_EXPERT, script.time_cell)
    rows = json.loads(out.read_text())["results"]
    assert [row["tiles"] for row in rows] == [default_config(2 * 48, 2, "mxfp4").label, stand_in.label]
    assert rows[0]["tiles"].startswith("m64 n256 k64 ")
    assert all(row["us"] > 0 and row["same_bits"] for row in rows)
