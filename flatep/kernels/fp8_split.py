"""Rows split into two e4m3 parts for the fp8-activation mxfp4 GEMM (:mod:`flatep.kernels.mxfp4_fp8mma`).

A row ``x [K]`` (bf16) with largest magnitude ``amax`` gets the power of two ``2**t``, ``t = 8 -
ceil(log2(amax))``, that puts ``amax * 2**t`` in ``(128, 256]``; then ``hi = e4m3(x * 2**t)`` and ``lo =
e4m3(x * 2**t - hi)`` (rounded to nearest even). ``hi`` holds a value's top 4 significant bits and
``lo`` the next 4, so ``hi + lo`` is ``x * 2**t`` exactly wherever ``x`` is at least ``2**-9`` of the row's
largest magnitude; smaller values keep their bits down to e4m3's smallest step, ``2**-9`` after
scaling (an error of at most ``2**-17`` of the row's largest). The GEMM sums both
parts' products and multiplies by ``factor = 2**(center - 127 - t)``, where the weights' table is
``e2m1 * 2**(scale - center)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import (
    round_to_e4m3,
    row_programs,
    row_runs,
    run_block,
    run_block_count,
    skip_arguments,
)

SPLIT_ROWS = 4
"""Rows a program splits at a time."""
SPLIT_K = 512
"""Columns a program loads at a time."""


def split_rows(rows: torch.Tensor, center: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The definition, in torch: ``rows [M, K]`` (bf16 or fp32) -> ``(hi_lo [2M, K]`` float8_e4m3fn (the
    ``hi`` rows, then the ``lo`` rows), ``factor [M]`` fp32 ``2**(center - 127 - t))``. A row of zeros
    gets ``t = 108``."""
    x = rows.float()
    amax = x.abs().amax(1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): ceil(log2 amax) = exponent - (m == 0.5)
    power_of_two = torch.ldexp(torch.ones_like(amax), exponent - 1) == amax
    t = torch.where(amax > 0, 8 - (exponent - power_of_two.int()), torch.full_like(exponent, 108))
    t = t.clamp(-126, center - 1)
    scaled = torch.ldexp(x, t[:, None])
    hi = scaled.to(torch.float8_e4m3fn)
    lo = (scaled - hi.float()).to(torch.float8_e4m3fn)
    return torch.cat([hi, lo]), torch.ldexp(torch.ones_like(amax), center - 127 - t)


@triton.jit
def _split_kernel(x_ptr, out_ptr, factor_ptr, end_ptr, skip_ptr, rows, skip_stop, stride_x, K,
                  CENTER_EXPONENT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Grid-strided over the row blocks of :func:`flatep.kernels.backend.row_runs`: each block's largest
    magnitudes, then its ``hi`` rows (``out`` rows ``[0, rows)``) and ``lo`` rows (from row ``rows``)."""
    first_end, second_start, end = row_runs(end_ptr, rows, skip_ptr, skip_stop)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.arange(0, BLOCK_K)
    block = tl.program_id(0)
    while block < blocks:
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = row < stop
        amax = tl.zeros([BLOCK_M], tl.float32)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + column < K)[None, :]
            x = tl.load(x_ptr + row[:, None] * stride_x + k + column[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
        bits = amax.to(tl.int32, bitcast=True)
        # ceil(log2(amax)) of a normal float: its exponent, plus one unless its mantissa is zero
        exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        t = tl.where(amax > 0, 8 - exponent, 108)
        t = tl.minimum(tl.maximum(t, -126), CENTER_EXPONENT + 126)
        scale = ((t + 127) << 23).to(tl.float32, bitcast=True)
        factor = ((CENTER_EXPONENT - t + 127) << 23).to(tl.float32, bitcast=True)
        tl.store(factor_ptr + row, factor, mask=row_mask)
        for k in range(0, K, BLOCK_K):
            mask = row_mask[:, None] & (k + column < K)[None, :]
            offset = row[:, None] * K + k + column[None, :]
            x = tl.load(x_ptr + row[:, None] * stride_x + k + column[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x * scale[:, None]
            # Both parts rounded to the e4m3 grid in fp32 arithmetic, then cast exactly: hi's value is
            # never read back from its fp8 cast, which on an H100 (Triton 3.6) gave some elements' lo
            # as if from another element's hi (lo values past hi's last bit, the layer's products wrong).
            hi = round_to_e4m3(x)
            rest = round_to_e4m3(x - hi)
            hi = hi.to(tl.float8e4nv)
            tl.store(out_ptr + offset, hi, mask=mask)
            tl.store(out_ptr + (row[:, None] + rows) * K + k + column[None, :], rest.to(tl.float8e4nv), mask=mask)
        block += tl.num_programs(0)


def split_rows_triton(
    rows: torch.Tensor, center: int, end: torch.Tensor | None = None, skip: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`split_rows` of ``rows [M, K]`` bf16 (unit column stride) over the rows before ``end[0]``
    (``[1]`` int32 on the device; None: every row) less ``skip=(start, stop)`` (rows ``[start[0], stop)``,
    as :func:`flatep.kernels.fp8_activations.quantize_fp8_activations_triton` takes it); other rows of the
    results undefined. Nothing is read on the host.

    Returns:
        ``(hi_lo [2M, K] float8_e4m3fn, factor [M] float32)``.
    """
    if rows.dim() != 2 or rows.dtype != torch.bfloat16 or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] bfloat16 with unit column stride, got {rows.dtype} {list(rows.shape)}")
    count, columns = rows.shape
    skip_start, skip_stop = skip_arguments(skip, count)
    hi_lo = torch.empty(2 * count, columns, dtype=torch.float8_e4m3fn, device=rows.device)
    factor = torch.empty(count, dtype=torch.float32, device=rows.device)
    if count:
        _split_kernel[(row_programs(count, SPLIT_ROWS, 1, rows.device), )](
            rows, hi_lo, factor, end, skip_start, count, skip_stop, rows.stride(0), columns,
            CENTER_EXPONENT=center - 127, BLOCK_M=SPLIT_ROWS, BLOCK_K=SPLIT_K, num_warps=4)
    return hi_lo, factor
