"""The mxfp4 and fp8 tile scripts of ``bench/scripts`` (which share ``mxfp4_rank``) on the CPU."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from flatep.kernels.backend import interpreting

SCRIPTS = Path(__file__).resolve().parents[2] / "bench" / "scripts"


class TileScripts:
    """Loads a tile script with ``mxfp4_rank`` set for a small CPU run (2 experts, one 256 x 128
    GEMM, one round of one call) and points its command line at a JSON file."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, directory: Path):
        self.monkeypatch, self.directory = monkeypatch, directory
        monkeypatch.syspath_prepend(str(SCRIPTS))
        self.rank = importlib.import_module("mxfp4_rank")
        for name, value in (("DEVICE", torch.device("cpu")), ("EXPERTS", 2), ("GEMMS", {"w13": (256, 128)}),
                            ("ROUNDS", 1), ("CALLS", 1)):
            monkeypatch.setattr(self.rank, name, value)

    def load(self, name: str) -> ModuleType:
        return importlib.import_module(name)

    def command_line(self, name: str, *options: str) -> Path:
        """Sets ``sys.argv`` to ``name.py --out FILE [options]`` and returns ``FILE``."""
        out = self.directory / f"{name}.json"
        self.monkeypatch.setattr(sys, "argv", [f"{name}.py", "--out", str(out), *options])
        return out


@pytest.fixture
def tile_scripts(monkeypatch, tmp_path) -> TileScripts:
    if not interpreting():
        pytest.skip("runs the script's kernels under TRITON_INTERPRET=1")
    return TileScripts(monkeypatch, tmp_path)
