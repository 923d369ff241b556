"""``bench/scripts/mxfp4_swap_chunks.py`` on the CPU: the swapped kernel at each chunk of K steps, the
default first, then the Triton short tile; each arm launches with its chunk and puts the default
back. The Gluon arms need a Hopper GPU, so the CPU run swaps in a Triton tile for them (small
shapes, under the interpreter)."""
from __future__ import annotations

import json

from flatep.kernels import mxfp4_swap
from flatep.kernels.packed_tiles import GemmConfig, default_config


def test_each_chunk_then_the_triton_tile(tile_scripts, monkeypatch):
    script = tile_scripts.load("mxfp4_swap_chunks")
    assert script.CHUNKS[0] == mxfp4_swap.CHUNK_STEPS == 1
    stand_in = GemmConfig(16, 128, 64, num_warps=2)
    monkeypatch.setattr(script, "MXFP4_SWAP", {16: stand_in})
    launched = []
    run_gemm = script.mxfp4_grouped_mm_triton
    monkeypatch.setattr(script, "mxfp4_grouped_mm_triton",
                        lambda *args: (launched.append(mxfp4_swap.CHUNK_STEPS), run_gemm(*args)))
    out = tile_scripts.command_line("mxfp4_swap_chunks")
    script.main(script.__doc__, sorted(script.MXFP4_SWAP), script.time_cell)
    rows = json.loads(out.read_text())["results"]
    assert [(row["tiles"], row["chunk_steps"], row["default"]) for row in rows] == [
        *((stand_in.label, chunk, chunk == 1) for chunk in script.CHUNKS),
        (default_config(2 * 16, 2, "mxfp4").label, None, False)]
    assert all(row["same_bits"] for row in rows[:-1]) and all(row["us"] > 0 for row in rows)
    assert set(launched) == {*script.CHUNKS} and mxfp4_swap.CHUNK_STEPS == 1
