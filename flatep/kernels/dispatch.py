"""Dispatch: every token row goes straight to its final rows of the destination shards, once per rank.

A work item is ``BLOCK_T`` tokens of one source rank (and, in small launches, one part of their
columns: :func:`flatep.kernels.backend.column_parts`): its program loads each ``BLOCK_H`` chunk of
their rows once and stores it to the rows of the token's *carriers* (zero copy: no permute before
or after), and writes each entry's fp32 route weight beside its row. The grid is 1-D and its
programs walk the work items with a grid-stride loop, so a grid capped below the item count
(``programs``) computes exactly what an uncapped one does.

Send once per destination rank (the plan's ``carrier`` and ``send_order``, see
:class:`flatep.plan.types.Plan`): only a carrier's row crosses the link. With a deduplicating plan
(``plan.dedup``) dispatch also writes, for every entry, a *link* into the destination's
``[rows, 2]`` int32 link table: the row of its carrier and the row of the next entry of its run
(``-1`` at the end). After the barrier, each rank expands its own shard (:func:`expand_triton`):
every real row whose carrier row is another row copies it, a local copy. Combine reads the same
links to sum each run (:mod:`flatep.kernels.combine`).

No work on padding: the rows that pad each expert group to a multiple of ``align`` (and their
route weights and links) are never written; they keep whatever the buffer held, NaN included. No
consumer needs them zeroed: the grouped GEMMs and the row-wise expert steps compute every row on
its own (a padding row's values reach only that row's output), expansion and combine touch only
real rows, and the backward (:mod:`flatep.backward`) computes its weight gradients over each
group's real rows only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.config import next_pow2
from flatep.kernels.backend import column_block, column_parts, comm_grid, token_block


@triton.jit
def _dispatch_kernel(
    x_ptr, weight_ptr, dest_rank_ptr, dest_row_ptr, carrier_ptr, order_ptr,
    shard_ptr, shard_weight_ptr, links_ptr, shard_peers_ptr, weight_peers_ptr, link_peers_ptr,
    tokens, blocks, work, parts, x_rank_stride, entry_rank_stride,
    H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PART_COLUMNS: tl.constexpr,
    DEDUP: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_T tokens, column part), all on grid axis 0 (axis 1
    # stops at 65,535 programs); a grid-stride loop lets a capped grid cover every item. Part 0 also
    # writes the route weights and links.
    for step in range(tl.program_id(0), work, tl.num_programs(0)):
        part = step % parts
        local, token, token_mask, entry_base = token_block(step // parts, blocks, tokens, entry_rank_stride, K, BLOCK_T)
        first_column = part * PART_COLUMNS
        column_end = tl.minimum(first_column + PART_COLUMNS, H)
        token_mask_0 = token_mask & (token * 0 + part == 0)  # broadcast first: the interpreter's scalar compare is no mask
        for k in tl.static_range(K):
            dest = tl.load(dest_rank_ptr + entry_base + k, mask=token_mask_0, other=-1)
            row = tl.load(dest_row_ptr + entry_base + k, mask=token_mask_0, other=0)
            live = token_mask_0 & (dest >= 0)
            target = tl.load(weight_peers_ptr + dest, mask=live, other=0) + row
            route = tl.load(weight_ptr + entry_base + k, mask=token_mask_0, other=0.0)
            tl.store(shard_weight_ptr + target, route, mask=live)
        if DEDUP:
            # Walk the send order; entry i's link is stored at step i + 1, once it is known whether
            # entry i + 1 continues its run (same carrier).
            before_live = token < 0
            before_dest = tl.zeros([BLOCK_T], tl.int32)
            before_row = tl.zeros([BLOCK_T], tl.int32)
            before_carrier = tl.full([BLOCK_T], -1, tl.int32)
            head_row = tl.zeros([BLOCK_T], tl.int32)
            for i in tl.static_range(K + 1):
                if i < K:
                    entry = tl.load(order_ptr + entry_base + i, mask=token_mask_0, other=-1)
                    live = token_mask_0 & (entry >= 0)
                    dest = tl.load(dest_rank_ptr + entry_base + entry, mask=live, other=0)
                    row = tl.load(dest_row_ptr + entry_base + entry, mask=live, other=0)
                    carrier = tl.load(carrier_ptr + entry_base + entry, mask=live, other=-1)
                else:
                    live = token < 0
                    dest = before_dest
                    row = before_row
                    carrier = tl.full([BLOCK_T], -1, tl.int32)
                continues = live & (carrier == before_carrier)
                link = tl.load(link_peers_ptr + before_dest, mask=before_live, other=0) + before_row.to(tl.int64) * 2
                tl.store(links_ptr + link, head_row, mask=before_live)
                tl.store(links_ptr + link + 1, tl.where(continues, row, -1), mask=before_live)
                head_row = tl.where(continues, head_row, row)
                before_live, before_dest, before_row, before_carrier = live, dest, row, carrier
        x_rows = x_ptr + local * x_rank_stride + token * H
        for start in range(first_column, column_end, BLOCK_H):
            column = start + tl.arange(0, BLOCK_H)
            column_mask = column < column_end
            tile_mask = token_mask[:, None] & column_mask[None, :]
            tile = tl.load(x_rows[:, None] + column[None, :], mask=tile_mask)
            for k in tl.static_range(K):
                # Carriers only: the token's other entries on that rank are expanded from its row there.
                # The entry's destination and row are read whether it is a carrier or not, so that
                # the three table loads run together and the store waits on two loads, not three.
                carrier = tl.load(carrier_ptr + entry_base + k, mask=token_mask, other=-1)
                dest = tl.load(dest_rank_ptr + entry_base + k, mask=token_mask, other=-1)
                row = tl.load(dest_row_ptr + entry_base + k, mask=token_mask, other=0)
                planned = token_mask & (dest >= 0)
                live = planned & (carrier == k)
                target = tl.load(shard_peers_ptr + dest, mask=planned, other=0) + row.to(tl.int64) * H
                tl.store(shard_ptr + target[:, None] + column[None, :], tile, mask=live[:, None] & column_mask[None, :])


@triton.jit
def real_rows(row, offsets_ptr, padding_ptr, slot_base, EPN: tl.constexpr, GROUPS: tl.constexpr, BLOCK_G: tl.constexpr):
    """``[BLOCK_R] bool``: which shard rows hold an entry, from one rank's ``offsets`` and ``padding``.

    A row is real when it lies inside the rank's groups (before the home groups' end, or in
    ``[slot_base, end of the slot groups)`` of the split layout) and outside every group's padding.
    """
    group = tl.arange(0, BLOCK_G)
    in_groups = group < GROUPS
    pad_start = tl.load(padding_ptr + group * 2, mask=in_groups, other=0)
    pad_end = pad_start + tl.load(padding_ptr + group * 2 + 1, mask=in_groups, other=0)
    in_padding = tl.sum(((row[:, None] >= pad_start[None, :]) & (row[:, None] < pad_end[None, :])).to(tl.int32), axis=1) > 0
    home_end = tl.load(offsets_ptr + EPN - 1)
    end = tl.load(offsets_ptr + GROUPS - 1)
    return (row < end) & ((row < home_end) | (row >= slot_base)) & ~in_padding


@triton.jit
def row_block(item, blocks, first_rank, rows, offsets_ptr, slot_base, EPN: tl.constexpr, BLOCK_R: tl.constexpr):
    """Work item ``item`` of the receiver-side kernels.

    Returns ``(local rank, global rank, rows [BLOCK_R], inside mask, used)``, in int64: a shard's
    element offsets (``local * rows * H``) pass ``2**31`` at Kimi-K2 sizes. ``used`` (a scalar)
    says whether the block meets the rank's groups at all (see :func:`real_rows`): the buffers are
    sized for a full step, so most blocks of a small step lie past the groups' end and are skipped
    before any load.
    """
    local = (tl.full([], 0, tl.int64) + item) // blocks
    first = (item - local * blocks) * BLOCK_R
    row = first + tl.arange(0, BLOCK_R)
    rank = first_rank + local
    home_end = tl.load(offsets_ptr + rank * 2 * EPN + EPN - 1)
    end = tl.load(offsets_ptr + rank * 2 * EPN + 2 * EPN - 1)
    used = (first < end) & ((first < home_end) | (first + BLOCK_R > slot_base))
    return local, rank, row, row < rows, used


@triton.jit
def _expand_kernel(
    shard_ptr, links_ptr, offsets_ptr, padding_ptr, first_rank, rows, slot_base, blocks, work,
    H: tl.constexpr, EPN: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_R shard rows), grid-strided like dispatch.
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        local, rank, row, inside, used = row_block(item, blocks, first_rank, rows, offsets_ptr, slot_base, EPN, BLOCK_R)
        if used:
            real = inside & real_rows(row, offsets_ptr + rank * 2 * EPN, padding_ptr + rank * 4 * EPN, slot_base,
                                      EPN, 2 * EPN, BLOCK_G)
            links = links_ptr + local * rows * 2
            head = tl.load(links + row * 2, mask=real, other=0).to(tl.int64)
            copy = real & (head != row)
            shard = shard_ptr + local * rows * H
            for start in range(0, H, BLOCK_H):
                column = start + tl.arange(0, BLOCK_H)
                mask = copy[:, None] & (column < H)[None, :]
                tile = tl.load(shard + head[:, None] * H + column[None, :], mask=mask)
                tl.store(shard + row[:, None] * H + column[None, :], tile, mask=mask)


def dispatch_grid(ranks_here: int, tokens: int, block_t: int = 2, programs: int | None = None, parts: int = 1) -> tuple[int]:
    """Grid of the dispatch kernel: 1-D (see :func:`comm_grid`).

    Args:
        ranks_here: ranks this process drives; tokens: ``s``; block_t: tokens per item.
        programs: cap on the grid (``None``: one program per item).
        parts: column parts per token block (:func:`flatep.kernels.backend.column_parts`).

    Raises:
        ValueError: if the launch would exceed the kernel's work-item limit.
    """
    return comm_grid(ranks_here * triton.cdiv(tokens, block_t) * parts, programs, "token blocks")


def row_grid(ranks_here: int, rows: int, block_r: int, programs: int | None = None) -> tuple[int]:
    """Grid of the receiver-side kernels (expansion, and combine's run sums): 1-D over (rank, row block)."""
    return comm_grid(ranks_here * triton.cdiv(rows, block_r), programs, "row blocks")


def dispatch_triton(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    carrier: torch.Tensor,
    send_order: torch.Tensor,
    shard: torch.Tensor,
    shard_weights: torch.Tensor,
    links: torch.Tensor,
    shard_peers: torch.Tensor,
    weight_peers: torch.Tensor,
    link_peers: torch.Tensor,
    dedup: bool,
    block_t: int = 2,
    block_h: int | None = None,
    num_warps: int = 8,
    programs: int | None = None,
) -> None:
    """Send each carrier's row, every entry's route weight and (with ``dedup``) its link to its destination.

    Padding rows are left unwritten; with ``dedup`` the destinations must then run
    :func:`expand_triton` (after a barrier) before their shards are complete.

    Args:
        x: ``[n, s, H]`` rows of the ``n`` ranks this process drives (bf16 or fp32, contiguous).
        route_weights: ``[n, s, K]`` fp32.
        dest_rank, dest_row, carrier, send_order: ``[n, s, K]`` int32 from the plan (``-1`` = unplanned).
        shard: base of this process's shard buffer (``[.., rows, H]``, dtype of ``x``).
        shard_weights: base of this process's route-weight buffer (``[.., rows]`` fp32).
        links: base of this process's link table (``[.., rows, 2]`` int32; unused without ``dedup``).
        shard_peers, weight_peers, link_peers: ``[R] int64`` element offsets of every rank's copy of
            ``shard``, ``shard_weights`` and ``links`` from those bases (the transport's peer table).
        dedup: the plan's ``dedup`` (whether to write links).
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
    blocks = triton.cdiv(tokens, block_t)
    block_h = block_h or column_block(hidden, x.element_size())
    parts, part_chunks = column_parts(ranks_here * blocks, hidden, block_h)
    grid = dispatch_grid(ranks_here, tokens, block_t, programs, parts)
    _dispatch_kernel[grid](
        x, route_weights, dest_rank, dest_row, carrier, send_order, shard, shard_weights, links,
        shard_peers, weight_peers, link_peers,
        tokens, blocks, ranks_here * blocks * parts, parts, tokens * hidden, tokens * top_k,
        H=hidden, K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, PART_COLUMNS=part_chunks * block_h, DEDUP=dedup,
        num_warps=num_warps,
    )


def expand_triton(
    shard: torch.Tensor, links: torch.Tensor, offsets: torch.Tensor, padding: torch.Tensor, slot_base: int,
    first_rank: int, block_r: int = 4, programs: int | None = None,
) -> None:
    """Copy each carrier row into the other real rows it carries, in this process's own shards.

    Args:
        shard: ``[n, rows, H]`` (or ``[rows, H]``) this process's shards, contiguous.
        links: ``[n, rows, 2]`` (or ``[rows, 2]``) int32 link tables written by dispatch.
        offsets: ``[R, 2*epn]`` int32; padding: ``[R, 2*epn, 2]`` int32; slot_base: from the plan.
        first_rank: global rank of ``shard``'s first rank.
        block_r, programs: rows per work item; cap on the programs (results do not depend on it).
    """
    rows, hidden = shard.shape[-2:]
    ranks_here = shard.numel() // (rows * hidden)
    groups = offsets.shape[1]
    grid = row_grid(ranks_here, rows, block_r, programs)
    blocks = triton.cdiv(rows, block_r)
    _expand_kernel[grid](
        shard, links, offsets, padding, first_rank, rows, slot_base, blocks, ranks_here * blocks,
        H=hidden, EPN=groups // 2, BLOCK_G=next_pow2(groups), BLOCK_R=block_r,
        BLOCK_H=column_block(hidden, shard.element_size()),
    )


def real_rows_torch(offsets: torch.Tensor, padding: torch.Tensor, slot_base: int, rows: int) -> torch.Tensor:
    """``[n, rows] bool``: the real rows of ``n`` ranks' shards (the torch twin of :func:`real_rows`).

    Args:
        offsets: ``[n, 2*epn]`` int32; padding: ``[n, 2*epn, 2]`` int32 (those ranks' rows of the plan's tables).
    """
    epn = offsets.shape[1] // 2
    row = torch.arange(rows, device=offsets.device).view(1, -1)
    start, count = padding[..., 0:1].long(), padding[..., 1:2].long()
    in_padding = ((row.unsqueeze(1) >= start) & (row.unsqueeze(1) < start + count)).any(1)
    inside = (row < offsets[:, -1:].long()) & ((row < offsets[:, epn - 1 : epn].long()) | (row >= slot_base))
    return inside & ~in_padding


def link_values(
    dest_row: torch.Tensor, carrier: torch.Tensor, send_order: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry's link: ``(head, next)``, each ``[..., K]`` int64, the rows dispatch writes.

    ``head``: the row of the entry's carrier; ``next``: the row of the entry after it in its run
    (``-1`` at the run's end, and for unplanned entries).
    """
    planned = carrier >= 0
    head = torch.where(planned, dest_row.long().gather(-1, carrier.clamp_min(0).long()), -1)
    position = send_order.clamp_min(0).long()
    runs = torch.where(send_order >= 0, carrier.long().gather(-1, position), -1)  # carrier of the i-th sent entry
    rows = dest_row.long().gather(-1, position)
    continues = (runs[..., 1:] >= 0) & (runs[..., 1:] == runs[..., :-1])
    following = torch.where(continues, rows[..., 1:], -1)
    # The last position has no successor (a fresh column: with K = 1 ``following`` is empty).
    end = torch.full((*following.shape[:-1], 1), -1, dtype=following.dtype, device=following.device)
    following = torch.cat([following, end], dim=-1)
    top_k = send_order.shape[-1]
    # Scatter each position's successor to its entry; unplanned positions go to a spare last column.
    nxt = torch.full((*head.shape[:-1], top_k + 1), -1, dtype=torch.int64, device=head.device)
    nxt.scatter_(-1, torch.where(send_order >= 0, position, top_k), following)
    nxt = nxt[..., :top_k]
    return head, torch.where(planned, nxt, -1)


def dispatch_torch(
    x: torch.Tensor,
    route_weights: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    carrier: torch.Tensor,
    send_order: torch.Tensor,
    shards: torch.Tensor,
    shard_weights: torch.Tensor,
    links: torch.Tensor,
    dedup: bool,
) -> None:
    """Plain-torch dispatch on stacked shards (virtual ranks): the check for the Triton kernel.

    Args:
        x: ``[R, s, H]``; route_weights, dest_rank, dest_row, carrier, send_order: ``[R, s, K]``.
        shards: ``[R, rows, H]``; shard_weights: ``[R, rows]`` fp32; links: ``[R, rows, 2]`` int32.
            Written in place, planned rows only (carriers' rows in ``shards``; links with ``dedup``).
        dedup: the plan's ``dedup``.
    """
    valid = dest_rank >= 0
    top_k = dest_rank.shape[-1]
    index = (dest_rank[valid].long(), dest_row[valid].long())
    shard_weights.index_put_(index, route_weights[valid].float())
    if dedup:
        head, nxt = link_values(dest_row, carrier, send_order)
        links.index_put_(index, torch.stack([head[valid], nxt[valid]], dim=-1).to(links.dtype))
    sent = valid & (carrier == torch.arange(top_k, device=carrier.device))
    rows = x.unsqueeze(2).expand(-1, -1, top_k, -1)[sent]
    shards.index_put_((dest_rank[sent].long(), dest_row[sent].long()), rows)


def expand_torch(shards: torch.Tensor, links: torch.Tensor, real: torch.Tensor) -> None:
    """Plain-torch :func:`expand_triton` on stacked shards: ``real [R, rows] bool`` from :func:`real_rows_torch`."""
    rank, row = real.nonzero(as_tuple=True)
    head = links[rank, row, 0].long()
    copy = head != row
    shards[rank[copy], row[copy]] = shards[rank[copy], head[copy]]
