"""``bench/scripts/mxfp4_kloop_sass.py``: the mxfp4 tiles' K loops compiled for sm_90 (no GPU needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "scripts" / "mxfp4_kloop_sass.py"


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


@pytest.mark.skipif(not compiles_for_sm90(), reason="this Triton cannot compile and disassemble sm_90 code")
def test_the_lane_word_order_halves_the_short_tiles_scale_loads():
    """default_config's short tiles take lane_words because, compiled, a lane then loads one scale byte
    per two words: the script compiles each such tile with and without it. In its own process: the
    script turns the interpreter off, which this one may run under."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment["PYTHONPATH"] = os.pathsep.join([str(ROOT), environment.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(SCRIPT), "--json", "--inner", "256"], capture_output=True, text=True,
                          env=environment, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [row["lane_words"] for row in rows] == [True, False, True, False, False]  # 16, 32 rows twice; 64 rows
    for lane, plain in zip(rows[0:4:2], rows[1:4:2]):
        assert lane["tile"] == plain["tile"] + " lanewords"
        assert 0 < lane["scale_byte_loads"] * 2 == plain["scale_byte_loads"], (lane, plain)
        assert lane["instructions"] < plain["instructions"], (lane, plain)
    assert all(row["registers"] <= 255 and row["per_weight"] > 0 for row in rows)
