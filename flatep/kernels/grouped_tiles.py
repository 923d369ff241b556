"""The tile numbering of FlatEP's persistent grouped GEMMs (see :mod:`flatep.kernels.quant_gemm`).

A launch's tiles are numbered group by group: all of group 0's (row tile, column block) tiles, then
group 1's, and so on; within a group, bands of ``GROUP_M`` row tiles take the column blocks in
turn, row tiles fastest. :func:`tile_table` and :func:`locate_tile` read the groups' ends from ``offsets`` on the device
and find a tile's group with reductions over the groups; :func:`row_tile_table` writes, once per
launch, a table from which :func:`row_tile_entry` and :func:`listed_tile` find it with a few
scalar loads instead (for loops that Triton's warp specialization partitions, which take no
reduction; the loads of the next tile's entry can then be issued a tile ahead).
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
    """Per group (vectors over ``GROUPS`` = ``groups`` rounded up to a power of two): first row,
    end row, row tiles and their running sum; and the launch's tiles in all (row tiles times
    column blocks), read from the offsets on the device. Group ``split`` (if ``< groups``) starts
    at row ``split_start`` instead of the previous group's end (a second run of groups). Only
    groups of more than ``rows_above`` and at most ``rows_at_most`` rows get tiles (a launch of
    a step's hot groups, or of the others: :func:`packed_launches`)."""
    g = tl.arange(0, GROUPS)
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
    """``(group, first_row, end_row, first_column)`` of tile ``tile < total`` (see :func:`tile_table`).

    Group ``g`` owns tiles ``[base_g, base_g + tiles_g) * column_blocks``, so ``tile //
    column_blocks`` finds the group; within the group, bands of ``GROUP_M`` row tiles (the last band
    may be shorter) each take all column blocks, row tiles fastest.
    """
    column_blocks = tl.cdiv(N, BLOCK_N)
    g = tl.arange(0, GROUPS)
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


ROW_TILE_FIELDS = tl.constexpr(5)
"""int32 fields of a :func:`row_tile_table` entry: group, the group's first row, its end row, its
first row tile's index in the launch, and its row tiles."""


@triton.jit
def _row_tile_kernel(
    offsets_ptr, table_ptr, groups, split, split_start, rows_above, rows_at_most, capacity,
    BLOCK_M: tl.constexpr, GROUPS: tl.constexpr, BLOCK_R: tl.constexpr,
):
    # Program p: entries [p * BLOCK_R, + BLOCK_R) of the launch's row tiles (numbered as tile_table
    # numbers them, group by group); entries past the launch's row tiles are not written.
    starts, ends, tiles, passed, row_tiles = tile_table(offsets_ptr, groups, split, split_start, 1, rows_above,
                                                        rows_at_most, BLOCK_M, 1, GROUPS)
    row_tile = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    group = tl.sum((passed[None, :] <= row_tile[:, None]).to(tl.int32), axis=1)
    mine = tl.arange(0, GROUPS)[None, :] == group[:, None]
    valid = (row_tile < row_tiles) & (row_tile < capacity)
    entry = table_ptr + row_tile * ROW_TILE_FIELDS
    tl.store(entry, group, mask=valid)
    tl.store(entry + 1, tl.sum(tl.where(mine, starts[None, :], 0), axis=1), mask=valid)
    tl.store(entry + 2, tl.sum(tl.where(mine, ends[None, :], 0), axis=1), mask=valid)
    tl.store(entry + 3, tl.sum(tl.where(mine, (passed - tiles)[None, :], 0), axis=1), mask=valid)
    tl.store(entry + 4, tl.sum(tl.where(mine, tiles[None, :], 0), axis=1), mask=valid)


def row_tile_table(
    offsets: torch.Tensor, rows: int, block_m: int, split: int, split_start: int, rows_above: int, rows_at_most: int,
) -> torch.Tensor:
    """The row tiles of a grouped launch over ``offsets`` (``[G]`` int32 on the device; group
    ``split`` starts at row ``split_start``; only groups of more than ``rows_above`` and at most
    ``rows_at_most`` rows), read on the device: ``[capacity, ROW_TILE_FIELDS]`` int32, row tile
    ``r`` of the launch at entry ``r`` (see :data:`ROW_TILE_FIELDS`), ``capacity`` the bound on any
    grouping's row tiles of ``rows`` rows (:func:`persistent_grid`); later entries undefined."""
    groups = offsets.shape[0]
    capacity = max(1, (rows + groups * (block_m - 1)) // block_m)
    table = torch.empty(capacity, ROW_TILE_FIELDS.value, dtype=torch.int32, device=offsets.device)
    block_r = 64
    _row_tile_kernel[(triton.cdiv(capacity, block_r),)](
        offsets, table, groups, split, split_start, rows_above, rows_at_most, capacity,
        BLOCK_M=block_m, GROUPS=triton.next_power_of_2(groups), BLOCK_R=block_r,
    )
    return table


@triton.jit
def row_tile_entry(table_ptr, tile, N, BLOCK_N: tl.constexpr):
    """The :func:`row_tile_table` entry of tile ``tile``'s group (five int32 scalars). Group ``g``'s
    tiles are ``[base_g, base_g + tiles_g) * column_blocks``, so ``tile // column_blocks`` is one
    of its row tiles, whose entry holds it."""
    entry = table_ptr + (tile // tl.cdiv(N, BLOCK_N)) * ROW_TILE_FIELDS
    return tl.load(entry), tl.load(entry + 1), tl.load(entry + 2), tl.load(entry + 3), tl.load(entry + 4)


@triton.jit
def listed_tile(tile, group, start, end, base, count, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr):
    """:func:`locate_tile` from tile ``tile``'s :func:`row_tile_entry` (``group, start, end, base,
    count``): ``(group, first_row, end_row, first_column)``, with scalar arithmetic only."""
    column_blocks = tl.cdiv(N, BLOCK_N)
    local = tile - base * column_blocks
    band = local // (GROUP_M * column_blocks)
    band_tiles = tl.minimum(count - band * GROUP_M, GROUP_M)
    within = local - band * GROUP_M * column_blocks
    return group, start + (band * GROUP_M + within % band_tiles) * BLOCK_M, end, (within // band_tiles) * BLOCK_N
