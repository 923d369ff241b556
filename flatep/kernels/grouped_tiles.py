"""The tiles of FlatEP's persistent grouped GEMMs (:mod:`flatep.kernels.quant_gemm`,
:mod:`flatep.kernels.decode_gemm`): their numbering, and the K step's dot and the store that every
tile shares (:func:`tile_dot`, :func:`store_tile`).

A launch's tiles are numbered group by group: all of group 0's (row tile, column block) tiles, then
group 1's, and so on, so that the programs running together share one group's activations and
weights in L2 (with the row tiles of every group in the fastest dimension, each column block
streamed all groups' activations from memory again). Within a group, bands of ``GROUP_M`` row tiles
take the column blocks in turn, row tiles fastest: the band's rows stay in L2 across its column
blocks and each weight tile is read by the band's row tiles back to back. :func:`tile_table` and
:func:`locate_tile` read the groups' ends from ``offsets`` on the device and find a tile's group
with reductions over the groups.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import resident_programs, round_to_bf16

if TYPE_CHECKING:
    from flatep.kernels.packed_tiles import GemmConfig


@triton.jit
def tile_table(
    offsets_ptr, groups, split, split_start, N, rows_above, rows_at_most,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr,
):
    """:func:`group_tiles` over ``g = arange(0, GROUPS)``, ``GROUPS`` = ``groups`` rounded up to a power of two."""
    return group_tiles(offsets_ptr, tl.arange(0, GROUPS), groups, split, split_start, N, rows_above, rows_at_most,
                       BLOCK_M, BLOCK_N)


@triton.jit
def group_tiles(
    offsets_ptr, g, groups, split, split_start, N, rows_above, rows_at_most, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Per group (vectors over ``g``, the group indices ``0 .. GROUPS - 1``, made by the caller: a
    Gluon kernel's ``arange`` takes a layout, and it calls this as it is): first row, end row, row
    tiles and their running sum; and the launch's tiles in all (row tiles times column blocks), read
    from the offsets on the device. Group ``split`` (if ``< groups``) starts
    at row ``split_start`` instead of the previous group's end (a second run of groups). Only
    groups of more than ``rows_above`` and at most ``rows_at_most`` rows get tiles (a launch of
    a step's hot groups, or of the others: :func:`flatep.kernels.packed_tiles.packed_launches`)."""
    real = g < groups
    ends = tl.load(offsets_ptr + g, mask=real, other=0)
    starts = tl.load(offsets_ptr + g - 1, mask=real & (g > 0), other=0)
    starts = tl.where(g == split, split_start, starts)
    group_rows = tl.maximum(ends - starts, 0)
    taken = real & (group_rows > rows_above) & (group_rows <= rows_at_most)
    tiles = tl.where(taken, (group_rows + BLOCK_M - 1) // BLOCK_M, 0)
    return starts, ends, tiles, tl.cumsum(tiles, axis=0), tl.sum(tiles, axis=0) * tl.cdiv(N, BLOCK_N)


@triton.jit
def locate_tile(
    tile, starts, ends, tiles, passed, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr,
):
    """:func:`find_tile` over ``g = arange(0, GROUPS)``."""
    return find_tile(tile, tl.arange(0, GROUPS), starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def find_tile(
    tile, g, starts, ends, tiles, passed, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``(group, first_row, end_row, first_column)`` of tile ``tile < total`` (see :func:`group_tiles`,
    whose ``g`` it takes too).

    Group ``g`` owns tiles ``[base_g, base_g + tiles_g) * column_blocks``, so ``tile //
    column_blocks`` finds the group; within the group, bands of ``GROUP_M`` row tiles (the last band
    may be shorter) each take all column blocks, row tiles fastest.
    """
    column_blocks = tl.cdiv(N, BLOCK_N)
    group = tl.sum((passed <= tile // column_blocks).to(tl.int32), axis=0)
    mine = g == group
    count = tl.sum(tl.where(mine, tiles, 0), axis=0)
    local = tile - tl.sum(tl.where(mine, passed - tiles, 0), axis=0) * column_blocks
    band = local // (GROUP_M * column_blocks)
    band_tiles = tl.minimum(count - band * GROUP_M, GROUP_M)
    within = local - band * GROUP_M * column_blocks
    first = tl.sum(tl.where(mine, starts, 0), axis=0) + (band * GROUP_M + within % band_tiles) * BLOCK_M
    last = tl.sum(tl.where(mine, ends, 0), axis=0)
    return group, first, last, (within // band_tiles) * BLOCK_N


def persistent_grid(rows: int, groups: int, columns: int, config: GemmConfig, device: torch.device) -> tuple[int]:
    """Programs of a grouped GEMM launch: each loops over tiles ``program, program + P, ...`` below
    the tiles the offsets hold (read on the device), so the launch costs nothing per row of the
    buffer that holds no rows (a layer's shard is sized for the step's worst case, often tens of
    times its rows). ``P`` is the fewer of an upper bound on any grouping's tiles (group ``g`` of
    ``r_g`` rows has at most ``(r_g + block_m - 1) / block_m`` row tiles: ``(rows + groups *
    (block_m - 1)) / block_m`` in all, times the column blocks) and ``config.programs_per_sm`` programs per SM."""
    row_tiles = (rows + groups * (config.block_m - 1)) // config.block_m
    programs = resident_programs(device, config.programs_per_sm)
    return (max(1, min(row_tiles * triton.cdiv(columns, config.block_n), programs)),)


@triton.jit
def tile_dot(a, w, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr, acc=None):
    """One K step of a row tile ``a [BLOCK_M, BLOCK_K]`` and a weight tile ``w [BLOCK_N, BLOCK_K]``:
    ``w @ a.T`` (``[BLOCK_N, BLOCK_M]``) with ``SWAP_AB``, else ``a @ w.T``, in fp32, added to
    ``acc`` if given (by the MMA itself); the operands are upcast to fp32 first under the interpreter."""
    if INTERPRET:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP_AB:
        product = tl.dot(w, tl.trans(a), acc)
    else:
        product = tl.dot(a, tl.trans(w), acc)
    return product


@triton.jit
def store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB: tl.constexpr,
                INTERPRET: tl.constexpr):
    """A tile's fp32 product into ``out`` (``[BLOCK_M, BLOCK_N]``, or its transpose with ``SWAP_AB``)
    at ``row`` and ``column``, masked to both; rounded to bf16's grid first under the interpreter, whose
    cast truncates."""
    if SWAP_AB:
        acc = tl.trans(acc)
    if INTERPRET:
        acc = round_to_bf16(acc)
    out = out_ptr + row.to(tl.int64)[:, None] * stride_om + column[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])
