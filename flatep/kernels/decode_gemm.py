"""Grouped bf16 expert GEMMs for decode shards: each active expert's weights streamed once.

At decode sizes a rank's experts hold a few rows each, so its two grouped GEMMs are weight-read
bound: the time is the bytes of the active experts' weights over the device's read bandwidth.
These kernels keep to that floor:

- a persistent grid loops over the row tiles that hold rows only (the tile table of
  :mod:`flatep.kernels.quant_gemm`: a running sum of the groups' tiles, read on the device, so a
  call can be captured in a CUDA graph); an empty group costs no weight read, and the rows of the
  buffer past the step's rows cost no program;
- with ``swap_ab`` the product is computed transposed, ``W_tile @ A_tile.T``, so that the weight's
  rows fill the tensor core's 64-row side while a decode row tile is 16 or 32 rows;
- a launch can be limited to the groups within a range of rows (``group_rows``, read on the
  device): the layer runs the groups of at most :data:`HOT_ROWS` rows with short tiles and the
  hot ones, a skewed step's busiest experts, in a second launch with tall tiles
  (:func:`decode_launches`);
- :func:`gate_up_swiglu_triton` fuses the gate/up GEMM with the activation and the route weight:
  a program computes the gate columns ``[j, j + BLOCK_N)`` and the up columns ``[I + j, I + j +
  BLOCK_N)`` of its rows and writes ``silu(gate) * up * route_weight`` (``[rows, I]``), so the
  ``[rows, 2I]`` intermediate is never written and one launch less runs.

The fused epilogue rounds gate and up to bf16 first, as the unfused path's GEMM output is, then
computes the activation in fp32 and rounds once: the same function as
:func:`flatep.experts.grouped.grouped_swiglu`'s ``fp32`` precision, up to the GEMMs' summation
order. :func:`flatep.experts.grouped.grouped_swiglu` uses these kernels on CUDA where a group holds
at most :data:`DECODE_ROWS_PER_GROUP` rows on average (the crossover against
``torch._grouped_mm`` measured on the H200, see :func:`decode_config`).

Under ``TRITON_INTERPRET=1`` the operands are upcast to fp32 before the dots and results rounded
to bf16 in fp32 before the casts (the interpreter's bf16 arithmetic and casts truncate).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import interpreting, round_to_bf16
from flatep.kernels.grouped_checks import ALL_ROWS, check_group_rows, check_rows, check_split, output_for
from flatep.kernels.grouped_tiles import locate_tile, persistent_grid, tile_dot, tile_table
from flatep.kernels.packed_tiles import HOT_ROWS, GemmConfig

DECODE_ROWS_PER_GROUP = 64
"""Largest average rows per group for which :func:`flatep.experts.grouped.grouped_swiglu` takes
these kernels over ``torch._grouped_mm`` (bf16 weights on CUDA)."""


HOT_TILES = GemmConfig(128, 64, 64, num_warps=8, num_stages=4, swap_ab=False)
"""Tiles of the hot groups' launch (:data:`HOT_ROWS`): the best of three measured on the H200
(``python -m flatep.bench.decode --maxvio 0 10 20``, ``bench/results/2026-12-04-h200-h/decode-split.log``):
the busiest rank of a routed s = 128 step read its weights at 91 / 79% of the read ceiling at
Kimi-K2 maxvio 10 / 20 (87 / 69% in one launch) and 95 / 91% at Kimi-K3 (95 / 84%); uniform
groups are unchanged (97-102%)."""

def decode_launches(rows: int, groups: int, hot: GemmConfig | None = HOT_TILES) -> list[tuple[GemmConfig, tuple[int, int]]]:
    """The decode GEMM launches of a step: ``(tiles, (rows_above, rows_at_most))`` each, run one
    after another over the same operands; each launch computes only the groups holding more than
    ``rows_above`` and at most ``rows_at_most`` rows (read from the offsets on the device).

    With ``hot`` (the default :data:`HOT_TILES`): groups of at most :data:`HOT_ROWS` rows with
    :func:`decode_config`'s tiles, the rest with ``hot``'s. ``hot=None``: one launch of every group.
    """
    tiles = decode_config(rows, groups)
    if hot is None:
        return [(tiles, (0, ALL_ROWS))]
    return [(tiles, (0, HOT_ROWS)), (hot, (HOT_ROWS, ALL_ROWS))]


def decode_config(rows: int, groups: int) -> GemmConfig:
    """Tiles for ``rows`` shard rows over ``groups`` groups: row tiles no taller than a group's
    average, the product transposed (``swap_ab``) and a deep pipeline, as weight streaming wants."""
    per_group = max(1, rows // max(groups, 1))
    block_m = 16 if per_group <= 16 else 32 if per_group <= 32 else 64
    return GemmConfig(block_m, 64, 128, num_warps=4, num_stages=4, group_m=8, swap_ab=True)


@triton.jit
def _decode_kernel(
    a_ptr, w_ptr, slot_ptr, weight_ptr, out_ptr, offsets_ptr, groups, split, split_start, N, stride_am, stride_wg,
    stride_sg, stride_wn, stride_om, rows_above, rows_at_most,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUPS: tl.constexpr, SWAP_AB: tl.constexpr, GATED: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Groups ``[0, split)`` read ``w``, groups ``[split, groups)`` read ``slot`` from row ``split_start``;
    only groups of more than ``rows_above`` and at most ``rows_at_most`` rows get tiles."""
    starts, ends, tiles, passed, total = tile_table(offsets_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                                    BLOCK_M, BLOCK_N, GROUPS)
    tile = tl.program_id(0)
    while tile < total:
        group, first, last, first_column = locate_tile(tile, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N, GROUP_M, GROUPS)
        # A group's weights exceed 2**31 elements at real sizes: offsets in int64.
        if group < split:
            w_group = w_ptr + group.to(tl.int64) * stride_wg
        else:
            w_group = slot_ptr + (group - split).to(tl.int64) * stride_sg
        _decode_tile(a_ptr, w_group, weight_ptr, out_ptr, first, last, first_column, N, stride_am, stride_wn, stride_om,
                     K, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GATED, INTERPRET)
        tile += tl.num_programs(0)


@triton.jit
def _decode_tile(
    a_ptr, w_group, weight_ptr, out_ptr, first, last, first_column, N, stride_am, stride_wn, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    GATED: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Rows ``[first, min(first + BLOCK_M, last))`` times columns ``[first_column, + BLOCK_N)`` of
    the group whose weights start at ``w_group``."""
    row = first + tl.arange(0, BLOCK_M)
    row_mask = row < last
    column = first_column + tl.arange(0, BLOCK_N)
    column_mask = column < N
    inner = tl.arange(0, BLOCK_K)
    a_tile = a_ptr + row.to(tl.int64)[:, None] * stride_am + inner[None, :]
    w_tile = w_group + column.to(tl.int64)[:, None] * stride_wn + inner[None, :]
    up_tile = w_tile + N * stride_wn  # GATED: the up rows follow the I gate rows
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros_like(acc)
    for k in range(0, K, BLOCK_K):
        inner_mask = (k + inner < K)[None, :]
        a = tl.load(a_tile + k, mask=row_mask[:, None] & inner_mask, other=0.0)
        w = tl.load(w_tile + k, mask=column_mask[:, None] & inner_mask, other=0.0)
        acc += tile_dot(a, w, SWAP_AB, INTERPRET)
        if GATED:
            u = tl.load(up_tile + k, mask=column_mask[:, None] & inner_mask, other=0.0)
            acc_up += tile_dot(a, u, SWAP_AB, INTERPRET)
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_up = tl.trans(acc_up)
    if GATED:
        # The unfused path rounds the gate/up GEMM's output to bf16 before the activation: so here.
        gate = round_to_bf16(acc)
        up = round_to_bf16(acc_up)
        # NaN and +-inf route weights propagate into the row, as in a dense MoE.
        route_weight = tl.load(weight_ptr + row, mask=row_mask, other=0.0).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up * route_weight[:, None]
    if INTERPRET:
        acc = round_to_bf16(acc)
    out = out_ptr + row.to(tl.int64)[:, None] * stride_om + column[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


def _check(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, slots: torch.Tensor | None, slot_base: int) -> None:
    check_rows(rows)
    if weights.dim() != 3 or weights.dtype != torch.bfloat16 or weights.stride(2) != 1 or weights.shape[2] != rows.shape[1]:
        raise ValueError(f"weights must be [G, N, K={rows.shape[1]}] bfloat16 with unit stride along K, got "
                         f"{weights.dtype} {list(weights.shape)} strides {weights.stride()}")
    groups = weights.shape[0]
    if slots is not None:
        if (slots.dim() != 3 or slots.dtype != torch.bfloat16 or slots.shape[1:] != weights.shape[1:]
                or slots.stride()[1:] != weights.stride()[1:] or slots.device != weights.device):
            raise ValueError(f"slots must be [G2, {weights.shape[1]}, {weights.shape[2]}] bfloat16 on {weights.device} "
                             f"with the weights' strides {weights.stride()[1:]} along N and K, got {slots.dtype} "
                             f"{list(slots.shape)} strides {slots.stride()} on {slots.device}")
        groups += slots.shape[0]
    check_split(rows, offsets, groups, slot_base if slots is not None else None)


def _launch(rows, weights, slots, slot_base, route_weights, out, offsets, columns, config, gated, group_rows) -> torch.Tensor:
    split, inner = weights.shape[0], rows.shape[1]
    groups = offsets.shape[0]
    rows_above, rows_at_most = check_group_rows(group_rows)
    config = config or decode_config(rows.shape[0], groups)
    for option, format in (("rescale", "fp8"), ("lane_words", "mxfp4")):
        if getattr(config, option):
            raise ValueError(f"{option} is an {format} tile option, not one of the bf16 decode kernels, got {config}")
    out = output_for(rows, columns, out)
    if rows.shape[0] == 0:
        return out
    slots = weights if slots is None else slots
    _decode_kernel[persistent_grid(rows.shape[0], groups, columns, config, rows.device)](
        rows, weights, slots, route_weights, out, offsets, groups, split, slot_base, columns, rows.stride(0),
        weights.stride(0), slots.stride(0), weights.stride(1), out.stride(0), rows_above, rows_at_most, inner,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GROUPS=triton.next_power_of_2(groups), SWAP_AB=config.swap_ab, GATED=gated, INTERPRET=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out


def grouped_mm_triton(
    rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor, config: GemmConfig | None = None,
    out: torch.Tensor | None = None, *, slots: torch.Tensor | None = None, slot_base: int = 0,
    group_rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out[i] = rows[i] @ weights[g(i)].T``, as ``torch._grouped_mm(rows, weights.mT, offs=offsets)``.

    Args:
        rows: ``[M, K]`` bf16 (unit column stride).
        weights: ``[G, N, K]`` bf16, unit stride along ``K`` (e.g. an expert slice of ``w2 [E, H, I]``).
        offsets: ``[G]`` int32 inclusive end row of each group (``[G + G2]`` with ``slots``).
        config: tiles (default :func:`decode_config`).
        out: optional ``[M, N]`` bf16 (unit column stride) to write into.
        slots: optional second set of ``[G2, N, K]`` weights (same strides along ``N`` and ``K``)
            for groups ``G .. G+G2-1``, whose rows start at row ``slot_base`` rather than at
            ``offsets[G-1]``: a layer's home experts and the borrow slots in one launch.
        slot_base: first row of group ``G`` (with ``slots``).
        group_rows: ``(rows_above, rows_at_most)``: compute only the groups holding more than
            ``rows_above`` and at most ``rows_at_most`` rows (None: every group); see
            :func:`decode_launches`.

    Returns:
        ``out`` or a new ``[M, N]`` bf16 tensor; only the computed groups' rows are written.
    """
    _check(rows, weights, offsets, slots, slot_base)
    return _launch(rows, weights, slots, slot_base, offsets, out, offsets, weights.shape[1], config, gated=False,
                   group_rows=group_rows)


def gate_up_swiglu_triton(
    rows: torch.Tensor, w13: torch.Tensor, route_weights: torch.Tensor, offsets: torch.Tensor,
    config: GemmConfig | None = None, out: torch.Tensor | None = None, *, slots: torch.Tensor | None = None,
    slot_base: int = 0, group_rows: tuple[int, int] | None = None,
) -> torch.Tensor:
    """``out[i] = silu(gate_i) * up_i * route_weights[i]`` with ``[gate_i, up_i] = rows[i] @ w13[g(i)].T``.

    Args:
        rows: ``[M, H]`` bf16 (unit column stride).
        w13: ``[G, 2I, H]`` bf16: each expert's ``I`` gate rows then its ``I`` up rows, unit stride along ``H``.
        route_weights: ``[M]`` fp32 (contiguous) route weight of each row.
        offsets: ``[G]`` int32 inclusive end row of each group (``[G + G2]`` with ``slots``).
        config: tiles (default :func:`decode_config`).
        out: optional ``[M, I]`` bf16 (unit column stride) to write into.
        slots, slot_base: a second set of ``[G2, 2I, H]`` weights whose groups start at row
            ``slot_base`` (see :func:`grouped_mm_triton`).
        group_rows: compute only the groups of more than ``group_rows[0]`` and at most
            ``group_rows[1]`` rows (see :func:`grouped_mm_triton`).

    Returns:
        ``out`` or a new ``[M, I]`` bf16 tensor; only the computed groups' rows are written.
    """
    _check(rows, w13, offsets, slots, slot_base)
    if w13.shape[1] % 2:
        raise ValueError(f"w13 must hold 2I rows per expert (gate then up), got {w13.shape[1]}")
    if route_weights.shape != (rows.shape[0],) or route_weights.dtype != torch.float32 or not route_weights.is_contiguous():
        raise ValueError(f"route_weights must be a contiguous [{rows.shape[0]}] float32 tensor, got "
                         f"{route_weights.dtype} {list(route_weights.shape)}")
    return _launch(rows, w13, slots, slot_base, route_weights, out, offsets, w13.shape[1] // 2, config, gated=True,
                   group_rows=group_rows)


def decode_swiglu(
    rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, route_weights: torch.Tensor, offsets: torch.Tensor,
    launches: list[tuple[GemmConfig, tuple[int, int] | None]], activated: torch.Tensor, out: torch.Tensor, *,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None, slot_base: int = 0,
) -> torch.Tensor:
    """One rank's experts at decode sizes: :func:`gate_up_swiglu_triton` into ``activated [M, I]``
    in every launch of ``launches`` (:func:`decode_launches`), then :func:`grouped_mm_triton` into
    ``out [M, H]`` the same way; ``slots=(w13, w2)`` and ``slot_base`` as for those. Returns ``out``."""
    slot_w13, slot_w2 = (None, None) if slots is None else slots
    for tiles, group_rows in launches:
        gate_up_swiglu_triton(rows, w13, route_weights, offsets, tiles, out=activated, slots=slot_w13,
                              slot_base=slot_base, group_rows=group_rows)
    for tiles, group_rows in launches:
        grouped_mm_triton(activated, w2, offsets, tiles, out=out, slots=slot_w2, slot_base=slot_base,
                          group_rows=group_rows)
    return out
