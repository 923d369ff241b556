"""The reference planner: vectorised torch, the executable specification of a plan.

It follows MoonEP's planner (Kimi-K3 technical report, §5.2.1): quotas and per-donor split (:mod:`flatep.plan.policy`), then the per-destination layout and the destination
row of each entry computed here. Ties break toward the smallest index; real rows of an expert
follow its global order (source rank, then flat ``(t, k)`` entry order) cut into chunks in
destination-rank order.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from flatep.config import EPConfig, check_policy
from flatep.plan.cost import CostProfile, check_cost
from flatep.plan.policy import allocate
from flatep.plan.types import Layout, Plan, RankPlan


def _check_ids(topk_ids: torch.Tensor, config: EPConfig, name: str, leading: tuple[int, ...]) -> None:
    expected = (*leading, "s", config.top_k)
    if topk_ids.dim() != len(expected) or topk_ids.shape[-1] != config.top_k or tuple(topk_ids.shape[: len(leading)]) != leading:
        raise ValueError(f"{name} must have shape {list(expected)}, got {list(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {topk_ids.dtype}")
    tokens = topk_ids.shape[-2]
    if not 1 <= tokens <= config.capacity:
        raise ValueError(f"{name}: tokens per rank s must be in [1, capacity={config.capacity}], got {tokens}")


def _token_counts(tokens: Sequence[int] | torch.Tensor | None, ranks: int, step: int) -> list[int]:
    if tokens is None:
        return [step] * ranks
    counts = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
    if len(counts) != ranks or any(not 0 <= c <= step for c in counts) or sum(counts) == 0:
        raise ValueError(
            f"tokens must hold {ranks} counts in [0, s={step}] with a positive sum, got {counts}"
        )
    return counts


def _valid_mask(topk_ids: torch.Tensor, counts: list[int], experts: int, name: str) -> torch.Tensor:
    """``[R, s, K] bool``: entries of real tokens; checks their ids are in ``[0, E)``."""
    step = topk_ids.shape[1]
    limit = torch.tensor(counts, device=topk_ids.device).view(-1, 1, 1)
    valid = (torch.arange(step, device=topk_ids.device).view(1, -1, 1) < limit).expand_as(topk_ids)
    bad = valid & ((topk_ids < 0) | (topk_ids >= experts))
    if bool(bad.any()):
        rank, token, k = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"{name}[{rank}, {token}, {k}] = {int(topk_ids[rank, token, k])} is not an expert id in [0, {experts})"
        )
    return valid


def histogram(topk_ids: torch.Tensor, valid: torch.Tensor, experts: int) -> torch.Tensor:
    """``[R, E] int64`` tokens per expert of each rank, counting only ``valid`` entries."""
    ranks = topk_ids.shape[0]
    flat = torch.where(valid, topk_ids.long(), experts).view(ranks, -1)
    counts = torch.zeros(ranks, experts + 1, dtype=torch.int64, device=topk_ids.device)
    counts.scatter_add_(1, flat, torch.ones_like(flat))
    return counts[:, :experts]


def build_layout(
    tokens_per_expert: torch.Tensor,
    config: EPConfig,
    policy: str,
    total_tokens: int,
    step_tokens: int,
    cost: CostProfile | None = None,
) -> Layout:
    """Layout tables from the gathered histogram (identical on every rank).

    Args:
        tokens_per_expert: ``[R, E]`` integer histogram of every rank's ids.
        config: group sizes.
        policy: ``exact``, ``bounded`` or ``none``.
        total_tokens: tokens over the group ``T`` (sets each rank's share under ``exact``).
        step_tokens: ``s``, the tokens per rank of this step (sets ``shard_rows``).
        cost: the cost profile of ``auto`` (default :meth:`flatep.CostProfile.default`).
    """
    check_policy(policy)
    check_cost(policy, cost)
    if policy == "auto":
        from flatep.plan.auto import auto_layout  # auto plans its candidates with this module

        return auto_layout(tokens_per_expert, config, total_tokens, step_tokens, cost)
    device = tokens_per_expert.device
    ranks, experts, epn, align = config.ranks, config.experts, config.experts_per_rank, config.step_align(total_tokens)
    limit = config.bounded_rows(total_tokens) if policy == "bounded" else config.rebalance_limit(total_tokens)
    alloc = allocate(tokens_per_expert.cpu(), epn, config.top_k, total_tokens, policy, limit)  # [E, R]
    home = torch.arange(experts) // epn
    expert_ids = torch.arange(experts)
    foreign = (alloc > 0) & (home.view(-1, 1) != torch.arange(ranks).view(1, -1))  # [E, R]
    if int(foreign.sum(0).max()) > epn:
        raise AssertionError("a rank borrows more than experts_per_rank experts")
    sort_key = torch.where(foreign.T, expert_ids.view(1, -1), experts)  # [R, E]
    slots = sort_key.sort(dim=1).values[:, :epn]
    slot_experts = torch.where(slots < experts, slots, -1)
    home_experts = torch.arange(ranks * epn).view(ranks, epn)
    group_experts = torch.cat([home_experts, slot_experts], dim=1)  # [R, 2*epn]
    real = torch.where(group_experts >= 0, alloc.T.gather(1, group_experts.clamp_min(0)), 0)
    padded = (real + align - 1) // align * align
    offsets = padded.cumsum(1)
    starts = offsets - padded
    has_padding = padded > real
    padding = torch.stack(
        [torch.where(has_padding, starts + real, 0), torch.where(has_padding, padded - real, 0)], dim=2
    )
    group_start = torch.full((ranks, experts + 1), -1, dtype=torch.int64)
    present = torch.where(real > 0, group_experts, experts)
    group_start.scatter_(1, present, starts)

    def to_device(table: torch.Tensor) -> torch.Tensor:
        return table.to(device=device, dtype=torch.int32).contiguous()

    return Layout(
        policy=policy,
        shard_rows=config.step_rows(config.ranks * step_tokens, policy),
        total_tokens=total_tokens,
        tokens_per_expert=to_device(tokens_per_expert),
        alloc=to_device(alloc),
        slot_experts=to_device(slot_experts),
        group_experts=to_device(group_experts),
        offsets=to_device(offsets),
        padding=to_device(padding),
        received=to_device(alloc.sum(0)),
        group_start=to_device(group_start[:, :experts]),
    )


def entry_destinations(
    topk_ids: torch.Tensor, valid: torch.Tensor, source_ranks: Sequence[int], layout: Layout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Destination rank and row of every entry of the given source ranks.

    Args:
        topk_ids: ``[n, s, K]`` ids of ``n`` source ranks.
        valid: ``[n, s, K] bool``, entries that count.
        source_ranks: the ``n`` rank indices of ``topk_ids``'s rows.
        layout: the group's layout.

    Returns:
        ``(dest_rank, dest_row)``, each ``[n, s, K] int32``; ``-1`` where not valid.
    """
    device = topk_ids.device
    experts = layout.tokens_per_expert.shape[1]
    counts = layout.tokens_per_expert.long()
    before_rank = counts.cumsum(0) - counts  # [R, E] entries of expert e on lower source ranks
    sources = torch.tensor(list(source_ranks), device=device, dtype=torch.int64)
    per_rank = topk_ids[0].numel()
    source = sources.view(-1, 1).expand(-1, per_rank).reshape(-1)
    expert = topk_ids.reshape(-1).long()
    flat_valid = valid.reshape(-1)
    # Stable sort by (source rank, expert) keeps flat (t, k) order inside each expert.
    key = torch.where(flat_valid, source * experts + expert, len(counts) * experts)
    order = torch.sort(key, stable=True).indices
    sorted_key = key[order]
    key_counts = torch.bincount(sorted_key, minlength=len(counts) * experts + 1)
    key_starts = key_counts.cumsum(0) - key_counts
    local_position = torch.empty_like(key)
    local_position[order] = torch.arange(key.numel(), device=device) - key_starts[sorted_key]
    safe_expert = torch.where(flat_valid, expert, 0)
    safe_source = torch.where(flat_valid, source, 0)
    global_position = before_rank[safe_source, safe_expert] + local_position
    alloc = layout.alloc.long()
    chunk_end = alloc.cumsum(1)  # [E, R] prefix over destinations
    destination = (chunk_end[safe_expert] <= global_position.view(-1, 1)).sum(1)
    destination = destination.clamp_max(alloc.shape[1] - 1)
    chunk_start = (chunk_end - alloc)[safe_expert, destination]
    row = layout.group_start.long()[destination, safe_expert] + global_position - chunk_start
    dest_rank = torch.where(flat_valid, destination, -1).to(torch.int32).view_as(topk_ids)
    dest_row = torch.where(flat_valid, row, -1).to(torch.int32).view_as(topk_ids)
    return dest_rank.contiguous(), dest_row.contiguous()


def dedup_tables(dest_rank: torch.Tensor, dedup: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each entry's carrier and each token's send order (see :class:`flatep.plan.types.Plan`).

    Args:
        dest_rank: ``[..., K]`` int32 destination rank of every entry (``-1``: unplanned).
        dedup: whether an entry's carrier is the token's first entry bound for its rank (else itself).

    Returns:
        ``(carrier, send_order)``, each ``[..., K] int32``: ``carrier`` the ``k`` of each entry's
        carrier (``-1`` unplanned); ``send_order`` the token's planned entries sorted by
        (destination rank, ``k``), then ``-1``.
    """
    top_k = dest_rank.shape[-1]
    k = torch.arange(top_k, device=dest_rank.device)
    planned = dest_rank >= 0
    if dedup:
        same = dest_rank.unsqueeze(-1) == dest_rank.unsqueeze(-2)  # [..., k, k']: same destination
        carrier = torch.where(same, k, top_k).amin(-1)
    else:
        carrier = k.expand_as(dest_rank)
    carrier = torch.where(planned, carrier, -1)
    # Keys are distinct among planned entries; unplanned ones all sort last.
    last = int(torch.iinfo(torch.int64).max)
    key = torch.where(planned, dest_rank.long() * top_k + k, last)
    sorted_key, order = key.sort(-1)
    send_order = torch.where(sorted_key < last, order, -1)
    return carrier.to(torch.int32).contiguous(), send_order.to(torch.int32).contiguous()


def make_plan(
    topk_ids: torch.Tensor,
    config: EPConfig,
    policy: str = "exact",
    tokens: Sequence[int] | torch.Tensor | None = None,
    cost: CostProfile | None = None,
) -> Plan:
    """Plan one step of a whole group (all ranks at once, as the virtual-rank transport holds them).

    Args:
        topk_ids: ``[R, s, K]`` int32 (or int64) expert ids of every rank; ``1 <= s <= capacity``.
        config: group sizes; ``R`` and ``K`` must match ``topk_ids``.
        policy: ``exact`` (flat: rank ``d`` computes ``cap[d]`` rows), ``bounded`` (at most
            :meth:`~flatep.EPConfig.bounded_rows` rows per rank; only the surplus moves) or
            ``none`` (classic EP).
        tokens: optional ``[R]`` real tokens per rank (per-rank ``s`` mode); rows ``t >= tokens[r]``
            of rank ``r`` are padding (conventionally ``-1``), ignored, and planned as ``-1``.
        cost: under ``policy="auto"`` (the cheapest candidate by the cost model,
            :mod:`flatep.plan.auto`), the :class:`flatep.CostProfile` (default: the generic one).

    Returns:
        The :class:`Plan`, tensors on ``topk_ids.device``.
    """
    check_policy(policy)
    _check_ids(topk_ids, config, "topk_ids", (config.ranks,))
    counts = _token_counts(tokens, config.ranks, topk_ids.shape[1])
    valid = _valid_mask(topk_ids, counts, config.experts, "topk_ids")
    tokens_per_expert = histogram(topk_ids, valid, config.experts)
    layout = build_layout(tokens_per_expert, config, policy, sum(counts), topk_ids.shape[1], cost)
    dest_rank, dest_row = entry_destinations(topk_ids, valid, range(config.ranks), layout)
    carrier, send_order = dedup_tables(dest_rank, config.dedup)
    return Plan(**vars(layout), dest_rank=dest_rank, dest_row=dest_row, carrier=carrier, send_order=send_order,
                dedup=config.dedup)


def plan_rank(
    rank: int,
    topk_ids: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    config: EPConfig,
    policy: str = "exact",
    total_tokens: int | None = None,
    tokens: int | None = None,
    cost: CostProfile | None = None,
) -> RankPlan:
    """One rank's plan from the gathered histogram and its own ids (one process per rank).

    Every rank computes the same layout from the same ``tokens_per_expert``; the destination of
    each local entry then follows without further communication.

    Args:
        rank: this rank, in ``[0, R)``.
        topk_ids: ``[s, K]`` this rank's ids.
        tokens_per_expert: ``[R, E]`` histogram gathered from every rank (row ``r`` from rank ``r``).
        config: group sizes.
        policy: ``exact``, ``bounded`` or ``none``.
        total_tokens: tokens over the group (default: ``R * s``, every rank passing ``s``).
        tokens: this rank's real tokens (default ``s``); rows beyond are padding.
        cost: the :class:`flatep.CostProfile` of ``policy="auto"`` (every rank must pass the same).
    """
    check_policy(policy)
    if not 0 <= rank < config.ranks:
        raise ValueError(f"rank must be in [0, {config.ranks}), got {rank}")
    _check_ids(topk_ids, config, "topk_ids", ())
    if tuple(tokens_per_expert.shape) != (config.ranks, config.experts):
        raise ValueError(
            f"tokens_per_expert must have shape [{config.ranks}, {config.experts}], got {list(tokens_per_expert.shape)}"
        )
    step = topk_ids.shape[0]
    own = [step if tokens is None else int(tokens)]
    if not 0 <= own[0] <= step:
        raise ValueError(f"tokens must be in [0, s={step}], got {tokens}")
    valid = _valid_mask(topk_ids.unsqueeze(0), own, config.experts, "topk_ids")
    local_histogram = histogram(topk_ids.unsqueeze(0), valid, config.experts)[0]
    if not torch.equal(local_histogram, tokens_per_expert[rank].to(local_histogram)):
        raise ValueError(f"tokens_per_expert[{rank}] does not match the histogram of this rank's topk_ids")
    total = config.ranks * step if total_tokens is None else total_tokens
    if int(tokens_per_expert.sum()) != total * config.top_k:
        raise ValueError(
            f"total_tokens={total} disagrees with the gathered histogram ({int(tokens_per_expert.sum())} entries, "
            f"K={config.top_k}): ranks disagree on s or on the token counts"
        )
    layout = build_layout(tokens_per_expert.long(), config, policy, total, step, cost)
    dest_rank, dest_row = entry_destinations(topk_ids.unsqueeze(0), valid, [rank], layout)
    carrier, send_order = dedup_tables(dest_rank[0], config.dedup)
    return RankPlan(**vars(layout), rank=rank, dest_rank=dest_rank[0], dest_row=dest_row[0], carrier=carrier,
                    send_order=send_order, dedup=config.dedup)
