"""The layer's shard layout: slot groups moved to a fixed row so borrowed weights can live apart.

The planner lays each rank's groups out in one run of rows: home experts ``[0, split)``, then the
borrowed experts ``[split, end)``, where ``split = offsets[d, epn-1]`` depends on the routing. One
``torch._grouped_mm`` over that run needs home and slot weights in one ``[2*epn, ...]`` tensor,
i.e. slots per layer. To keep one set of slots per process, shared by every layer, the layer runs
two grouped GEMMs instead (home weights of this layer, then the shared slots), and each needs its
rows to start at a row known on the host. :func:`split_slot_rows` therefore moves every rank's slot
groups to start at the fixed row ``slot_base`` = the planner's ``shard_rows``: shards grow to
``2*shard_rows`` rows (both halves can be full under ``exact``), and nothing waits on the device.

It rewrites only row numbers (``dest_row``, ``offsets``, ``padding``, ``group_start``), with no
host sync, so dispatch, combine and every transport use the split layout unchanged. Plans without
borrowed experts (policy ``none``) are returned as they are. On CUDA one Triton launch rewrites
every table (:func:`_split_kernel`): as a dozen small torch ops the rewrite took about 40 us of a
decode step's planning on the H200, more than the planner itself; the torch ops remain the CPU
path and the kernel's check (under ``TRITON_INTERPRET=1`` in the tests).
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch
import triton
import triton.language as tl

from flatep.config import next_pow2
from flatep.plan.types import Layout

_ENTRY_BLOCK = 1024

L = TypeVar("L", bound=Layout)


def split_slot_rows(plan: L) -> L:
    """The same plan with every rank's slot groups starting at row ``plan.shard_rows``.

    Args:
        plan: a :class:`Layout` (or :class:`Plan` / :class:`RankPlan`) in the planner's layout.

    Returns:
        ``plan`` itself under policy ``none`` or if it is split already; otherwise a copy with
        ``slot_base = plan.shard_rows``, ``shard_rows = slot_base + (plan.slot_rows or
        plan.shard_rows)`` and every slot row
        ``r`` of rank ``d`` moved to ``r - split[d] + slot_base``, ``split[d] = offsets[d, epn-1]``.
    """
    if plan.policy == "none" or plan.slot_base:
        return plan
    base = plan.shard_rows
    changes = dict(shard_rows=base + (plan.slot_rows or base), slot_base=base)
    if plan.offsets.is_cuda:
        return dataclasses.replace(plan, **changes, **_split_triton(plan, base))
    return dataclasses.replace(plan, **changes, **_split_torch(plan, base))


def _split_torch(plan: Layout, base: int) -> dict[str, torch.Tensor]:
    """The rewritten tables of :func:`split_slot_rows` in plain torch."""
    epn = plan.slot_experts.shape[1]
    split = plan.offsets[:, epn - 1]  # [R] end of each rank's home rows
    shift = base - split  # [R] >= 0: home rows never exceed the planner's shard
    offsets = plan.offsets.clone()
    offsets[:, epn:] += shift.unsqueeze(1)
    padding = plan.padding.clone()
    padded = padding[:, epn:, 1] > 0
    padding[:, epn:, 0] += torch.where(padded, shift.unsqueeze(1), 0)
    ranks, experts = plan.group_start.shape
    owner = torch.arange(experts, device=plan.group_start.device) // (experts // ranks)
    borrowed = (plan.group_start >= 0) & (owner.unsqueeze(0) != torch.arange(ranks, device=owner.device).unsqueeze(1))
    group_start = torch.where(borrowed, plan.group_start + shift.unsqueeze(1), plan.group_start)
    changes = dict(offsets=offsets, padding=padding, group_start=group_start)
    dest_row = getattr(plan, "dest_row", None)
    if dest_row is not None:
        dest_rank = plan.dest_rank.long().clamp_min(0)
        in_slots = (plan.dest_rank >= 0) & (dest_row >= split[dest_rank])
        changes["dest_row"] = torch.where(in_slots, dest_row + shift[dest_rank], dest_row)
    return changes


@triton.jit
def _split_kernel(
    offsets_ptr, padding_ptr, group_start_ptr, dest_rank_ptr, dest_row_ptr,
    new_offsets_ptr, new_padding_ptr, new_group_start_ptr, new_dest_row_ptr,
    base, ranks, entries,
    EPN: tl.constexpr, EXPERTS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr,
):
    """Program ``p``: rank ``p``'s offsets, padding and group starts (for ``p < R``), then entries
    ``[p*BLOCK, (p+1)*BLOCK)`` of the plan's ``dest_row`` (with ``ROWS``)."""
    program = tl.program_id(0)
    if program < ranks:
        split = tl.load(offsets_ptr + program * 2 * EPN + EPN - 1)
        shift = base - split
        group = tl.arange(0, BLOCK_G)
        inside = group < 2 * EPN
        slot = group >= EPN
        at = program * 2 * EPN + group
        offsets = tl.load(offsets_ptr + at, mask=inside, other=0)
        tl.store(new_offsets_ptr + at, tl.where(slot, offsets + shift, offsets), mask=inside)
        pad_start = tl.load(padding_ptr + 2 * at, mask=inside, other=0)
        pad_count = tl.load(padding_ptr + 2 * at + 1, mask=inside, other=0)
        tl.store(new_padding_ptr + 2 * at, tl.where(slot & (pad_count > 0), pad_start + shift, pad_start), mask=inside)
        tl.store(new_padding_ptr + 2 * at + 1, pad_count, mask=inside)
        expert = tl.arange(0, BLOCK_E)
        known = expert < EXPERTS
        start = tl.load(group_start_ptr + program * EXPERTS + expert, mask=known, other=-1)
        borrowed = (start >= 0) & (expert // EPN != program)  # EXPERTS // R = EPN experts per rank
        tl.store(new_group_start_ptr + program * EXPERTS + expert, tl.where(borrowed, start + shift, start), mask=known)
    if ROWS:
        entry = program.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = entry < entries
        dest = tl.load(dest_rank_ptr + entry, mask=inside, other=-1)
        row = tl.load(dest_row_ptr + entry, mask=inside, other=0)
        planned = inside & (dest >= 0)
        dest_split = tl.load(offsets_ptr + dest * 2 * EPN + EPN - 1, mask=planned, other=0)
        in_slots = planned & (row >= dest_split)
        tl.store(new_dest_row_ptr + entry, tl.where(in_slots, row + base - dest_split, row), mask=inside)


def _split_triton(plan: Layout, base: int) -> dict[str, torch.Tensor]:
    """The rewritten tables of :func:`split_slot_rows` in one launch (no host sync, graph-capturable).

    The plan's tables are int32, as every planner writes them (:class:`flatep.plan.types.Layout`).
    """
    ranks, experts = plan.group_start.shape
    epn = experts // ranks
    tables = [table.contiguous() for table in (plan.offsets, plan.padding, plan.group_start)]
    offsets, padding, group_start = (torch.empty_like(table) for table in tables)
    changes = dict(offsets=offsets, padding=padding, group_start=group_start)
    # A layout without entries (the base type) rewrites its tables only: the kernel's entry pointers then
    # stand in with a table, and ROWS leaves them unread.
    rows = getattr(plan, "dest_row", None) is not None
    dest_rank, dest_row = (plan.dest_rank.contiguous(), plan.dest_row.contiguous()) if rows else (offsets, offsets)
    if rows:
        changes["dest_row"] = torch.empty_like(dest_row)
    entries = dest_row.numel() if rows else 0
    _split_kernel[(max(ranks, triton.cdiv(entries, _ENTRY_BLOCK)),)](
        *tables, dest_rank, dest_row, offsets, padding, group_start, changes.get("dest_row", offsets), base, ranks,
        entries, EPN=epn, EXPERTS=experts, BLOCK_G=next_pow2(2 * epn), BLOCK_E=next_pow2(experts),
        BLOCK=_ENTRY_BLOCK, ROWS=rows, num_warps=4,
    )
    return changes
