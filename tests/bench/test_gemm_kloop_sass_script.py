"""``bench/scripts/gemm_kloop_sass.py``: the packed GEMMs' tiles compiled for sm_90 (no GPU needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_memory import run_directory, worker_lock

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "scripts" / "gemm_kloop_sass.py"


def compiles_for_sm90() -> bool:
    """Whether this Triton can build and disassemble sm_90 code here: its NVIDIA backend, with a
    ``ptxas`` and a ``cuobjdump`` beside it, and the compiler entry points the script uses."""
    try:
        import triton.backends.compiler as backend
        import triton.compiler as compiler
        from triton.backends.nvidia.compiler import get_ptxas
        return (hasattr(backend, "GPUTarget") and hasattr(compiler, "ASTSource")
                and (Path(get_ptxas(90).path).parent / "cuobjdump").is_file())
    except (ImportError, AttributeError, RuntimeError, TypeError):
        return False


@pytest.fixture(scope="module")
def default_tiles(request, tmp_path_factory) -> list[dict]:
    """The script's rows for default_config's mxfp4 and fp8 tiles. In a process of its own: the
    script turns the interpreter off, which this one may run under. Compiled once a run: the first
    xdist worker to need them writes them where the others read them."""
    if not compiles_for_sm90():
        pytest.skip("this Triton cannot compile and disassemble sm_90 code")
    saved = run_directory(request, tmp_path_factory) / "gemm_kloop_sass_default_tiles.jsonl"
    with worker_lock(saved.with_suffix(".lock")):
        if not saved.is_file():
            environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
            done = subprocess.run([sys.executable, str(SCRIPT), "--json", "--inner", "256", "--format", "mxfp4", "fp8"],
                                  capture_output=True, text=True, env=environment, cwd=ROOT, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            saved.write_text(done.stdout)
        return [json.loads(line) for line in saved.read_text().splitlines()]


def test_the_lane_word_order_halves_the_short_tiles_scale_loads(default_tiles):
    """default_config's 16- and 32-row mxfp4 tiles take lane_words because, compiled, a lane then
    loads at most half the scale bytes (a quarter with 128-wide K steps) in fewer instructions: the
    script compiles each with and without."""
    rows = [row for row in default_tiles if row["format"] == "mxfp4"]
    assert [row["lane_words"] for row in rows] == [True, False, True, False, False]  # 16 and 32 rows twice; 64
    for lane, plain in zip(rows[0:3:2], rows[1:4:2]):
        assert lane["tile"] == plain["tile"] + " lanewords"
        assert 0 < lane["scale_byte_loads"] * 2 <= plain["scale_byte_loads"], (lane, plain)
        assert lane["instructions"] < plain["instructions"], (lane, plain)


def test_every_default_tile_fits_the_programs_its_grid_launches(default_tiles):
    """A persistent launch's programs loop over tiles; one that does not fit an SM beside the others
    waits for a resident one's whole loop. The registers and shared memory of the compiled default
    tiles must let every launched program be resident (not their plain-order twins, which the
    script adds for comparison)."""
    assert {row["format"] for row in default_tiles} == {"mxfp4", "fp8"}
    for row in (row for row in default_tiles if row["listed"]):
        assert row["registers"] <= 255 and row["per_weight"] > 0, row
        assert row["resident_per_sm"] >= row["programs_per_sm"], row
