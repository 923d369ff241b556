"""Link bytes per rank and phase, read from a plan, and the labelled link model built on them.

What crosses the link in one step (bytes per rank; a row whose destination is its own rank stays
on the device and is counted apart, as ``local``):

- dispatch: one row of ``H`` elements (or one packed fp8 row of ``H + 4*ceil(H/128)`` bytes:
  :mod:`flatep.kernels.fp8_rows`) per (token, destination rank) with a deduplicating plan
  (``plan.dedup``: only the token's carrier rows cross, see :class:`flatep.plan.types.Plan`), one
  per (token, k) entry without; plus per entry the metadata the implementation sends beside it
  (:func:`entry_metadata_bytes`: its fp32 route weight, and with dedup its int32 link pair). Source
  rank: egress; the destination rank: ingress.
- combine: the reverse of dispatch's rows, one row of ``H`` elements per row dispatch sent (with
  dedup, the run's partial sum; the destination shard's rank sends it back: egress; the token's
  rank receives it: ingress). No metadata: the plan tells each side where every row goes.
- push: every borrowed expert's weights (``expert_bytes``) leave its home rank (the donor:
  egress) and enter the borrowing rank (ingress). A push is paid by its donor, not averaged.

The link model charges each rank ``max(egress, ingress) / link_gbps`` per phase (a full-duplex
link per rank, per direction ``link_gbps``) and sums its phases; a layer is as slow as its
busiest rank. It is a model, not a measurement.
"""
from __future__ import annotations

import torch

from flatep.plan.types import Plan, RankPlan
from flatep.transport.collective import static_slots

PHASES = ("dispatch", "combine", "push")


def _push_bytes(slot_experts: torch.Tensor, expert_bytes: int) -> dict[str, list[int]]:
    """Donor egress and receiver ingress of the weight push; ``slot_experts [R, epn] int32``."""
    ranks, epn = slot_experts.shape
    borrowed = slot_experts[slot_experts >= 0].long()
    egress = torch.bincount(borrowed // epn, minlength=ranks) * expert_bytes
    ingress = (slot_experts >= 0).sum(1) * expert_bytes
    return dict(egress=egress.tolist(), ingress=ingress.tolist())


def push_tables(slot_experts: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The slot tables of the part of a push that one rank takes part in.

    On one GPU a push of all virtual ranks is a single launch; timing a rank's own part of it
    (``pool.push`` of one of these tables) gives what that rank pays over a link of its own:
    the slower of what it receives and what it sends (a donor sends every expert it lends).

    Args:
        slot_experts: ``[R, epn]`` int32 plan table (``-1`` = empty slot).
        rank: the rank.

    Returns:
        ``(received, lent)``, both ``[R, epn]`` int32: ``slot_experts`` with every slot but
        ``rank``'s own emptied, and with every slot but those holding ``rank``'s home experts emptied.
    """
    epn = slot_experts.shape[1]
    empty = torch.full_like(slot_experts, -1)
    receivers = torch.arange(slot_experts.shape[0], device=slot_experts.device).view(-1, 1)
    received = torch.where(receivers == rank, slot_experts, empty)
    lent = torch.where((slot_experts >= 0) & (slot_experts // epn == rank), slot_experts, empty)
    return received, lent


def entry_metadata_bytes(dedup: bool) -> int:
    """Bytes dispatch sends beside every entry: its fp32 route weight, and with dedup its link (two
    int32 rows: its carrier's and the next of its run), on every transport alike."""
    return 4 + (8 if dedup else 0)


def carried(plan: Plan | RankPlan) -> torch.Tensor:
    """``[..., s, K] bool``: the entries whose row crosses to their destination (the carriers; every
    planned entry without dedup)."""
    top_k = plan.carrier.shape[-1]
    return plan.carrier == torch.arange(top_k, device=plan.carrier.device)


def rows_to_ranks(plan: RankPlan) -> torch.Tensor:
    """``[R] int64``: the rows one rank's dispatch sends to each rank (its own included)."""
    dest = plan.dest_rank.reshape(-1).long()
    return torch.bincount(dest[carried(plan).reshape(-1)], minlength=plan.slot_experts.shape[0])


def plan_link_bytes(
    plan: Plan, row_bytes: int, expert_bytes: int, combine_row_bytes: int | None = None
) -> dict[str, dict[str, list[int]]]:
    """Bytes each rank sends and receives over the link in every phase of a whole group's plan.

    Args:
        plan: a :class:`Plan` (``dest_rank``, ``carrier [R, s, K] int32``, ``-1`` for padding entries).
        row_bytes: bytes of one token row as dispatch sends it (``H * element size``, or a packed
            fp8 row: :func:`flatep.kernels.fp8_rows.packed_row_bytes`).
        expert_bytes: bytes of one expert's weights as the push moves them.
        combine_row_bytes: bytes of one row combine sends back (default ``row_bytes``).

    Returns:
        ``{phase: {"egress": [R], "ingress": [R], "local": [R]}}`` for ``dispatch``, ``combine``
        (``local``: bytes of rows, and their metadata, that stay on their rank) and ``push`` (no ``local``).
    """
    ranks = plan.dest_rank.shape[0]
    dest = plan.dest_rank.reshape(ranks, -1).long()
    rows = carried(plan).reshape(ranks, -1)
    source = torch.arange(ranks, device=dest.device).view(-1, 1).expand_as(dest)
    remote = (dest >= 0) & (dest != source)
    local = (dest >= 0) & (dest == source)
    # Entries (their metadata) and rows each source rank sends to others; those each rank receives.
    entries_out, rows_out = remote.sum(1), (remote & rows).sum(1)
    entries_in = torch.bincount(dest[remote], minlength=ranks)
    rows_in = torch.bincount(dest[remote & rows], minlength=ranks)
    meta = entry_metadata_bytes(plan.dedup)
    back = row_bytes if combine_row_bytes is None else combine_row_bytes
    return dict(
        dispatch=dict(egress=(rows_out * row_bytes + entries_out * meta).tolist(),
                      ingress=(rows_in * row_bytes + entries_in * meta).tolist(),
                      local=((local & rows).sum(1) * row_bytes + local.sum(1) * meta).tolist()),
        combine=dict(egress=(rows_in * back).tolist(), ingress=(rows_out * back).tolist(),
                     local=((local & rows).sum(1) * back).tolist()),
        push=_push_bytes(plan.slot_experts, expert_bytes),
    )


def rank_link_bytes(
    plan: RankPlan, row_bytes: int, expert_bytes: int, rows_in: int, combine_row_bytes: int | None = None
) -> dict[str, dict[str, int]]:
    """:func:`plan_link_bytes` for one rank of a per-process group, from its own :class:`RankPlan`.

    Entries arriving from other ranks are the rank's real rows (``received``) less its local ones;
    the rows arriving (``rows_in``: with dedup fewer than those entries) are not in this rank's plan.

    Args:
        rows_in: rows other ranks' dispatches send this rank: the sum over the other ranks of their
            :func:`rows_to_ranks` at this rank (an all-to-all of them in a per-process group).
        row_bytes, expert_bytes, combine_row_bytes: as for :func:`plan_link_bytes`.
    """
    rank = plan.rank
    dest = plan.dest_rank.reshape(-1)
    rows = carried(plan).reshape(-1)
    local, remote = dest == rank, (dest >= 0) & (dest != rank)
    local_entries, local_rows = int(local.sum()), int((local & rows).sum())
    entries_out, rows_out = int(remote.sum()), int((remote & rows).sum())
    entries_in = int(plan.received[rank]) - local_entries
    meta = entry_metadata_bytes(plan.dedup)
    push = _push_bytes(plan.slot_experts, expert_bytes)
    back = row_bytes if combine_row_bytes is None else combine_row_bytes
    return dict(
        dispatch=dict(egress=rows_out * row_bytes + entries_out * meta, ingress=rows_in * row_bytes + entries_in * meta,
                      local=local_rows * row_bytes + local_entries * meta),
        combine=dict(egress=rows_in * back, ingress=rows_out * back, local=local_rows * back),
        push=dict(egress=push["egress"][rank], ingress=push["ingress"][rank]),
    )


def static_link_bytes(
    tokens: int, top_k: int, dedup: bool, row_bytes: int, ranks: int, combine_row_bytes: int | None = None
) -> dict[str, dict[str, int]]:
    """Dispatch and combine bytes of one rank of the collective transport with ``static_splits``:
    every peer's part of each message has a fixed size, padding included
    (:func:`flatep.transport.collective.static_slots`), whatever the plan; the part a rank sends
    itself stays ``local``. ``row_bytes`` and ``combine_row_bytes`` as for :func:`plan_link_bytes`.

    Returns:
        ``{"dispatch": {...}, "combine": {...}}``, each ``{"egress", "ingress", "local"}`` in bytes.
    """
    entry_slots, row_slots = static_slots(tokens, top_k, dedup)
    dispatch = entry_slots * entry_metadata_bytes(dedup) + row_slots * row_bytes
    combine = row_slots * (row_bytes if combine_row_bytes is None else combine_row_bytes)
    return dict(
        dispatch=dict(egress=(ranks - 1) * dispatch, ingress=(ranks - 1) * dispatch, local=dispatch),
        combine=dict(egress=(ranks - 1) * combine, ingress=(ranks - 1) * combine, local=combine),
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
