"""The swapped Gluon mxfp4 kernel (:mod:`flatep.kernels.mxfp4_swap`) at its producer warp's registers and
stages of copies in flight, at 32 rows per expert.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 32 rows per
expert, a decode step's groups. The first arm is the default tile of a Hopper GPU (``MXFP4_SWAP[32]``
with the module's ``PRODUCER_REGISTERS``), then the Triton 32-row tile, then the kernel with the producer
warp's registers after ``setmaxnreg`` at 40, 32 or 24 (the consumer warp group takes the rest) and 4 or
6 stages, 3 programs an SM. Each arm sets ``mxfp4_swap.PRODUCER_REGISTERS`` for its own launches (it is
a module constant, not a ``GemmConfig`` field). Timed as :func:`mxfp4_rank.time_tiles` does
(interleaved CUDA-graph replays, the read ceiling measured in the same run, the packed weight bytes
counted once); ``same_bits`` compares each arm's bits with the default's: every arm of the swapped
kernel sums in the same order, the Triton tile in another.

    python bench/scripts/mxfp4_swap_registers.py --out mxfp4_swap_registers.json      (on a Hopper GPU)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flatep.kernels import mxfp4_swap
from flatep.kernels.packed_tiles import MXFP4_SHORT, MXFP4_SWAP
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton
from mxfp4_rank import main, rank_operands, time_arms

VARIANTS = [(registers, stages) for registers in (40, 32, 24) for stages in (4, 6)]


def with_producer_registers(registers: int, run: Callable[[], None]) -> None:
    """``run()`` with the kernel's producer warp at ``registers`` after ``setmaxnreg``."""
    default = mxfp4_swap.PRODUCER_REGISTERS
    mxfp4_swap.PRODUCER_REGISTERS = registers
    try:
        run()
    finally:
        mxfp4_swap.PRODUCER_REGISTERS = default


def time_cell(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    values, scales, rows, offsets = rank_operands(rows_per_expert, columns, inner)

    def arm(label: str, config, registers: int) -> tuple[dict, Callable]:
        def run(out):
            with_producer_registers(registers, lambda: mxfp4_grouped_mm_triton(rows, values, scales, offsets,
                                                                               config=config, out=out))
        return {"rows_per_expert": rows_per_expert, "gemm": gemm, "tiles": label}, run

    default = MXFP4_SWAP[rows_per_expert]
    arms = [arm(f"default: {default.label} r{mxfp4_swap.PRODUCER_REGISTERS}", default, mxfp4_swap.PRODUCER_REGISTERS),
            arm(f"triton: {MXFP4_SHORT[rows_per_expert].label}", MXFP4_SHORT[rows_per_expert],
                mxfp4_swap.PRODUCER_REGISTERS)]
    for registers, stages in VARIANTS:
        config = dataclasses.replace(default, num_stages=stages)
        arms.append(arm(f"{config.label} r{registers}", config, registers))
    return time_arms(arms, rows.shape[0], columns)


if __name__ == "__main__":
    main(__doc__, [32], time_cell)
