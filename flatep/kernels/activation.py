"""The experts' elementwise steps over a receive shard's real rows only.

A shard has ``rows`` rows, of which only the first ``end = offsets[-1]`` are real; the grouped GEMMs
skip the rest, but plain torch ops between them would run over all ``rows`` (several times the
real rows at small batch). These kernels read ``end`` on the device (no host sync, so they can be
captured in a CUDA graph): a fixed number of programs (a few per SM, never more than the row
blocks) walk the row blocks before ``end`` with a grid stride and stop there, so their cost scales
with the real rows, and a launch over an empty part (``end = 0``, e.g. the slot half of a step
that borrows nothing) is one short wave instead of one program per block of the whole part. Rows
past ``end`` are neither read nor written. Where a rank's home experts and its borrow slots share
the launches, the shard holds home rows, then unused rows up to the slots' fixed first row, then
slot rows: ``skip=(start, stop)`` leaves the unused ones out too (the row blocks are numbered over
the two runs, :func:`flatep.kernels.backend.row_runs`).

- :func:`swiglu_weighted_triton`: ``silu(gate) * up * route_weight`` in fp32, rounded once to the
  output dtype (the ``fp32`` precision of :func:`flatep.experts.grouped.grouped_swiglu`); for fp8
  down projections, those bf16 values quantized to e4m3 per 128 columns in the same pass (what
  the fp8 GEMM would otherwise do in a launch of its own, re-reading them).
- :func:`copy_rows_triton`: copy (and convert) the real rows of the experts' output into the
  symmetric buffer that combine reads.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flatep.kernels.backend import (
    column_block,
    interpreting,
    round_to_bf16,
    row_programs,
    row_runs,
    run_block,
    run_block_count,
    skip_arguments,
)
from flatep.kernels.fp8_activations import e4m3_rows
from flatep.quant.fp8 import FP8_BLOCK

_FP8_GROUP = tl.constexpr(FP8_BLOCK)  # columns per fp8 scale, inside the kernel

@triton.jit
def _swiglu_weighted_kernel(
    hidden_ptr, weight_ptr, end_ptr, skip_ptr, skip_stop, out_ptr, scale_ptr, hidden_stride, out_stride, scale_stride,
    I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    # scale_ptr None: out holds the values in its dtype. Else out is e4m3 and scale_ptr takes one
    # fp32 scale per row per 128 columns (BLOCK_I and I multiples of 128).
    first_end, second_start, end = row_runs(end_ptr, 0, skip_ptr, skip_stop)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    # A while loop, not range(..., blocks, ...): Triton 3.6's interpreter cannot take a loaded value
    # as a range bound.
    block = tl.program_id(0)
    while block < blocks:
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = first + tl.arange(0, BLOCK_M)
        row_mask = row < stop
        # NaN and +-inf weights propagate into the row, as in a dense MoE.
        weight = tl.load(weight_ptr + row, mask=row_mask, other=0.0).to(tl.float32)
        mask = row_mask[:, None] & (column < I)[None, :]
        # M * 2I exceeds 2**31 at real sizes: row offsets in int64.
        hidden_rows = hidden_ptr + row.to(tl.int64)[:, None] * hidden_stride + column[None, :]
        # Upcast right after loading: all arithmetic in fp32 (also, the interpreter's bf16 arithmetic is wrong).
        gate = tl.load(hidden_rows, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(hidden_rows + I, mask=mask, other=0.0).to(tl.float32)
        # torch's order: (silu(gate) * up) * weight, silu(g) = g / (1 + exp(-g)).
        activated = gate / (1.0 + tl.exp(-gate)) * up * weight[:, None]
        if ROUND_FIRST and (scale_ptr is not None or out_ptr.dtype.element_ty == tl.bfloat16):
            activated = round_to_bf16(activated)  # the interpreter's cast to bf16 truncates; the GPU's rounds
        out_rows = out_ptr + row.to(tl.int64)[:, None] * out_stride + column[None, :]
        if scale_ptr is None:
            tl.store(out_rows, activated.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            # The bf16 rows the unquantized path stores, then the fp8 GEMM's own quantization of them.
            GROUPS: tl.constexpr = BLOCK_I // _FP8_GROUP
            rounded = tl.reshape(activated.to(tl.bfloat16).to(tl.float32), [BLOCK_M * GROUPS, _FP8_GROUP])
            values, scales = e4m3_rows(rounded, True, ROUND_FIRST)
            tl.store(out_rows, tl.reshape(values, [BLOCK_M, BLOCK_I]).to(out_ptr.dtype.element_ty), mask=mask)
            group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
            scale_rows = scale_ptr + row.to(tl.int64)[:, None] * scale_stride + group[None, :]
            tl.store(scale_rows, tl.reshape(scales, [BLOCK_M, GROUPS]),
                     mask=row_mask[:, None] & (group < I // _FP8_GROUP)[None, :])
        block += tl.num_programs(0)


@triton.jit
def _copy_rows_kernel(
    target_ptr, source_ptr, end_ptr, skip_ptr, skip_stop, target_stride, source_stride,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    first_end, second_start, end = row_runs(end_ptr, 0, skip_ptr, skip_stop)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    block = tl.program_id(0)
    while block < blocks:  # a while loop for Triton 3.6's interpreter, as above
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (row < stop)[:, None] & (column < N)[None, :]
        values = tl.load(source_ptr + row[:, None] * source_stride + column[None, :], mask=mask)
        tl.store(target_ptr + row[:, None] * target_stride + column[None, :], values.to(target_ptr.dtype.element_ty), mask=mask)
        block += tl.num_programs(0)


def _check_rows(name: str, tensor: torch.Tensor, rows: int) -> None:
    if tensor.dim() != 2 or tensor.shape[0] != rows or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be [{rows}, N] with unit column stride, got shape {tuple(tensor.shape)} "
                         f"and strides {tensor.stride()}")


def _check_end(end: torch.Tensor) -> None:
    if end.numel() != 1 or end.dtype != torch.int32:
        raise ValueError(f"end must be a one-element int32 tensor, got {end.numel()} elements of {end.dtype}")


def swiglu_weighted_triton(
    hidden: torch.Tensor,
    route_weights: torch.Tensor,
    end: torch.Tensor,
    out: torch.Tensor,
    block_m: int = 4,
    block_i: int | None = None,
    num_warps: int = 4,
    programs: int | None = None,
    scales: torch.Tensor | None = None,
    skip: tuple[torch.Tensor, int] | None = None,
) -> None:
    """``out[i] = silu(gate[i]) * up[i] * route_weights[i]`` for rows ``i < end[0]``.

    Computed in fp32 and rounded once to ``out``'s dtype; NaN and infinite route weights propagate
    (the row is not finite, as a dense MoE's would be). Rows at and past ``end[0]`` are neither
    read nor written.

    With ``scales``, ``out`` is float8_e4m3fn: each row's values are rounded to bf16, then
    quantized per 128 columns into ``out`` and ``scales`` exactly as
    :func:`flatep.kernels.fp8_activations.quantize_fp8_activations_triton` quantizes bf16 rows (the
    input of an fp8 down projection, in one pass instead of two).

    Args:
        hidden: ``[M, 2I]`` bf16 or fp32 output of the gate/up GEMM: gate columns ``[0, I)``, up
            columns ``[I, 2I)`` (unit column stride).
        route_weights: ``[M]`` fp32 (contiguous).
        end: ``[1]`` int32 on the device: the number of real rows (e.g. ``offsets[-1:]``, a view).
        out: ``[M, I]`` bf16 or fp32, or float8_e4m3fn with ``scales`` (unit column stride); written.
        block_m, block_i, num_warps: rows and columns per program, warps per program (tuning; the
            defaults are untuned: 4 rows of 2 KiB column chunks, like dispatch's tiles). With
            ``scales``, ``block_i`` must be a multiple of 128.
        programs: programs along the rows (default: 8 per SM in all, see :func:`flatep.kernels.backend.row_programs`).
        scales: optional ``[M, I/128]`` float32 (unit column stride), ``I`` a multiple of 128; written.
        skip: optional ``(start [1] int32 on the device, stop: int)``: rows ``[start[0], stop)``
            are skipped too (neither read nor written), e.g. the unused rows between a shard's
            home rows and its slot rows.
    """
    rows, intermediate = out.shape
    _check_rows("hidden", hidden, rows)
    _check_rows("out", out, rows)
    _check_end(end)
    if hidden.shape[1] != 2 * intermediate:
        raise ValueError(f"hidden must have 2 * {intermediate} columns, got {hidden.shape[1]}")
    if route_weights.shape != (rows,) or route_weights.dtype != torch.float32 or not route_weights.is_contiguous():
        raise ValueError(f"route_weights must be a contiguous [{rows}] float32 tensor")
    block_i = block_i or column_block(intermediate, hidden.element_size())
    if scales is None and out.dtype not in (torch.bfloat16, torch.float32):
        # An fp8 output without its scales would hold the values cast unscaled: refuse it.
        raise ValueError(f"out must be bfloat16 or float32 (float8_e4m3fn with scales), got {out.dtype}")
    if scales is not None:
        if out.dtype != torch.float8_e4m3fn or intermediate % FP8_BLOCK:
            raise ValueError(f"with scales, out must be float8_e4m3fn with I a multiple of {FP8_BLOCK}, got "
                             f"{out.dtype} and I={intermediate}")
        _check_rows("scales", scales, rows)
        if scales.shape[1] != intermediate // FP8_BLOCK or scales.dtype != torch.float32:
            raise ValueError(f"scales must be [{rows}, {intermediate // FP8_BLOCK}] float32, got {scales.dtype} "
                             f"{list(scales.shape)}")
        if block_i % FP8_BLOCK:  # the default is: a power of two, at least 128 when I is a multiple of 128
            raise ValueError(f"block_i must be a multiple of {FP8_BLOCK} with scales, got {block_i}")
    skip_start, skip_stop = skip_arguments(skip, rows)
    columns = triton.cdiv(intermediate, block_i)
    _swiglu_weighted_kernel[(row_programs(rows, block_m, columns, out.device, programs), columns)](
        hidden, route_weights, end, skip_start, skip_stop, out, scales, hidden.stride(0), out.stride(0), 0 if scales is None else scales.stride(0),
        I=intermediate, BLOCK_M=block_m, BLOCK_I=block_i, ROUND_FIRST=interpreting(), num_warps=num_warps,
    )


def copy_rows_triton(
    target: torch.Tensor,
    source: torch.Tensor,
    end: torch.Tensor,
    block_m: int = 4,
    block_n: int | None = None,
    num_warps: int = 4,
    programs: int | None = None,
    skip: tuple[torch.Tensor, int] | None = None,
) -> None:
    """``target[:end[0]] = source[:end[0]]`` converted to ``target``'s dtype; later rows untouched.

    Args:
        target: ``[M, N]`` (unit column stride); written.
        source: ``[M, N]`` (unit column stride), any dtype Triton converts (bf16, fp32).
        end: ``[1]`` int32 on the device: rows to copy.
        block_m, block_n, num_warps: rows and columns per program, warps per program (tuning; untuned).
        programs: programs along the rows (default: 8 per SM in all).
        skip: optional ``(start [1] int32 on the device, stop: int)``: rows ``[start[0], stop)``
            are not copied either (see :func:`swiglu_weighted_triton`).
    """
    rows, columns = target.shape
    _check_rows("source", source, rows)
    _check_end(end)
    if source.shape[1] != columns:
        raise ValueError(f"source must be shaped like target {tuple(target.shape)}, got {tuple(source.shape)}")
    skip_start, skip_stop = skip_arguments(skip, rows)
    block_n = block_n or column_block(columns, max(source.element_size(), target.element_size()))
    column_blocks = triton.cdiv(columns, block_n)
    _copy_rows_kernel[(row_programs(rows, block_m, column_blocks, target.device, programs), column_blocks)](
        target, source, end, skip_start, skip_stop, target.stride(0), source.stride(0),
        N=columns, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )


def swiglu_weighted_torch(
    hidden: torch.Tensor,
    route_weights: torch.Tensor,
    out_dtype: torch.dtype,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Plain-torch twin over all rows: ``(act(gate, up) * route_weights).to(out_dtype)`` in fp32.

    The check for :func:`swiglu_weighted_triton`, and the torch path of the experts' ``fp32``
    precision (which passes its own activation).

    Args:
        hidden: ``[M, 2I]`` any float dtype (used in fp32).
        route_weights: ``[M]`` (used in fp32; NaN and +-inf propagate).
        out_dtype: dtype of the result.
        activation: ``act(gate, up)`` on the fp32 halves (default ``silu(gate) * up``, the kernel's).

    Returns:
        ``[M, I]`` in ``out_dtype``.
    """
    intermediate = hidden.shape[-1] // 2
    hidden = hidden.float()
    gate, up = hidden[:, :intermediate], hidden[:, intermediate:]
    activated = F.silu(gate) * up if activation is None else activation(gate, up)
    return (activated * route_weights.float().unsqueeze(-1)).to(out_dtype)
