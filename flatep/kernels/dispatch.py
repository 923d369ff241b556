"""Dispatch: every token row goes straight to its final row of the destination shard.

A work item is ``BLOCK_T`` tokens of one source rank: its program loads each ``BLOCK_H`` chunk of
their rows once and stores it to the ``K`` destination rows (zero copy: no permute before or
after), and writes each entry's fp32 route weight beside its row. A second kernel zeroes the
padding rows (and their weights) of the shards this process owns. Both grids are 1-D and their
programs walk the work items with a grid-stride loop, so a grid capped below the item count
(``programs``) computes exactly what an uncapped one does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import column_block, comm_grid, token_block


@triton.jit
def _dispatch_kernel(
    x_ptr, weight_ptr, dest_rank_ptr, dest_row_ptr,
    shard_ptr, shard_weight_ptr, shard_peers_ptr, weight_peers_ptr,
    tokens, blocks, work, x_rank_stride, entry_rank_stride,
    H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_T tokens), all on grid axis 0 (axis 1 stops at 65,535
    # programs); a grid-stride loop lets a capped grid cover every item.
    for step in range(tl.program_id(0), work, tl.num_programs(0)):
        local, token, token_mask, entry_base = token_block(step, blocks, tokens, entry_rank_stride, K, BLOCK_T)
        for k in tl.static_range(K):
            dest = tl.load(dest_rank_ptr + entry_base + k, mask=token_mask, other=-1)
            row = tl.load(dest_row_ptr + entry_base + k, mask=token_mask, other=0)
            live = token_mask & (dest >= 0)
            target = tl.load(weight_peers_ptr + dest, mask=live, other=0) + row
            route = tl.load(weight_ptr + entry_base + k, mask=token_mask, other=0.0)
            tl.store(shard_weight_ptr + target, route, mask=live)
        x_rows = x_ptr + local * x_rank_stride + token * H
        for start in range(0, H, BLOCK_H):
            column = start + tl.arange(0, BLOCK_H)
            column_mask = column < H
            tile_mask = token_mask[:, None] & column_mask[None, :]
            tile = tl.load(x_rows[:, None] + column[None, :], mask=tile_mask)
            for k in tl.static_range(K):
                dest = tl.load(dest_rank_ptr + entry_base + k, mask=token_mask, other=-1)
                row = tl.load(dest_row_ptr + entry_base + k, mask=token_mask, other=0)
                live = token_mask & (dest >= 0)
                target = tl.load(shard_peers_ptr + dest, mask=live, other=0) + row.to(tl.int64) * H
                tl.store(shard_ptr + target[:, None] + column[None, :], tile, mask=live[:, None] & column_mask[None, :])


@triton.jit
def _zero_padding_kernel(
    shard_ptr, shard_weight_ptr, shard_peers_ptr, weight_peers_ptr, padding_ptr, first_rank, work,
    GROUPS: tl.constexpr, H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Work item = (local rank, group), grid-strided like the dispatch kernel.
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        local = item // GROUPS
        group = item - local * GROUPS
        rank = first_rank + local
        start = tl.load(padding_ptr + (rank * GROUPS + group) * 2)
        count = tl.load(padding_ptr + (rank * GROUPS + group) * 2 + 1)
        shard = shard_ptr + tl.load(shard_peers_ptr + rank)
        weights = shard_weight_ptr + tl.load(weight_peers_ptr + rank)
        first = 0
        while first < count:  # not range(0, count, ...): Triton 3.6's interpreter takes no loaded bound
            row = start + first + tl.arange(0, BLOCK_R)
            row_mask = first + tl.arange(0, BLOCK_R) < count
            tl.store(weights + row, tl.zeros([BLOCK_R], dtype=tl.float32), mask=row_mask)
            for column_start in range(0, H, BLOCK_H):
                column = column_start + tl.arange(0, BLOCK_H)
                mask = row_mask[:, None] & (column < H)[None, :]
                zeros = tl.zeros([BLOCK_R, BLOCK_H], dtype=shard_ptr.dtype.element_ty)
                tl.store(shard + row.to(tl.int64)[:, None] * H + column[None, :], zeros, mask=mask)
            first += BLOCK_R


def dispatch_grids(ranks_here: int, tokens: int, groups: int, block_t: int = 2, programs: int | None = None) -> tuple[tuple[int], tuple[int]]:
    """Grids of the dispatch and padding kernels: ``(dispatch, padding)``, each 1-D (see :func:`comm_grid`).

    Args:
        ranks_here: ranks this process drives; tokens: ``s``; groups: ``2*epn``; block_t: tokens per item.
        programs: cap on each grid (``None``: one program per item).

    Raises:
        ValueError: if a launch would exceed the kernels' work-item limit.
    """
    dispatch = comm_grid(ranks_here * triton.cdiv(tokens, block_t), programs, "token blocks")
    return dispatch, comm_grid(ranks_here * groups, programs, "padding groups")


def dispatch_triton(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    padding: torch.Tensor,
    shard: torch.Tensor,
    shard_weights: torch.Tensor,
    shard_peers: torch.Tensor,
    weight_peers: torch.Tensor,
    first_rank: int,
    block_t: int = 2,
    block_h: int | None = None,
    num_warps: int = 8,
    programs: int | None = None,
) -> None:
    """Scatter token rows and route weights into the shards; zero the owned shards' padding.

    Args:
        x: ``[n, s, H]`` rows of the ``n`` ranks this process drives (bf16 or fp32, contiguous).
        route_weights: ``[n, s, K]`` fp32.
        dest_rank, dest_row: ``[n, s, K]`` int32 from the plan (``-1`` = padded entry).
        padding: ``[R, 2*epn, 2]`` int32 ``(start, count)`` zero rows of every rank's groups.
        shard: base of this process's shard buffer (``[.., rows, H]``, dtype of ``x``).
        shard_weights: base of this process's route-weight buffer (``[.., rows]`` fp32).
        shard_peers, weight_peers: ``[R] int64`` element offsets of every rank's copy of ``shard``
            and ``shard_weights`` from those bases (the transport's peer table).
        first_rank: global rank of ``x[0]``.
        block_t, block_h, num_warps: tokens and columns per program step, warps per program
            (tuning; see ``python -m flatep.bench.kernels``; on the H200 every setting with
            ``block_t <= 8`` lies within 5% of the best, and the defaults are among the best).
        programs: at most this many programs per kernel (``None``: one per work item), to leave
            SMs to work running beside dispatch; results do not depend on it.

    Raises:
        ValueError: for a launch beyond the kernels' limits (:func:`dispatch_grids`), before any kernel runs.
    """
    ranks_here, tokens, hidden = x.shape
    top_k = dest_rank.shape[-1]
    groups = padding.shape[1]
    grid, padding_grid = dispatch_grids(ranks_here, tokens, groups, block_t, programs)
    block_h = block_h or column_block(hidden, x.element_size())
    _dispatch_kernel[grid](
        x, route_weights, dest_rank, dest_row, shard, shard_weights, shard_peers, weight_peers,
        tokens, triton.cdiv(tokens, block_t), ranks_here * triton.cdiv(tokens, block_t), tokens * hidden, tokens * top_k,
        H=hidden, K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
    )
    _zero_padding_kernel[padding_grid](
        shard, shard_weights, shard_peers, weight_peers, padding, first_rank, ranks_here * groups,
        GROUPS=groups, H=hidden, BLOCK_R=8, BLOCK_H=block_h,
    )


def dispatch_torch(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    padding: torch.Tensor,
    shards: torch.Tensor,
    shard_weights: torch.Tensor,
) -> None:
    """Plain-torch dispatch on stacked shards (virtual ranks): the check for the Triton kernel.

    Args:
        x: ``[R, s, H]``; route_weights, dest_rank, dest_row: ``[R, s, K]``.
        padding: ``[R, 2*epn, 2]``.
        shards: ``[R, rows, H]``; shard_weights: ``[R, rows]`` fp32. Written in place.
    """
    valid = dest_rank >= 0
    top_k = dest_rank.shape[-1]
    rows = x.unsqueeze(2).expand(-1, -1, top_k, -1)[valid]
    index = (dest_rank[valid].long(), dest_row[valid].long())
    shards.index_put_(index, rows)
    shard_weights.index_put_(index, route_weights[valid].float())
    ranks, row_count = shard_weights.shape
    position = torch.arange(row_count, device=shards.device).view(1, 1, -1)
    start = padding[..., 0:1].long()
    in_padding = ((position >= start) & (position < start + padding[..., 1:2].long())).any(1)  # [R, rows]
    shards.masked_fill_(in_padding.unsqueeze(-1), 0)
    shard_weights.masked_fill_(in_padding, 0)
