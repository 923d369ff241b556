"""Dispatch: every token row goes straight to its final row of the destination shard.

A work item is ``BLOCK_T`` tokens of one source rank: its program loads each ``BLOCK_H`` chunk of
their rows once and stores it to the ``K`` destination rows (zero copy: no permute before or
after), and writes each entry's fp32 route weight beside its row. The grid is 1-D and its programs
walk the work items with a grid-stride loop, so a grid capped below the item count (``programs``)
computes exactly what an uncapped one does.

No work on padding: the rows that pad each expert group to a multiple of ``align`` (and their
route weights) are never written; they keep whatever the buffer held, NaN included. No consumer
needs them zeroed: the grouped GEMMs and the row-wise expert steps compute every row on its own
(a padding row's values reach only that row's output), combine reads only rows that entries
point at, and the backward (:mod:`flatep.backward`) computes its weight gradients over each
group's real rows only.
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


def dispatch_grid(ranks_here: int, tokens: int, block_t: int = 2, programs: int | None = None) -> tuple[int]:
    """Grid of the dispatch kernel: 1-D (see :func:`comm_grid`).

    Args:
        ranks_here: ranks this process drives; tokens: ``s``; block_t: tokens per item.
        programs: cap on the grid (``None``: one program per item).

    Raises:
        ValueError: if the launch would exceed the kernel's work-item limit.
    """
    return comm_grid(ranks_here * triton.cdiv(tokens, block_t), programs, "token blocks")


def dispatch_triton(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    shard: torch.Tensor,
    shard_weights: torch.Tensor,
    shard_peers: torch.Tensor,
    weight_peers: torch.Tensor,
    block_t: int = 2,
    block_h: int | None = None,
    num_warps: int = 8,
    programs: int | None = None,
) -> None:
    """Scatter token rows and route weights into the shards (padding rows are left unwritten).

    Args:
        x: ``[n, s, H]`` rows of the ``n`` ranks this process drives (bf16 or fp32, contiguous).
        route_weights: ``[n, s, K]`` fp32.
        dest_rank, dest_row: ``[n, s, K]`` int32 from the plan (``-1`` = padded entry).
        shard: base of this process's shard buffer (``[.., rows, H]``, dtype of ``x``).
        shard_weights: base of this process's route-weight buffer (``[.., rows]`` fp32).
        shard_peers, weight_peers: ``[R] int64`` element offsets of every rank's copy of ``shard``
            and ``shard_weights`` from those bases (the transport's peer table).
        block_t, block_h, num_warps: tokens and columns per program step, warps per program
            (tuning; see ``python -m flatep.bench.kernels``; on the H200 every setting with
            ``block_t <= 8`` lies within 5% of the best, and the defaults are among the best).
        programs: at most this many programs (``None``: one per work item), to leave SMs to work
            running beside dispatch; results do not depend on it.

    Raises:
        ValueError: for a launch beyond the kernel's limits (:func:`dispatch_grid`), before it runs.
    """
    ranks_here, tokens, hidden = x.shape
    top_k = dest_rank.shape[-1]
    grid = dispatch_grid(ranks_here, tokens, block_t, programs)
    block_h = block_h or column_block(hidden, x.element_size())
    _dispatch_kernel[grid](
        x, route_weights, dest_rank, dest_row, shard, shard_weights, shard_peers, weight_peers,
        tokens, triton.cdiv(tokens, block_t), ranks_here * triton.cdiv(tokens, block_t), tokens * hidden, tokens * top_k,
        H=hidden, K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
    )


def dispatch_torch(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    shards: torch.Tensor,
    shard_weights: torch.Tensor,
) -> None:
    """Plain-torch dispatch on stacked shards (virtual ranks): the check for the Triton kernel.

    Args:
        x: ``[R, s, H]``; route_weights, dest_rank, dest_row: ``[R, s, K]``.
        shards: ``[R, rows, H]``; shard_weights: ``[R, rows]`` fp32. Written in place, planned rows only.
    """
    valid = dest_rank >= 0
    top_k = dest_rank.shape[-1]
    rows = x.unsqueeze(2).expand(-1, -1, top_k, -1)[valid]
    index = (dest_rank[valid].long(), dest_row[valid].long())
    shards.index_put_(index, rows)
    shard_weights.index_put_(index, route_weights[valid].float())
