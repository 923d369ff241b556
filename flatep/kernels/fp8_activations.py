"""DeepSeek-V3's fp8 activation quantization, in Triton: per token and per 128 columns, ``scale =
max(amax, 1e-10) / 448`` (a product with the fp32 reciprocal of 448) and the values ``x / scale``
rounded to e4m3 and saturated, as :func:`flatep.quant.quantize_fp8_activations` defines it.

:func:`quantize_fp8_activations_triton` quantizes a shard's rows before the fp8 GEMMs
(:mod:`flatep.kernels.quant_gemm`); :func:`e4m3_rows` is the step that the kernels which quantize
their own output share (:mod:`flatep.kernels.activation`, and :mod:`flatep.kernels.fp8_rows` through
:func:`act_quant_kernel`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import (
    interpreting,
    round_to_e4m3,
    row_programs,
    row_runs,
    run_block,
    run_block_count,
    skip_arguments,
)
from flatep.quant.fp8 import E4M3_MAX, E4M3_RECIPROCAL, FP8_BLOCK

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_RECIPROCAL = tl.constexpr(E4M3_RECIPROCAL)


@triton.jit
def e4m3_rows(x, FROM_BF16: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """DeepSeek-V3's activation quantization of fp32 ``x [N, GROUP]`` (one column group per row):
    ``(values [N, GROUP] fp32 on the e4m3 grid, scales [N] fp32)``, ``scale = max(amax, 1e-10) / 448``
    (a product with the fp32 reciprocal, as :func:`flatep.quant.quantize_fp8_activations` defines it),
    values ``x / scale`` correctly rounded to fp32, then to e4m3. ``FROM_BF16``: ``x`` holds bf16
    values (upcast). ``ROUND_FIRST`` rounds the values to the grid here (the interpreter's fp32 ->
    e4m3 cast drops carries: 127.2 -> 64); the hardware's cast rounds them itself."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * _E4M3_RECIPROCAL
    if FROM_BF16 and not ROUND_FIRST:
        # A correctly rounded division (div_rn) a value takes a slow path for zero dividends: all-zero
        # rows took 977 us against 589 for random ones on an H100 (bench/scripts/act_quant_data.py,
        # bench/results/2026-12-06-h100-h). For bf16 values one product with the row's reciprocal and
        # one Newton step with an exact remainder (two fmas) give the same e4m3 value as x / scale
        # for every bf16 x and amax: checked exhaustively (tests/quant/test_grouped.py). The fp32
        # quotient itself is the correctly rounded one down to |x| ~ 1e-37, where the remainder
        # underflows, far below e4m3's smallest step. It runs at div_rn's fast-path speed on any rows.
        reciprocal = tl.math.div_rn(1.0, scale)
        # A row holding inf has scale inf and reciprocal 0: leave its finite values' zeros (x / inf)
        # uncorrected, as inf * 0 would make them NaN.
        divisor = tl.where(reciprocal == 0.0, 0.0, -scale)
        estimate = x * reciprocal[:, None]
        remainder = tl.fma(divisor[:, None], estimate, x)  # x - scale * estimate, exact
        quotient = tl.fma(remainder, reciprocal[:, None], estimate)
        # The sum of zeros of both signs is +0: a negative x whose quotient is zero (x = -0) gets
        # its sign back, as x / scale keeps it. Other quotients already have x's sign.
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        quotient = (quotient.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        # div_rn, not ``/``: Triton's fp32 ``/`` is the GPU's approximate division (up to 2 ulp
        # off), which put a few values in a million on the next e4m3 code.
        quotient = tl.math.div_rn(x, scale[:, None])
    # NaN stays NaN, as torch's clamp keeps it (min and max alone would make it -448 or 448).
    q = tl.clamp(quotient, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_FIRST:
        q = round_to_e4m3(q)
    return q, scale


@triton.jit
def act_quant_kernel(
    x_ptr, q_ptr, s_ptr, end_ptr, skip_ptr, rows, skip_stop, stride_x, stride_q, stride_s, K,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    # Program (row blocks program_id(0), program_id(0) + P, ... of the rows row_runs gives;
    # column group program_id(1)): each group's e4m3 values and its one fp32 scale per row. The
    # last group of a K that is not a multiple of GROUP is partial (its absent columns count as 0).
    first_end, second_start, end = row_runs(end_ptr, rows, skip_ptr, skip_stop)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    FROM_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    block = tl.program_id(0)
    while block < blocks:  # a while loop: Triton 3.6's interpreter takes no loaded value as a range bound
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = row < stop
        mask = row_mask[:, None] & (column < K)[None, :]
        x = tl.load(x_ptr + row[:, None] * stride_x + column[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = e4m3_rows(x, FROM_BF16, ROUND_FIRST)
        tl.store(q_ptr + row[:, None] * stride_q + column[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_s + tl.program_id(1), scale, mask=row_mask)
        block += tl.num_programs(0)


ACT_QUANT_ROWS = 16
ACT_QUANT_PROGRAMS_PER_SM = 64
ACT_QUANT_WARPS = 2
"""Launch of the fp8 activation quantization: 16-row blocks of one 128-column group per program
step, 2 warps, 64 programs per SM over all groups. On the H200 (K = 7168, CUDA-graph replays) it
took 8.3, 55.0 and 445 us for 1024, 8192 and 65536 rows, against 9.5, 63.1 and 475 us for the
previous 4 warps and 8 programs per SM; 32- and 64-row blocks were no faster (55.5-75.4 us at
8192 rows)."""


def quantize_fp8_activations_triton(
    rows: torch.Tensor, end: torch.Tensor, skip: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column fp8 quantization of ``rows [M, K]`` (bf16, ``K`` a multiple of 128)
    over rows before ``end[0]`` (``[1]`` int32 on the device); later rows of the results undefined.
    ``skip=(start, stop)``: rows ``[start[0], stop)`` are skipped too (``start`` a ``[1]`` int32
    tensor on the device, ``stop`` an int), e.g. the unused rows between a shard's home rows and
    its slot rows.

    Returns:
        ``(values [M, K] float8_e4m3fn, scales [M, K/128] float32)``, as
        :func:`flatep.quant.quantize_fp8_activations` computes them.
    """
    count, columns = rows.shape
    if columns % FP8_BLOCK or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] with unit column stride and K a multiple of 128, got {list(rows.shape)}")
    skip_start, skip_stop = skip_arguments(skip, count)
    values = torch.empty(count, columns, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(count, columns // FP8_BLOCK, dtype=torch.float32, device=rows.device)
    block_m, groups = ACT_QUANT_ROWS, columns // FP8_BLOCK
    # Grid-strided over the rows before end[0]: a shard sized for the step's worst case (tens of
    # thousands of row blocks at decode) launches no program per unused block.
    act_quant_kernel[(row_programs(count, block_m, groups, rows.device, per_sm=ACT_QUANT_PROGRAMS_PER_SM), groups)](
        rows, values, scales, end, skip_start, count, skip_stop, rows.stride(0), columns, groups, columns,
        BLOCK_M=block_m, GROUP=FP8_BLOCK, ROUND_FIRST=interpreting(), num_warps=ACT_QUANT_WARPS,
    )
    return values, scales
