"""Link bytes per rank and phase, read from a plan, and the labelled link model built on them.

What crosses the link in one step (bytes per rank; a row whose destination is its own rank stays
on the device and is counted apart, as ``local``):

- dispatch: one row of ``H`` elements plus its fp32 route weight per (token, k) entry (the
  dispatch kernel sends every entry; tokens are not deduplicated). Source rank: egress; the
  destination rank: ingress.
- combine: the reverse of dispatch, one row of ``H`` elements per entry (the destination shard's
  rank sends it back: egress; the token's rank receives it: ingress).
- push: every borrowed expert's weights (``expert_bytes``) leave its home rank (the donor:
  egress) and enter the borrowing rank (ingress). A push is paid by its donor, not averaged.

The link model charges each rank ``max(egress, ingress) / link_gbps`` per phase (a full-duplex
link per rank, per direction ``link_gbps``) and sums its phases; a layer is as slow as its
busiest rank. It is a model, not a measurement.
"""
from __future__ import annotations

import torch

from flatep.plan.types import Plan, RankPlan

PHASES = ("dispatch", "combine", "push")


def _push_bytes(slot_experts: torch.Tensor, expert_bytes: int) -> dict[str, list[int]]:
    """Donor egress and receiver ingress of the weight push; ``slot_experts [R, epn] int32``."""
    ranks, epn = slot_experts.shape
    borrowed = slot_experts[slot_experts >= 0].long()
    egress = torch.bincount(borrowed // epn, minlength=ranks) * expert_bytes
    ingress = (slot_experts >= 0).sum(1) * expert_bytes
    return dict(egress=egress.tolist(), ingress=ingress.tolist())


def plan_link_bytes(plan: Plan, row_bytes: int, expert_bytes: int) -> dict[str, dict[str, list[int]]]:
    """Bytes each rank sends and receives over the link in every phase of a whole group's plan.

    Args:
        plan: a :class:`Plan` (``dest_rank [R, s, K] int32``, ``-1`` for padding entries).
        row_bytes: bytes of one token row (``H * element size``).
        expert_bytes: bytes of one expert's weights as the push moves them.

    Returns:
        ``{phase: {"egress": [R], "ingress": [R], "local": [R]}}`` for ``dispatch``, ``combine``
        (``local``: bytes of rows that stay on their rank) and ``push`` (no ``local``).
    """
    ranks = plan.dest_rank.shape[0]
    dest = plan.dest_rank.reshape(ranks, -1).long()
    source = torch.arange(ranks, device=dest.device).view(-1, 1).expand_as(dest)
    remote = (dest >= 0) & (dest != source)
    local = ((dest >= 0) & (dest == source)).sum(1)
    sent = remote.sum(1)  # entries each source rank sends to other ranks
    arrived = torch.bincount(dest[remote], minlength=ranks)  # entries each rank receives from others
    dispatch_row = row_bytes + 4  # the fp32 route weight travels beside each row
    return dict(
        dispatch=dict(egress=(sent * dispatch_row).tolist(), ingress=(arrived * dispatch_row).tolist(),
                      local=(local * dispatch_row).tolist()),
        combine=dict(egress=(arrived * row_bytes).tolist(), ingress=(sent * row_bytes).tolist(),
                     local=(local * row_bytes).tolist()),
        push=_push_bytes(plan.slot_experts, expert_bytes),
    )


def rank_link_bytes(plan: RankPlan, row_bytes: int, expert_bytes: int) -> dict[str, dict[str, int]]:
    """:func:`plan_link_bytes` for one rank of a per-process group, from its own :class:`RankPlan`.

    Rows arriving from other ranks are the rank's real rows (``received``) less its local ones.
    """
    rank = plan.rank
    dest = plan.dest_rank.reshape(-1)
    local = int((dest == rank).sum())
    sent = int(((dest >= 0) & (dest != rank)).sum())
    arrived = int(plan.received[rank]) - local
    push = _push_bytes(plan.slot_experts, expert_bytes)
    dispatch_row = row_bytes + 4
    return dict(
        dispatch=dict(egress=sent * dispatch_row, ingress=arrived * dispatch_row, local=local * dispatch_row),
        combine=dict(egress=arrived * row_bytes, ingress=sent * row_bytes, local=local * row_bytes),
        push=dict(egress=push["egress"][rank], ingress=push["ingress"][rank]),
    )


def link_model_us(link_bytes: dict[str, dict[str, list[int]]], link_gbps: float) -> dict[str, list[float]]:
    """Modelled link time of every rank and phase: ``max(egress, ingress) / link_gbps``, in µs.

    Returns:
        ``{phase: [R] µs}`` plus ``"total"``: each rank's sum over phases.
    """
    if link_gbps <= 0:
        raise ValueError(f"link_gbps must be > 0, got {link_gbps}")
    per_phase = {
        phase: [max(out, into) / (link_gbps * 1e3) for out, into in zip(link_bytes[phase]["egress"], link_bytes[phase]["ingress"])]
        for phase in PHASES
    }
    per_phase["total"] = [sum(times) for times in zip(*(per_phase[phase] for phase in PHASES))]
    return per_phase
