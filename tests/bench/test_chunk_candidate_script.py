"""``bench/scripts/chunk_candidate.py``: the copy of the kernels that ``experts_phase --against`` loads
holds the chunked candidate, and a tree whose lines moved on is refused."""
from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

import flatep.kernels.mxfp4_fp8mma
import flatep.kernels.mxfp4_swap
from flatep.bench.experts_phase import revision_gemms
from flatep.kernels import packed_tiles
from flatep.kernels.packed_tiles import FP8MMA

SCRIPTS = Path(__file__).resolve().parents[2] / "bench" / "scripts"


@pytest.fixture
def candidate(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    return importlib.import_module("chunk_candidate")


def test_the_copy_holds_the_chunked_kernels(candidate, tmp_path):
    copy = candidate.write_candidate(tmp_path)
    assert copy == tmp_path / "kernels" and not (copy / "__pycache__").exists()
    gemms = revision_gemms(str(copy))
    package = gemms["mxfp4_grouped_mm_triton"].__module__.rpartition(".")[0]
    assert sys.modules[f"{package}.mxfp4_swap"].CHUNK_STEPS == 4
    assert sys.modules[f"{package}.mxfp4_fp8mma"].CHUNK_STEPS == 2
    tiles = sys.modules[f"{package}.packed_tiles"]
    assert tiles.FP8MMA[32].programs_per_sm == 2 and tiles.FP8MMA[64].label == FP8MMA[64].label  # two packages' classes
    assert tiles.MXFP4_SWAP64_DEFAULT and not packed_tiles.MXFP4_SWAP64_DEFAULT
    # this tree keeps its defaults
    assert flatep.kernels.mxfp4_swap.CHUNK_STEPS == flatep.kernels.mxfp4_fp8mma.CHUNK_STEPS == 1
    assert FP8MMA[32].programs_per_sm == 3


def test_a_tree_without_the_lines_is_refused(candidate, tmp_path):
    kernels = tmp_path / "moved"
    shutil.copytree(candidate.KERNELS, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    swap = kernels / "mxfp4_swap.py"
    swap.write_text(swap.read_text().replace("\nCHUNK_STEPS = 1\n", "\nCHUNK_STEPS = 3\n"))
    with pytest.raises(ValueError, match="mxfp4_swap.py must hold 'CHUNK_STEPS = 1' once, found it 0 times"):
        candidate.write_candidate(tmp_path / "out", kernels)
