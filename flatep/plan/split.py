"""The layer's shard layout: slot groups moved to a fixed row so borrowed weights can live apart.

The planner lays each rank's groups out in one run of rows: home experts ``[0, split)``, then the
borrowed experts ``[split, end)``, where ``split = offsets[d, epn-1]`` depends on the routing. One
``torch._grouped_mm`` over that run needs home and slot weights in one ``[2*epn, ...]`` tensor,
i.e. slots per layer. To keep one set of slots per process, shared by every layer, the layer runs
two grouped GEMMs instead (home weights of this layer, then the shared slots), and each needs its
rows to start at a row known on the host. :func:`split_slot_rows` therefore moves every rank's slot
groups to start at the fixed row ``slot_base`` = the planner's ``shard_rows``: shards grow to
``2*shard_rows`` rows (both halves can be full under ``exact``), and nothing waits on the device.

It rewrites only row numbers (``dest_row``, ``offsets``, ``padding``, ``group_start``), with a few
elementwise device ops and no host sync, so dispatch, combine and every transport use the split
layout unchanged. Plans without borrowed experts (policy ``none``) are returned as they are.
"""
from __future__ import annotations

import dataclasses
from typing import TypeVar

import torch

from flatep.plan.types import Layout

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
    epn = plan.slot_experts.shape[1]
    base = plan.shard_rows
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
    changes = dict(
        offsets=offsets, padding=padding, group_start=group_start, shard_rows=base + (plan.slot_rows or base), slot_base=base
    )
    dest_row = getattr(plan, "dest_row", None)
    if dest_row is not None:
        dest_rank = plan.dest_rank.long().clamp_min(0)
        in_slots = (plan.dest_rank >= 0) & (dest_row >= split[dest_rank])
        changes["dest_row"] = torch.where(in_slots, dest_row + shift[dest_rank], dest_row)
    return dataclasses.replace(plan, **changes)
