"""Balancing policies: how many rows of each expert each rank computes in one step.

A policy maps the global tokens-per-expert count to ``alloc[e, d]``, the rows of expert ``e``
computed on rank ``d``. Everything else in the plan (layout, destination of each entry) follows
from ``alloc`` and is shared by all policies.

* ``exact`` (flat): MoonEP's balancer. Overloaded ranks hand their surplus to underloaded ranks
  so that rank ``d`` computes exactly ``cap[d]`` rows; each receiver has one donor. A step whose
  busiest rank stays within ``limit`` rows (:meth:`flatep.EPConfig.rebalance_limit`, set by the
  config's ``tolerance``) is not rebalanced: every expert stays home, as under ``none``.
* ``bounded``: only the surplus above a bound moves. With ``b`` =
  :meth:`flatep.EPConfig.bounded_rows` (``max(ceil(T*K/R), floor((1 + tolerance) * T*K/R))``,
  ``tolerance`` = the config's), :func:`bounded_targets` gives each rank its target rows:

  - a rank with ``load > b`` gets target ``b``; their surplus ``X = sum(load - b)`` over those
    ranks is water-filled onto the least loaded ranks:
  - ``L`` = the largest integer ``L <= b`` with ``sum over ranks of max(0, L - load) <= X``;
    every rank with ``load < L`` gets target ``L``;
  - the ``X - sum(max(0, L - load))`` rows left go ``+1`` each to the ranks whose target is now
    ``L``, smallest index first, when ``L < b`` (when ``L = b`` none are left, since
    ``R * b >= T*K``);
  - every other rank keeps ``target = load``.

  The targets sum to the loads. Step A (:func:`rank_quotas`) and step B (:func:`split_quotas`)
  then run as under ``exact`` with the targets in place of ``cap``, so every receiver still has
  one donor. A step where no rank exceeds ``b`` moves nothing (its plan equals ``none``'s).
* ``none`` (classic EP): every expert is computed on its home rank.
"""
from __future__ import annotations

import torch

from flatep.config import check_policy


def rank_capacities(total_tokens: int, top_k: int, ranks: int) -> list[int]:
    """Real rows each rank computes under exact balance.

    ``cap[d] = floor(T*K/R) + (1 if d < (T*K) mod R else 0)``, ``T`` = tokens over the group.
    """
    entries = total_tokens * top_k
    return [entries // ranks + (1 if d < entries % ranks else 0) for d in range(ranks)]


def _first_argmax(values: list[int]) -> int:
    """Index of the largest value, ties toward the smallest index."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _first_argmin(values: list[int]) -> int:
    return min(range(len(values)), key=lambda i: (values[i], i))


def bounded_targets(load: list[int], bound: int) -> list[int]:
    """Rows each rank computes under ``bounded`` with at most ``bound`` rows per rank (module docstring).

    Args:
        load: ``[R]`` rows homed on each rank (the sum of its experts' counts).
        bound: ``b``; ``R * b >= sum(load)`` is required.
    """
    ranks = len(load)
    if ranks * bound < sum(load):
        raise ValueError(f"bound must be >= ceil(sum(load) / R) = {-(-sum(load) // ranks)}, got {bound}")
    surplus = sum(max(0, value - bound) for value in load)

    def fill(level: int) -> int:
        return sum(max(0, level - value) for value in load)

    # fill() is non-decreasing in the level: binary search for the largest level with fill <= X.
    low, high = 0, bound
    while low < high:
        middle = (low + high + 1) // 2
        if fill(middle) <= surplus:
            low = middle
        else:
            high = middle - 1
    level = low
    targets = [bound if value > bound else max(value, level) for value in load]
    left = surplus - fill(level)
    for rank in range(ranks):
        if left == 0 or level >= bound:
            break
        if targets[rank] == level:
            targets[rank] += 1
            left -= 1
    if sum(targets) != sum(load):
        raise AssertionError(f"bounded targets {targets} do not conserve loads {load}")
    return targets


def rank_quotas(load: list[int], capacity: list[int]) -> list[list[int]]:
    """Step A: ``z[h][u]`` rows that donor rank ``h`` sends to receiver rank ``u``.

    Repeatedly pairs the most overloaded rank with the most underloaded one (ties toward the
    smallest index) and moves the receiver's whole deficit; at most ``R - 1`` rounds, and each
    receiver is filled by exactly one donor.
    """
    ranks = len(load)
    balance = [load[r] - capacity[r] for r in range(ranks)]
    quotas = [[0] * ranks for _ in range(ranks)]
    for _ in range(ranks):
        donor, receiver = _first_argmax(balance), _first_argmin(balance)
        if balance[donor] <= 0:
            break
        moved = -balance[receiver]
        quotas[donor][receiver] = moved
        balance[donor] -= moved
        balance[receiver] = 0
    if any(balance):
        raise AssertionError(f"balancer did not converge: balances {balance}")
    return quotas


def split_quotas(counts: list[int], quotas: list[list[int]], experts_per_rank: int) -> list[list[int]]:
    """Step B: which of each donor's experts fill its quotas.

    For each donor, the receiver with the largest remaining quota (ties: smallest rank) takes rows
    from the donor's hottest remaining home expert (ties: smallest id), as many as both allow.

    Args:
        counts: ``[E]`` global rows per expert.
        quotas: ``[R][R]`` from :func:`rank_quotas`.

    Returns:
        ``alloc[e][d]`` as nested lists ``[E][R]``.
    """
    ranks = len(quotas)
    alloc = [[0] * ranks for _ in counts]
    for expert, count in enumerate(counts):
        alloc[expert][expert // experts_per_rank] = count
    for donor in range(ranks):
        first = donor * experts_per_rank
        remaining = counts[first : first + experts_per_rank]
        quota = list(quotas[donor])
        while True:
            receiver = _first_argmax(quota)
            if quota[receiver] <= 0:
                break
            local = _first_argmax(remaining)
            take = min(remaining[local], quota[receiver])
            if take <= 0:
                raise AssertionError(f"donor {donor} ran out of rows with quotas {quota}")
            alloc[first + local][receiver] += take
            alloc[first + local][donor] -= take
            remaining[local] -= take
            quota[receiver] -= take
    return alloc


def allocate(
    tokens_per_expert: torch.Tensor,
    experts_per_rank: int,
    top_k: int,
    total_tokens: int,
    policy: str,
    limit: int | None = None,
) -> torch.Tensor:
    """Rows of each expert computed on each rank.

    Args:
        tokens_per_expert: ``[R, E]`` integer histogram gathered from every rank.
        experts_per_rank: ``epn``.
        top_k: ``K``.
        total_tokens: tokens over the group ``T`` (sets the capacities of ``exact``).
        policy: ``exact``, ``bounded`` or ``none``.
        limit: under ``exact``, leave the step unbalanced if no rank's load exceeds this many rows
            (default: ``floor(T*K/R)``, i.e. balance every uneven step); under ``bounded``, the
            bound ``b`` (default ``ceil(T*K/R)``).

    Returns:
        ``alloc [E, R] int64`` on the CPU; column sums equal ``cap`` under ``exact`` when the step
        is rebalanced, the :func:`bounded_targets` under ``bounded``.
    """
    check_policy(policy)
    ranks = tokens_per_expert.shape[0]
    counts = tokens_per_expert.sum(0).tolist()
    load = [sum(counts[r * experts_per_rank : (r + 1) * experts_per_rank]) for r in range(ranks)]
    entries = total_tokens * top_k
    if limit is None:
        limit = entries // ranks if policy == "exact" else -(-entries // ranks)
    if policy == "none" or max(load) <= limit:
        alloc = [[0] * ranks for _ in counts]
        for expert, count in enumerate(counts):
            alloc[expert][expert // experts_per_rank] = count
        return torch.tensor(alloc, dtype=torch.int64).view(len(counts), ranks)
    targets = rank_capacities(total_tokens, top_k, ranks) if policy == "exact" else bounded_targets(load, limit)
    quotas = rank_quotas(load, targets)
    alloc = split_quotas(counts, quotas, experts_per_rank)
    return torch.tensor(alloc, dtype=torch.int64).view(len(counts), ranks)
