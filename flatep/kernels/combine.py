"""Combine: each token sums its expert outputs from the shards in fp32 (unweighted), once per rank.

The experts have already multiplied each row by its route weight, so combine is a plain sum, in two
steps (see :class:`flatep.plan.types.Plan`): with a deduplicating plan, each computing rank first
sums every run of its own shard, the rows of one token there in ascending ``k`` (fp32, rounded
once to the rows' dtype), into the run's carrier row (:func:`sum_runs_triton`; nothing to do
without dedup); then every token reads its carriers' rows, one per destination rank, and adds them
in the plan's ``send_order`` (ascending destination rank) in fp32 (:func:`combine_triton`). The
grids are 1-D and their programs walk their work items with a grid-stride loop, so a capped grid
(``programs``) sums every token exactly as an uncapped one does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.config import next_pow2
from flatep.kernels.backend import SPLIT_BELOW_ITEMS, column_block, comm_grid, interpreting, round_to_bf16, token_block
from flatep.kernels.dispatch import real_rows, row_block, row_grid


@triton.jit
def _combine_kernel(
    out_ptr, dest_rank_ptr, dest_row_ptr, carrier_ptr, order_ptr, shard_ptr, shard_peers_ptr,
    tokens, blocks, work, ranks, out_rank_stride, entry_rank_stride,
    H: tl.constexpr, K: tl.constexpr, K_SLOTS: tl.constexpr, R_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_T tokens), whole rows, all on grid axis 0 (axis 1
    # stops at 65,535 programs); a grid-stride loop lets a capped grid cover every item.
    # K_SLOTS, R_SLOTS = K and the group's ranks rounded up to powers of two (tensor dimensions).
    position = tl.arange(0, K_SLOTS)
    peer_rank = tl.arange(0, R_SLOTS)
    # The peer offset table is [R]: held in registers, so a row's address waits on no load of it.
    peers = tl.load(shard_peers_ptr + peer_rank, mask=peer_rank < ranks, other=0)
    for step in range(tl.program_id(0), work, tl.num_programs(0)):
        local, token, token_mask, entry_base = token_block(step, blocks, tokens, entry_rank_stride, K, BLOCK_T)
        out_rows = out_ptr + local * out_rank_stride + token * H
        # Each token's carrier rows in send order (ascending destination rank), as element offsets,
        # -1 where there is none. Every table is read in one load of all K entries (no chain of
        # loads through the send order), then permuted in registers; found once per item, so the
        # column loop's K row loads wait on nothing else.
        entries = entry_base[:, None] + position[None, :]
        entry_mask = token_mask[:, None] & (position < K)[None, :]
        order = tl.load(order_ptr + entries, mask=entry_mask, other=-1)
        carrier = tl.load(carrier_ptr + entries, mask=entry_mask, other=-1)
        dest = tl.load(dest_rank_ptr + entries, mask=entry_mask, other=-1)
        row = tl.load(dest_row_ptr + entries, mask=entry_mask, other=0)
        peer = tl.sum(tl.where(dest[:, :, None] == peer_rank[None, None, :], peers[None, None, :], 0), axis=2)
        by_entry = tl.where(carrier == position[None, :], peer + row.to(tl.int64) * H, -1)  # carriers only
        chosen = tl.sum(tl.where(order[:, :, None] == position[None, None, :], by_entry[:, None, :], 0), axis=2)
        sources = tl.where(order >= 0, chosen, -1)
        for start in range(0, H, BLOCK_H):
            column = start + tl.arange(0, BLOCK_H)
            column_mask = column < H
            total = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for i in tl.static_range(K):
                source = tl.sum(tl.where(position[None, :] == i, sources, 0), axis=1)
                live = source >= 0
                values = tl.load(shard_ptr + source[:, None] + column[None, :], mask=live[:, None] & column_mask[None, :], other=0.0)
                total += values.to(tl.float32)
            if ROUND_BF16:  # the interpreter's cast to bf16 truncates; the GPU's rounds to nearest even
                total = round_to_bf16(total)
            tl.store(out_rows[:, None] + column[None, :], total.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & column_mask[None, :])


@triton.jit
def _sum_runs_kernel(
    rows_ptr, sums_ptr, links_ptr, offsets_ptr, padding_ptr, first_rank, rows, slot_base, blocks, work,
    H: tl.constexpr, K: tl.constexpr, K_SLOTS: tl.constexpr, EPN: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_R shard rows); a carrier's program sums its run.
    # K_SLOTS = K rounded up to a power of two (a tensor dimension).
    position = tl.arange(0, K_SLOTS)
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        local, rank, row, inside, used = row_block(item, blocks, first_rank, rows, offsets_ptr, slot_base, EPN, BLOCK_R)
        if used:
            real = inside & real_rows(row, offsets_ptr + rank * 2 * EPN, padding_ptr + rank * 4 * EPN, slot_base,
                                      EPN, 2 * EPN, BLOCK_G)
            links = links_ptr + local * rows * 2
            head = tl.load(links + row * 2, mask=real, other=-1).to(tl.int64)
            carrier = real & (head == row)
            if tl.max(carrier.to(tl.int32), axis=0) > 0:  # only blocks that hold a carrier sum anything
                # Walk each run once: members[:, i] = its i-th row (ascending k), -1 past its end. The
                # column loop below then issues its K loads independently instead of re-walking the chain.
                members = tl.full([BLOCK_R, K_SLOTS], -1, tl.int64)
                member = tl.where(carrier, row, -1)
                for i in tl.static_range(K):  # a run has at most K rows
                    members = tl.where(position[None, :] == i, member[:, None], members)
                    member = tl.load(links + member * 2 + 1, mask=member >= 0, other=-1).to(tl.int64)
                source = rows_ptr + local * rows * H
                target = sums_ptr + local * rows * H
                for start in range(0, H, BLOCK_H):
                    column = start + tl.arange(0, BLOCK_H)
                    column_mask = column < H
                    total = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
                    for i in tl.static_range(K):
                        member = tl.sum(tl.where(position[None, :] == i, members, 0), axis=1)
                        # Most runs are short: skip the i-th load where no run of the block has an i-th
                        # row (adding its +0.0 changes no sum: a sum from +0.0 is never -0.0).
                        if tl.max(member, axis=0) >= 0:
                            on = member >= 0
                            values = tl.load(source + member[:, None] * H + column[None, :],
                                             mask=on[:, None] & column_mask[None, :], other=0.0)
                            total += values.to(tl.float32)
                    if ROUND_BF16:  # as in _combine_kernel
                        total = round_to_bf16(total)
                    tl.store(target + row[:, None] * H + column[None, :], total.to(sums_ptr.dtype.element_ty),
                             mask=carrier[:, None] & column_mask[None, :])


def combine_grid(ranks_here: int, tokens: int, block_t: int = 1, programs: int | None = None) -> tuple[int]:
    """Grid of the combine kernel: 1-D, one program per (rank driven, block of ``block_t`` tokens),
    at most ``programs``.

    Raises:
        ValueError: if the launch would exceed the kernels' work-item limit (:func:`comm_grid`).
    """
    return comm_grid(ranks_here * triton.cdiv(tokens, block_t), programs, "token blocks")


def combine_warps(token_items: int) -> int:
    """Warps per program of a combine launch of ``token_items`` (ranks driven x token blocks) items.

    Measured on the H200 at Kimi-K2 with R = 8 (``python -m flatep.bench.kernels``, CUDA graphs of
    10 launches, ``bench/results/2026-12-04-h200-f/kernels-decode.log``): below
    :data:`~flatep.kernels.backend.SPLIT_BELOW_ITEMS` items (s < 256) 8 warps, whole rows, took
    s = 128 from 53.7 to 42.0 us and s = 32 from 13.6 to 8.8 us; from there on 4 warps are the
    best measured (s = 1024: 276 against 291 us, ``2026-12-04-h200-e/kernels-c9c7e35.log``).
    """
    return 8 if token_items < SPLIT_BELOW_ITEMS else 4


def combine_triton(
    out: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    carrier: torch.Tensor,
    send_order: torch.Tensor,
    shard: torch.Tensor,
    shard_peers: torch.Tensor,
    block_t: int = 1,
    block_h: int | None = None,
    num_warps: int | None = None,
    programs: int | None = None,
) -> None:
    """``out[r, t]`` = the fp32 sum, in ``send_order``, of the rows of token ``(r, t)``'s carriers.

    With a deduplicating plan the carriers' rows must hold their runs' sums (:func:`sum_runs_triton`).

    Args:
        out: ``[n, s, H]`` output of the ``n`` ranks this process drives (written; padded tokens
            get zeros).
        dest_rank, dest_row, carrier, send_order: ``[n, s, K]`` int32 from the plan.
        shard: base of this process's shard buffer (``[.., rows, H]``).
        shard_peers: ``[R] int64`` element offsets of every rank's shard from ``shard``'s base.
        block_t, block_h, num_warps: tuning (see ``python -m flatep.bench.kernels``; ``num_warps``
            ``None``: :func:`combine_warps`). The defaults (one token per program, 2 KiB column
            chunks, 4 warps from s = 256 at R = 8) were the best or within 3% of it
            on the H200 for Kimi-K2 and Kimi-K3 at s=1024 and 4096
            (``bench/results/2026-12-02-h200-b/kernels-*.log``): more tokens per program hold
            ``block_t*block_h`` fp32 sums in registers and spill. Finding each token's carrier
            rows once per work item, before the column loop, took Kimi-K2 at s = 1024 from 332 to
            277 µs (92% of the copy ceiling; CUDA graphs of 10 launches,
            ``bench/results/2026-12-04-h200-e/kernels-*.log``); reading each table in one load
            and the peer offsets from registers, from 275 to 268 µs, and s = 128 from 45.3 to 43.4
            µs (same call, ``bench/results/2026-12-04-h200-f/kernels-combine-*.log``).
        programs: at most this many programs (``None``: one per token block), to leave SMs to
            work running beside combine; results do not depend on it.

    Raises:
        ValueError: for a launch beyond the kernel's limits (:func:`combine_grid`), before it runs.
    """
    ranks_here, tokens, hidden = out.shape
    top_k = dest_rank.shape[-1]
    blocks = triton.cdiv(tokens, block_t)
    block_h = block_h or column_block(hidden, shard.element_size())
    grid = combine_grid(ranks_here, tokens, block_t, programs)
    _combine_kernel[grid](
        out, dest_rank, dest_row, carrier, send_order, shard, shard_peers,
        tokens, blocks, ranks_here * blocks, shard_peers.numel(), tokens * hidden, tokens * top_k,
        H=hidden, K=top_k, K_SLOTS=next_pow2(top_k), R_SLOTS=next_pow2(shard_peers.numel()), BLOCK_T=block_t,
        BLOCK_H=block_h, ROUND_BF16=interpreting() and out.dtype == torch.bfloat16,
        num_warps=num_warps or combine_warps(ranks_here * blocks),
    )


def sum_runs_triton(
    rows: torch.Tensor, sums: torch.Tensor, links: torch.Tensor, offsets: torch.Tensor, padding: torch.Tensor,
    slot_base: int, first_rank: int, top_k: int, block_r: int = 4, programs: int | None = None,
) -> None:
    """Write into each carrier row of ``sums`` the fp32 sum of its run's ``rows`` (ascending ``k``), rounded once.

    Args:
        rows: ``[n, rows, H]`` (or ``[rows, H]``) this process's expert outputs, contiguous.
        sums: like ``rows`` (may be ``rows`` itself: each program reads its run before it writes
            the carrier row, and no other run reads that row); only carrier rows are written.
        links: ``[n, rows, 2]`` (or ``[rows, 2]``) int32 link tables from dispatch.
        offsets, padding, slot_base: the plan's; first_rank: global rank of the first shard; top_k: ``K``.
        block_r, programs: rows per work item; cap on the programs (results do not depend on
            it). A block's i-th loads are skipped when none of its runs is that long. On the H200
            at Kimi-K2, s = 128, one row per item took 133-139 us for classic's combine: most
            items lie past the rank's groups in buffers sized for a full step and only read two
            offsets; four rows per item, as the expansion takes (about 19 us there), make a
            quarter as many (not timed against one row per item; with four, dispatch and combine
            together took 9.96-10.06 us per rank there, bench/results/2026-12-04-h200-f).
    """
    count, hidden = rows.shape[-2:]
    ranks_here = rows.numel() // (count * hidden)
    groups = offsets.shape[1]
    grid = row_grid(ranks_here, count, block_r, programs)
    blocks = triton.cdiv(count, block_r)
    _sum_runs_kernel[grid](
        rows, sums, links, offsets, padding, first_rank, count, slot_base, blocks, ranks_here * blocks,
        H=hidden, K=top_k, K_SLOTS=next_pow2(top_k), EPN=groups // 2, BLOCK_G=next_pow2(groups), BLOCK_R=block_r,
        BLOCK_H=min(next_pow2(hidden), 2048), ROUND_BF16=interpreting() and sums.dtype == torch.bfloat16,
    )


def run_sums(rows: torch.Tensor, links: torch.Tensor, carriers: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[n, H]`` in ``rows``' dtype: the sum of each carrier's run of one shard, as the kernel sums it.

    Args:
        rows: ``[rows, H]`` one rank's expert outputs; links: ``[rows, 2]`` int32 its link table.
        carriers: ``[n]`` int64 carrier rows; top_k: ``K`` (a run has at most ``K`` rows).
    """
    total = torch.zeros(carriers.numel(), rows.shape[-1], dtype=torch.float32, device=rows.device)
    member = carriers
    for _ in range(top_k):  # the kernel's order: the run's rows in ascending k, each added in fp32
        on = member >= 0
        total += torch.where(on.unsqueeze(-1), rows[member.clamp_min(0)].float(), 0.0)
        member = torch.where(on, links[member.clamp_min(0), 1].long(), -1)
    return total.to(rows.dtype)


def sum_runs_torch(rows: torch.Tensor, sums: torch.Tensor, links: torch.Tensor, real: torch.Tensor, top_k: int) -> None:
    """Plain-torch :func:`sum_runs_triton` on stacked ``[R, rows, H]`` tensors (``real [R, rows] bool``)."""
    position = torch.arange(real.shape[1], device=real.device)
    for rank in range(real.shape[0]):
        carriers = (real[rank] & (links[rank, :, 0].long() == position)).nonzero().flatten()
        sums[rank, carriers] = run_sums(rows[rank], links[rank], carriers, top_k).to(sums.dtype)


def combine_torch(
    dest_rank: torch.Tensor, dest_row: torch.Tensor, carrier: torch.Tensor, send_order: torch.Tensor,
    shards: torch.Tensor, out_dtype: torch.dtype,
) -> torch.Tensor:
    """Plain-torch combine on stacked shards: ``[R, s, H]`` in ``out_dtype``.

    Args:
        dest_rank, dest_row, carrier, send_order: ``[R, s, K]`` int32 (``-1`` = unplanned, contributes nothing).
        shards: ``[R, rows, H]`` (carrier rows holding their runs' sums).
    """
    total = torch.zeros(*dest_rank.shape[:-1], shards.shape[-1], dtype=torch.float32, device=shards.device)
    for i in range(send_order.shape[-1]):  # the kernel's order and fp32 accumulation: bit-equal results
        entry = send_order[..., i : i + 1].long()
        live = (entry >= 0) & (carrier.gather(-1, entry.clamp_min(0)).long() == entry)
        rank = dest_rank.gather(-1, entry.clamp_min(0)).clamp_min(0).long()
        row = dest_row.gather(-1, entry.clamp_min(0)).clamp_min(0).long()
        rows = shards[rank[..., 0], row[..., 0]].float()
        total += torch.where(live, rows, 0.0)  # unplanned rows may hold garbage, even NaN
    return total.to(out_dtype)
