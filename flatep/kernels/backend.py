"""Choosing between the Triton kernels and their plain-torch counterparts."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device, backend: str = "auto") -> bool:
    """Whether to run the Triton kernels on ``device``.

    ``auto`` picks Triton on CUDA, and on CPU only under ``TRITON_INTERPRET=1``; ``triton`` forces
    it (an error on CPU without the interpreter); ``torch`` forces the plain-torch paths.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    available = device.type == "cuda" or (device.type == "cpu" and interpreting())
    if backend == "triton" and not available:
        raise ValueError(
            f"backend='triton' needs a CUDA device or TRITON_INTERPRET=1 on CPU, got device {device}"
        )
    return available


PROGRAMS_PER_SM = 2
"""Programs per SM of the persistent grouped GEMM launches (:func:`resident_programs`)."""

INTERPRETER_PROGRAMS = 4
"""Programs of those launches under the interpreter: a few, so that each walks several tiles."""


def tma_fits(tensor: torch.Tensor) -> bool:
    """Whether a TMA tensor descriptor can cover ``tensor``: not empty, a 16-byte aligned base, unit
    stride along the last dimension and 16-byte aligned strides along the others."""
    bytes_per_element = tensor.element_size()
    return (tensor.numel() > 0 and tensor.data_ptr() % 16 == 0 and tensor.stride(-1) == 1
            and all(stride * bytes_per_element % 16 == 0 for stride in tensor.stride()[:-1]))


def resident_programs(device: torch.device, per_sm: int = PROGRAMS_PER_SM) -> int:
    """Programs a persistent launch on ``device`` takes: ``per_sm`` per SM on CUDA (each program
    loops over tiles, so more than fit at once would only queue), :data:`INTERPRETER_PROGRAMS` on CPU."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS
    return per_sm * torch.cuda.get_device_properties(device).multi_processor_count


def row_programs(
    rows: int, block_m: int, columns: int, device: torch.device, programs: int | None = None, per_sm: int = 8
) -> int:
    """Programs along the rows of a grid-strided row kernel (its rows end at a count read on the
    device, so a buffer sized for the worst case launches no program per unused row block):
    ``programs``, else enough for ``per_sm`` per SM over all ``columns`` column blocks on CUDA
    (every block when the interpreter runs them), never more than there are row blocks of
    ``block_m`` rows."""
    blocks = triton.cdiv(rows, block_m)
    if programs is None:
        if device.type != "cuda":
            return max(blocks, 1)
        programs = triton.cdiv(resident_programs(device, per_sm), columns)
    if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
        raise ValueError(f"programs must be a positive integer, got {programs!r}")
    return max(min(programs, blocks), 1)


def column_block(columns: int, element_size: int) -> int:
    """Columns one program step moves per row: 2 KiB (16-byte vectors per thread), fewer for narrow rows.

    2 KiB chunks keep registers modest with several rows in flight (measured on the H200 with
    ``python -m flatep.bench.kernels``).
    """
    return min(triton.next_power_of_2(columns), 2048 // element_size)


SPLIT_BELOW_ITEMS = 2048
"""Launches of dispatch with fewer token blocks than this split each row's columns into parts
(:func:`column_parts`), and combine launches that small take more warps per program
(:func:`flatep.kernels.combine.combine_warps`): at decode sizes there are too few rows for the
copies to keep the memory system busy."""


def column_parts(token_items: int, columns: int, block_h: int) -> tuple[int, int]:
    """``(parts, chunks per part)``: how dispatch splits each row's ``columns``.

    A launch with ``token_items`` (ranks driven x token blocks) below :data:`SPLIT_BELOW_ITEMS`
    makes every chunk of ``block_h`` columns of a row its own work item (``(chunks, 1)``); larger
    launches keep whole rows (``(1, chunks)``). The shapes alone decide, so a captured graph keeps
    its split, and every column is still written by exactly one program in the same arithmetic.
    Measured on the H200 at Kimi-K2, R = 8, s = 128 (1024 token items, 7 chunks per row):
    one chunk per item took 40.6 us against 42.1 us for two parts of 4 and 3 chunks
    (``bench/results/2026-12-04-h200-f/kernels-decode.log``; a gain within dispatch's spread between
    calls, kept because it was never slower in that log's settings). Combine keeps whole rows: each of its
    work items first looks up its tokens' carrier rows, and at s = 128 whole rows took 42.0 us against
    50.2 us for two parts and 67.2 us for one chunk per item (8 warps, the same log).
    """
    chunks = -(-columns // block_h)
    return (1, chunks) if token_items >= SPLIT_BELOW_ITEMS else (chunks, 1)


# CUDA allows 2**31 - 1 programs on grid axis 0 (65,535 on axes 1 and 2, which is why the
# communication kernels put all their work on axis 0). Their grid-stride loops count work items in
# int32 and step by the grid size, so items stay below 2**30: the last step cannot wrap around.
MAX_WORK_ITEMS = 2**30


def check_programs(programs: int | None) -> None:
    """Raise ``ValueError`` unless ``programs`` (a cap on a communication kernel's grid) is None or a positive int."""
    if programs is not None and (isinstance(programs, bool) or not isinstance(programs, int) or programs < 1):
        raise ValueError(f"comm_programs must be None or a positive int (a cap on the programs per kernel), got {programs!r}")


def comm_grid(work_items: int, programs: int | None = None, what: str = "work items") -> tuple[int]:
    """The 1-D grid of a communication kernel that walks ``work_items`` items with a grid-stride loop.

    Args:
        work_items: independent items of the launch (e.g. ranks driven x token blocks).
        programs: at most this many programs (``None``: one per item). Each item is computed by
            exactly one program whatever the cap, in the same arithmetic, so results do not
            depend on it; a cap only leaves SMs free for work running beside the kernel.
        what: the items' name, for the error message.

    Returns:
        ``(grid,)`` with ``1 <= grid <= min(work_items, programs)`` (at least one program, which
        finds nothing to do when ``work_items`` is 0).

    Raises:
        ValueError: if ``work_items`` exceeds :data:`MAX_WORK_ITEMS`, or ``programs`` is not a positive int.
    """
    check_programs(programs)
    if work_items > MAX_WORK_ITEMS:
        raise ValueError(f"{work_items} {what} in one launch exceed the communication kernels' limit of {MAX_WORK_ITEMS}")
    return (max(1, min(work_items, programs or work_items)),)


@triton.jit
def token_block(step, blocks, tokens, entry_rank_stride, K: tl.constexpr, BLOCK_T: tl.constexpr):
    """Work item ``step`` of dispatch and combine: one local rank's block of ``BLOCK_T`` tokens.

    Returns ``(local rank, tokens [BLOCK_T], token mask, first entry of each token)``, in int64 from
    here on: entry and row offsets pass ``2**31`` at large ``s*K`` and ``s*H``.
    """
    item = tl.full([], 0, tl.int64) + step
    local = item // blocks
    token = (item - local * blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    return local, token, token < tokens, local * entry_rank_stride + token * K


@triton.jit
def row_runs(end_ptr, rows, skip_ptr, skip_stop):
    """The rows a row kernel covers: ``(first_end, second_start, end)``, two runs ``[0, first_end)``
    and ``[second_start, end)``. ``end`` is ``end_ptr[0]`` (read on the device), or ``rows`` when
    ``end_ptr`` is None; ``skip_ptr`` None: one run (the second empty), else rows
    ``[skip_ptr[0], skip_stop)`` are skipped (a layer's shard holds its home rows, then unused
    rows, then the borrow slots' rows from a fixed row)."""
    if end_ptr is None:
        end = rows
    else:
        end = tl.load(end_ptr)
    if skip_ptr is None:
        first_end = end
        second_start = end
    else:
        first_end = tl.minimum(tl.load(skip_ptr), end)
        second_start = tl.maximum(skip_stop, first_end)
    return first_end, second_start, tl.maximum(end, second_start)


@triton.jit
def run_block_count(first_end, second_start, end, BLOCK_M: tl.constexpr):
    """Row blocks of ``BLOCK_M`` rows over the two runs of :func:`row_runs` (each run's last block may be partial)."""
    return tl.cdiv(first_end, BLOCK_M) + tl.cdiv(end - second_start, BLOCK_M)


@triton.jit
def run_block(block, first_end, second_start, end, BLOCK_M: tl.constexpr):
    """``(first row, end row of its run)`` of row block ``block`` (see :func:`run_block_count`)."""
    first_blocks = tl.cdiv(first_end, BLOCK_M)
    if block < first_blocks:
        first = block * BLOCK_M
        stop = first_end
    else:
        first = second_start + (block - first_blocks) * BLOCK_M
        stop = end
    return first, stop


def skip_arguments(skip, rows: int) -> tuple[torch.Tensor | None, int]:
    """The row kernels' ``(skip_ptr, skip_stop)`` for ``skip``: ``(None, 0)`` for None, else
    ``skip`` itself once checked to be ``(start [1] int32 tensor, stop int in [0, rows])``
    (``ValueError`` otherwise)."""
    if skip is None:
        return None, 0
    if (not isinstance(skip, tuple) or len(skip) != 2 or not isinstance(skip[0], torch.Tensor)
            or skip[0].numel() != 1 or skip[0].dtype != torch.int32
            or isinstance(skip[1], bool) or not isinstance(skip[1], int) or not 0 <= skip[1] <= rows):
        raise ValueError(f"skip must be None or (start: a one-element int32 tensor, stop: an int in [0, {rows}]), "
                         f"got {skip!r}")
    return skip


@triton.jit
def round_to_bf16(x):
    """fp32 ``x`` rounded to nearest even bf16, still in fp32 (the interpreter's cast truncates);
    NaN stays NaN (the carry would turn the GPU's NaN, ``0x7FFFFFFF``, into -0)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32 in [-448, 448]) rounded to nearest even on the e4m3 grid, in fp32: 3 mantissa
    bits for normal values (a carry may bump the exponent), steps of 2**-9 below 2**-6."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 1.5 * 2**14 has a unit in the last place of 2**-9
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)
