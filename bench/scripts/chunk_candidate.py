"""A copy of this tree's ``flatep/kernels/`` with the Gluon mxfp4 kernels' K steps in chunks, each half's
decode beside the MMAs issued before it, for ``python -m flatep.bench.experts_phase --against DIR``.

- :data:`flatep.kernels.mxfp4_swap.CHUNK_STEPS` = 4 (chunks of 2, 4 and 8 compile without spills at
  its 3 programs an SM), and groups of more than 32 rows in its 64-row tile
  (:data:`flatep.kernels.packed_tiles.MXFP4_SWAP64_DEFAULT`) rather than the Triton 64 x 256 one;
- :data:`flatep.kernels.mxfp4_fp8mma.CHUNK_STEPS` = 2, with :data:`flatep.kernels.packed_tiles.FP8MMA`'s
  32-row tile at 2 programs an SM (128 registers a thread): at 3 (80 registers) the chunked consumer
  spills, and chunks of 4 spill at 128 with Triton 3.9 (local sm_90 compiles, Triton 3.6 and 3.9).

    python bench/scripts/chunk_candidate.py DIR      # writes DIR/kernels and prints its path
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "flatep" / "kernels"
EDITS = {
    "mxfp4_swap.py": ("\nCHUNK_STEPS = 1\n", "\nCHUNK_STEPS = 4\n"),
    "mxfp4_fp8mma.py": ("\nCHUNK_STEPS = 1\n", "\nCHUNK_STEPS = 2\n"),
    "packed_tiles.py": ("for block_m, stages, programs in ((32, 3, 3), (64, 4, 2))",
                        "for block_m, stages, programs in ((32, 3, 2), (64, 4, 2))",
                        'MXFP4_SWAP64_DEFAULT = environment_flag("FLATEP_MXFP4_SWAP64", False)',
                        'MXFP4_SWAP64_DEFAULT = environment_flag("FLATEP_MXFP4_SWAP64", True)'),
}
"""Per kernel module, the lines it changes: ``(as this tree has it, as the candidate has it, ...)`` in pairs."""


def write_candidate(directory: Path, kernels: Path = KERNELS) -> Path:
    """``kernels`` copied to ``directory/kernels`` (which must not exist) with :data:`EDITS` made; returns
    the copy's path.

    Raises:
        ValueError: if a module of :data:`EDITS` does not hold its line exactly once (the tree has moved
            on from the candidate).
    """
    target = Path(directory) / "kernels"
    shutil.copytree(kernels, target, ignore=shutil.ignore_patterns("__pycache__"))
    for name, lines in EDITS.items():
        module = target / name
        text = module.read_text()
        for old, new in zip(lines[::2], lines[1::2]):
            if text.count(old) != 1:
                raise ValueError(f"{kernels / name} must hold {old.strip()!r} once, found it {text.count(old)} times")
            text = text.replace(old, new)
        module.write_text(text)
    return target


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where to write the copy (as DIRECTORY/kernels)")
    print(write_candidate(parser.parse_args().directory))
