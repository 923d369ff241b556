"""An fp8 block-scaled grouped GEMM with TMA loads and warp specialization, for prefill shards.

Same contract and arithmetic as :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton` (which calls
it for a :class:`~flatep.kernels.quant_gemm.GemmConfig` with ``warp_specialize=True``): e4m3 row
tiles times e4m3 weight tiles per 128-wide K step, each step's product scaled by its rows'
activation scales and its weight block's scale, added in fp32.

On Hopper each K step of the plain kernel waits for its warp-group MMA before it scales the product
(the scale is applied between MMAs), and a program's warps run the loads, the MMA and the scaling
in turn. Here Triton's warp specialization (``tl.range(..., warp_specialize=True)``, Triton 3.6 and
later on sm_90) splits each program into a producer warp group, which copies the row and weight
tiles into a ring of shared-memory stages with TMA, and two consumer warp groups, 64 rows of the
128-row tile each, which synchronise with the producer only through the stages' barriers: while one
consumer scales its product, the other's MMA runs. The persistent loop runs over tiles of all
groups, so the producer fills the next tile's stages while the consumers finish the current one.

Triton's Hopper warp specialization (3.6) takes simple loops only: no reduction in the partitioned
loop nest, and one dot a K step. A tile's group therefore comes from a row-tile table written by a
small launch first (:func:`flatep.kernels.grouped_tiles.row_tile_table`: scalar loads, no
reduction over the groups), each tile's entry loaded a tile ahead by the persistent loop (scalars
carried by the outer loop are the one carried values the specialization takes), and a layer's
borrow slots, whose weights are another tensor, run in a second launch over the same table. The
step's scales are loaded by the consumers before they wait for the step's tiles, and used after the
MMA, so their latency runs beside the MMA. The tensor descriptors are made in the kernel (their box
then follows the consumers' split), which takes 128 bytes of global scratch a program: Triton asks
the allocator set with ``triton.set_allocator`` for it, and FlatEP sets a torch one where none is
set.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation

from flatep.kernels.backend import interpreting, round_to_bf16
from flatep.kernels.grouped_tiles import listed_tile, persistent_grid, row_tile_entry, row_tile_table, tile_table

if TYPE_CHECKING:
    from flatep.kernels.quant_gemm import GemmConfig

TMA_ALIGNMENT = 16
"""Bytes: TMA takes a global base address and row strides in multiples of 16."""


@triton.jit
def _ws_tile(
    a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, tile, entry_group, entry_start, entry_end, entry_base,
    entry_count, split, N, stride_as, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SLOTS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Tile ``tile`` of the launch, its row-tile entry given (see :func:`_fp8_ws_kernel`)."""
    group, first, last, first_column = listed_tile(tile, entry_group, entry_start, entry_end, entry_base, entry_count,
                                                   N, BLOCK_M, BLOCK_N, GROUP_M)
    expert = group
    if SLOTS:
        expert = group - split
    k_blocks: tl.constexpr = K // BLOCK_K
    row = first + tl.arange(0, BLOCK_M)
    row_mask = row < last
    column = first_column + tl.arange(0, BLOCK_N)
    a_scales = a_scale_ptr + row.to(tl.int64) * stride_as
    # block_n divides 128: the tile's columns share one weight scale block (one scalar a step).
    w_scales = (w_scale_ptr + expert.to(tl.int64) * tl.cdiv(N, BLOCK_K) * k_blocks
                + (first_column // BLOCK_K) * k_blocks)
    # Rows of the tile past the group's end are the next group's (or zeros past the tensor): read,
    # never written. Columns past N are the next expert's rows of the weights, likewise.
    weight_row = expert * N + first_column
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in tl.range(0, k_blocks, warp_specialize=True):
        a = a_desc.load([first, step * BLOCK_K])
        w = w_desc.load([weight_row, step * BLOCK_K])
        if INTERPRET:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        scale = tl.load(a_scales + step, mask=row_mask, other=1.0) * tl.load(w_scales + step)
        acc += tl.dot(a, tl.trans(w)) * scale[:, None]
    if INTERPRET:
        acc = round_to_bf16(acc)
    out = out_ptr + row.to(tl.int64)[:, None] * stride_om + column[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & (column < N)[None, :])


@triton.jit
def _fp8_ws_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, table_ptr, offsets_ptr, groups, split, split_start, rows_above,
    rows_at_most, rows, experts, N, stride_am, stride_as, stride_om,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUPS: tl.constexpr, SLOTS: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The launch's tiles of groups ``[0, split)`` (``w``), or with ``SLOTS`` of groups ``[split,
    groups)`` (``w`` then the slots' weights): tiles are numbered over all groups, home groups
    first, so each set's tiles are one run of the numbers."""
    _, _, tiles, _, total = tile_table(offsets_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                       BLOCK_M, BLOCK_N, GROUPS)
    home_tiles = tl.sum(tl.where(tl.arange(0, GROUPS) < split, tiles, 0), axis=0) * tl.cdiv(N, BLOCK_N)
    first_tile = tl.program_id(0)
    end_tile = home_tiles
    if SLOTS:
        first_tile += home_tiles
        end_tile = total
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[rows, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[experts * N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    # Each tile's row-tile entry is loaded a tile ahead (carried by the loop), so that the consumers
    # do not wait for it at the tile's start; the last tile loads its own again. The first load
    # stays inside the table even for a launch without tiles.
    step = tl.num_programs(0)
    entry = row_tile_entry(table_ptr, tl.minimum(first_tile, tl.maximum(end_tile - 1, 0)), N, BLOCK_N)
    if INTERPRET:  # Triton 3.6's interpreter takes no tensor as a range bound
        tile = first_tile
        while tile < end_tile:
            group, start, end, base, count = entry
            entry = row_tile_entry(table_ptr, tl.minimum(tile + step, end_tile - 1), N, BLOCK_N)
            _ws_tile(a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, tile, group, start, end, base, count, split, N,
                     stride_as, stride_om, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SLOTS, INTERPRET)
            tile += step
    else:
        for tile in tl.range(first_tile, end_tile, step):
            group, start, end, base, count = entry
            entry = row_tile_entry(table_ptr, tl.minimum(tile + step, end_tile - 1), N, BLOCK_N)
            _ws_tile(a_desc, a_scale_ptr, w_desc, w_scale_ptr, out_ptr, tile, group, start, end, base, count, split, N,
                     stride_as, stride_om, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SLOTS, INTERPRET)


def _torch_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_scratch_allocator() -> None:
    """In-kernel tensor descriptors live in global scratch that Triton asks its allocator for at
    launch; install a torch one unless the caller has set their own."""
    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)


def check_tma_operand(tensor: torch.Tensor, name: str) -> None:
    """Raise unless ``tensor`` (fp8, unit last stride) can be read by TMA: base address and row
    stride multiples of :data:`TMA_ALIGNMENT` bytes."""
    row_stride = tensor.stride(-2) * tensor.element_size()
    if tensor.data_ptr() % TMA_ALIGNMENT or row_stride % TMA_ALIGNMENT or tensor.stride(-1) != 1:
        raise ValueError(f"{name} must start at a multiple of {TMA_ALIGNMENT} bytes with rows {TMA_ALIGNMENT}-byte "
                         f"aligned and unit column stride for warp_specialize tiles (TMA), got address "
                         f"{tensor.data_ptr()} and strides {tensor.stride()}")


def fp8_grouped_mm_ws(
    quantized: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor] | None, slot_base: int, offsets: torch.Tensor, out: torch.Tensor,
    group_rows: tuple[int, int], config: GemmConfig,
) -> None:
    """Launch the warp-specialized fp8 GEMM into ``out`` (arguments checked by the caller,
    :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton`): one launch writes the row-tile
    table, one the home groups' tiles, and with ``slots`` one the slots' tiles.

    Args:
        quantized, row_scales: ``[M, K]`` float8_e4m3fn rows and their ``[M, K/128]`` float32 scales.
        values, scales: ``[G, N, K]`` float8_e4m3fn and ``[G, ceil(N/128), K/128]`` float32.
        slots: ``(values [G2, N, K], scales [G2, ...])`` for groups ``G ..``, starting at row ``slot_base``.
        offsets: ``[G (+ G2)]`` int32 inclusive end rows; out: ``[M, N]`` bf16.
        group_rows: ``(rows_above, rows_at_most)``; config: a ``GemmConfig`` with ``warp_specialize``.
    """
    capability = torch.cuda.get_device_capability(quantized.device) if quantized.is_cuda else None
    if capability is not None and capability[0] < 9:
        raise ValueError(f"warp_specialize tiles need TMA and warp-group MMAs (sm_90 or later), got "
                         f"sm_{capability[0]}{capability[1]}")
    check_tma_operand(quantized, "activations")
    sets = [(values, scales, False)] + ([(*slots, True)] if slots is not None else [])
    for weights, _, _ in sets:
        check_tma_operand(weights, "weight values")
    if quantized.is_cuda:
        _ensure_scratch_allocator()
    rows, inner = quantized.shape
    columns = values.shape[1]
    groups, split = offsets.shape[0], values.shape[0]
    rows_above, rows_at_most = group_rows
    table = row_tile_table(offsets, rows, config.block_m, split, slot_base, rows_above, rows_at_most)
    grid = persistent_grid(rows, groups, columns, config, quantized.device)
    for weights, weight_scales, is_slots in sets:
        _fp8_ws_kernel[grid](
            quantized, row_scales, weights, weight_scales, out, table, offsets, groups, split, slot_base, rows_above,
            rows_at_most, rows, weights.shape[0], columns, quantized.stride(0), row_scales.stride(0), out.stride(0),
            inner, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=128, GROUP_M=config.group_m,
            GROUPS=triton.next_power_of_2(groups), SLOTS=is_slots, INTERPRET=interpreting(),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
