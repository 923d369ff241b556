"""mxfp4 experts decoded into bf16 on the GPU, for the grouped GEMMs of prefill-sized steps.

Hopper has no FP4 tensor cores: :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` decodes
each weight tile in registers once per row tile, which pays off while a tile's rows are few (the
weights' bytes bound decode steps) but not when an expert holds hundreds of rows: there the decode
runs once per 64 rows and the tensor cores wait for it. :func:`dequantize_mxfp4_triton` instead
decodes every weight once, into a bf16 buffer that a bf16 grouped GEMM (``torch._grouped_mm``)
then reads: ``2 + 17/32`` bytes moved per weight (the packed values and scales read, bf16
written), and the buffer's ``2`` bytes per weight of memory for the call
(:func:`mxfp4_grouped_mm_bf16`).

The decode is the GEMM's own (FlatEP's word layout, :data:`flatep.quant.mxfp4.WORD_PAIRS`, two
weights per instruction) in its two-multiply form, exact at every scale byte, followed by the
permutation back to column order: an e2m1 value times a power of two is a bf16, except that a
scale byte 0 (``2**-127``) gives 0, as in the GEMM's second pass (its values are below
``6 * 2**-127``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.activation import copy_rows_triton
from flatep.kernels.backend import interpreting
from flatep.kernels.grouped_checks import check_groups, output_for
from flatep.kernels.mxfp4_decode import decoded_tile, mma_decoded_tile

_BLOCK_N = 64  # output rows (weight columns N) a program decodes; 64 x 256 weights a step on 4 warps

THROUGH_BF16_ROWS = 512
"""Rows per expert (a step's average, :func:`flatep.experts.grouped.quantized_grouped_mm`'s
``rows_per_group``) from which mxfp4 GEMMs run :func:`mxfp4_grouped_mm_bf16` rather than the
in-register kernel. On the H200 (one Kimi-K3 rank, 112 experts; bench/results/2026-12-05-h200-d,
``python -m flatep.quant.bench --quick``), against bf16 ``torch._grouped_mm``: at 256 rows per
expert 1.95x through bf16 against 1.70-1.77x for the best tiles, at 1024 rows 1.08x (gate/up) and
1.25x (down) against 1.65x and 1.88x. The route's time less the bf16 arm's was 1.6-1.8 ms for
gate/up (4.9 GB of bf16 written) and 0.85-0.87 ms for down at 16 to 256 rows per expert (at 1024
rows 0.6 and 0.8 ms: the two arms' bf16 GEMMs were not timed alike there), a fixed price, while the
tiles' excess over bf16 grows with the rows. Interpolating between the two sizes timed, the route
breaks even somewhere near 350 rows; 512 keeps a margin. The route holds a bf16 copy of one weight
set for the call (4.9 GB for a Kimi-K3 rank's gate/up weights): where memory is shorter than time,
set this (read at each call) to ``2**31`` to keep the in-register kernel at every size."""


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, ends_ptr, N, stride_se, stride_sn, stride_sk, K: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr, MMA: tl.constexpr,
):
    """Rows ``[pid0 * BLOCK_N, + BLOCK_N)`` of expert ``pid1``, all of ``K`` (``BLOCK_K`` divides it);
    with ``ends_ptr``, only if the expert's group holds rows. ``MMA``: the words in the ``mma`` layout."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    expert = tl.program_id(1).to(tl.int64)
    column = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    column_mask = column < N
    word = tl.arange(0, WORDS)
    block = tl.arange(0, BLOCKS)
    inner = tl.arange(0, BLOCK_K)
    w_tile = w_ptr + expert * N * (K // 8) + column.to(tl.int64)[:, None] * (K // 8) + word[None, :]
    s_tile = s_ptr + expert * stride_se + column.to(tl.int64)[:, None] * stride_sn + block[None, :] * stride_sk
    out_tile = out_ptr + expert * N * K + column.to(tl.int64)[:, None] * K + inner[None, :]
    rows = 1
    if ends_ptr is not None:
        rows = tl.load(ends_ptr + expert) - tl.where(expert > 0, tl.load(ends_ptr + tl.maximum(expert - 1, 0)), 0)
    if rows > 0:
        for k in range(0, K, BLOCK_K):
            words = tl.load(w_tile + k // 8, mask=column_mask[:, None], other=0)
            exponent = tl.load(s_tile + (k // 32) * stride_sk, mask=column_mask[:, None], other=0)
            if MMA:
                w = mma_decoded_tile(words, exponent.to(tl.int32), BLOCK_N, BLOCK_K, INTERPRET)
            else:
                w = decoded_tile(words, exponent.to(tl.int32), BLOCK_N, BLOCK_K, True, INTERPRET)
            tl.store(out_tile + k, w.to(out_ptr.dtype.element_ty), mask=column_mask[:, None])


def _block_k(inner: int) -> int:
    """The largest power of two dividing ``inner`` (a multiple of 32), at most 256."""
    return min(256, inner & -inner)


def dequantize_mxfp4_triton(
    values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None, ends: torch.Tensor | None = None,
    layout: str = "words",
) -> torch.Tensor:
    """Decode mxfp4 experts into bf16.

    Args:
        values: ``[G, N, K/2]`` uint8 in FlatEP's word layout (as pools hold them), or in the ``mma``
            layout with ``layout="mma"``, contiguous, ``K`` a multiple of 32.
        scales: ``[G, N, K/32]`` uint8 e8m0, in any strides (pools store them column-fastest).
        out: optional contiguous ``[G, N, K]`` bf16 to write into.
        ends: optional ``[G]`` int32 on the device, the inclusive end rows of a grouped GEMM's groups
            over these experts (group ``g`` holds ``ends[g] - ends[g-1]`` rows, the first
            ``ends[0]``): the experts whose group holds no rows are not decoded (a layer's unused
            borrow slots), and their part of ``out`` is left as it was.

    Returns:
        ``out`` or a new ``[G, N, K]`` bf16 tensor: ``e2m1 * 2**(scale - 127)`` per weight.
    """
    if layout not in ("words", "mma"):
        raise ValueError(f"layout must be 'words' or 'mma' (the layouts expert pools hold), got {layout!r}")
    if values.dim() != 3 or values.dtype != torch.uint8 or not values.is_contiguous() or values.shape[-1] % 16:
        raise ValueError(f"values must be a contiguous [G, N, K/2] uint8 tensor with K a multiple of 32, got "
                         f"{values.dtype} {list(values.shape)}")
    groups, columns, half = values.shape
    inner = 2 * half
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (groups, columns, inner // 32):
        raise ValueError(f"scales must be a [{groups}, {columns}, {inner // 32}] uint8 tensor, got {scales.dtype} "
                         f"{list(scales.shape)}")
    if scales.device != values.device:
        raise ValueError(f"values and scales must be on one device, got {values.device} and {scales.device}")
    if out is None:
        out = torch.empty(groups, columns, inner, dtype=torch.bfloat16, device=values.device)
    elif out.dtype != torch.bfloat16 or tuple(out.shape) != (groups, columns, inner) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{groups}, {columns}, {inner}] bf16 tensor, got {out.dtype} "
                         f"{list(out.shape)}")
    if ends is not None and (ends.dtype != torch.int32 or tuple(ends.shape) != (groups,) or ends.device != values.device):
        raise ValueError(f"ends must be a [{groups}] int32 tensor on {values.device}, got {ends.dtype} "
                         f"{list(ends.shape)} on {ends.device}")
    if out.numel():
        _dequantize_kernel[(triton.cdiv(columns, _BLOCK_N), groups)](
            values.view(torch.int32), scales, out, ends, columns, *scales.stride(), inner,
            BLOCK_N=_BLOCK_N, BLOCK_K=_block_k(inner), INTERPRET=interpreting(), MMA=layout == "mma", num_warps=4,
        )
    return out


def mxfp4_grouped_mm_bf16(
    rows: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_base: int = 0,
    layout: str = "words",
) -> torch.Tensor:
    """:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton`'s product (every group), through
    bf16: each weight set decoded whole (:func:`dequantize_mxfp4_triton`), then ``torch._grouped_mm``.

    Only the experts whose groups hold rows are decoded (read on the device): a layer's borrow
    slots are mostly empty. With ``slots`` (or a given ``out``) the home groups run over
    ``rows[:slot_base]`` and the slot groups over ``rows[slot_base:]`` (their offsets shifted on
    the device), the slots decoded once the home GEMM has read its weights, and each part's real
    rows are copied into the output. Memory: one set's bf16 weights (``G * N * K * 2`` bytes)
    and one part's product for the call.

    Args and returns as :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` (no tile config; the
    ``mma`` layout's rows stay bf16 here).
    """
    if rows.dim() != 2 or rows.dtype != torch.bfloat16 or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] bfloat16 with unit column stride, got {rows.dtype} {list(rows.shape)}")
    if values.dim() != 3 or 2 * values.shape[-1] != rows.shape[1]:
        raise ValueError(f"values must be [G, N, K/2={rows.shape[1] // 2}] for rows {list(rows.shape)}, got "
                         f"{list(values.shape)}")
    slot_values, slot_scales = check_groups(rows, values, scales, offsets, slots, slot_base)
    groups = values.shape[0]
    if slots is None and out is None:  # one product, which is the output
        weights = dequantize_mxfp4_triton(values, scales, ends=offsets, layout=layout)
        return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=offsets)
    out = output_for(rows, values.shape[1], out)
    sets = [(values, scales, 0, groups, 0, rows.shape[0] if slots is None else slot_base)]
    if slots is not None:
        sets.append((slot_values, slot_scales, groups, offsets.shape[0], slot_base, rows.shape[0]))
    for set_values, set_scales, first, last, start, stop in sets:
        if first == last:
            continue
        ends = offsets[first:last] - start
        weights = dequantize_mxfp4_triton(set_values, set_scales, ends=ends, layout=layout)
        product = torch._grouped_mm(rows[start:stop], weights.transpose(-2, -1), offs=ends)
        del weights  # the next set's decode takes its memory (the caching allocator orders it after this GEMM)
        copy_rows_triton(out[start:stop], product, ends[-1:])
    return out
