"""The tile numbering of FlatEP's persistent grouped GEMMs (see :mod:`flatep.kernels.quant_gemm`).

A launch's tiles are numbered group by group: all of group 0's (row tile, column block) tiles, then
group 1's, and so on; within a group, bands of ``GROUP_M`` row tiles take the column blocks in
turn, row tiles fastest. :func:`tile_table` and :func:`locate_tile` read the groups' ends from
``offsets`` on the device and find a tile's group with reductions over the groups.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import resident_programs

if TYPE_CHECKING:
    from flatep.kernels.quant_gemm import GemmConfig


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
    a step's hot groups, or of the others: :func:`packed_launches`)."""
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

