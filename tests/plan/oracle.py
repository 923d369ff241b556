"""A literal, loop-by-loop transcription of MoonEP's planner (Kimi-K3 technical report, §5.2.1).

Test-only and slow (Python loops over entries and rows); used as an independent oracle for the
vectorised reference planner. Duplicate encoding is not part of FlatEP's plan and is left out.
It computes its own imbalance bound (exact rationals, not the config's integer formula) and the
``bounded`` targets by handing the surplus out one row at a time to the least loaded rank.
"""
from __future__ import annotations

import math
from fractions import Fraction


def oracle_bound(entries, ranks, tolerance):
    """``floor((1 + t) * entries / R)`` with ``t`` the tolerance rounded to a multiple of 2**-20."""
    fixed = Fraction(round(tolerance * 2**20), 2**20)
    return math.floor((1 + fixed) * Fraction(entries, ranks))


def oracle_targets(load, bound):
    """Bounded targets: overloaded ranks drop to ``bound``; their surplus goes one row at a time
    to the rank with the fewest rows (ties: smallest index) among those below ``bound``."""
    targets = [min(value, bound) for value in load]
    for _ in range(sum(load) - sum(targets)):
        open_ranks = [r for r in range(len(load)) if targets[r] < bound]
        r = min(open_ranks, key=lambda i: (targets[i], i))
        targets[r] += 1
    return targets


def oracle_plan(topk, tokens, ranks, experts, top_k, align, policy="exact", tolerance=0.0):
    """topk: nested lists [R][s][K]; tokens: [R] real tokens per rank; tolerance: FlatEP's
    tolerance (``exact``: no rebalancing while the busiest rank has at most ``(1+t)*mean`` rows;
    ``bounded``: at most ``max(ceil(mean), floor((1+t)*mean))`` rows per rank).

    Returns dict with dest (list per rank of (rank, row) per flat entry, None if padded),
    offsets [R][2epn], padding [R][2epn][2], slots [R][epn], received [R].

    ``align`` is the largest group padding: a step pads to the smallest power of two at or above
    its mean rows per expert, at least 16 and at most ``align``.
    """
    epn = experts // ranks
    mean_rows = -(-sum(tokens) * top_k // experts)
    step_align = min(16, align)
    while step_align < min(mean_rows, align):
        step_align *= 2
    align = min(step_align, align)
    tpe = [[0] * experts for _ in range(ranks)]
    flat = []
    for r in range(ranks):
        entries = [topk[r][t][k] if t < tokens[r] else None for t in range(len(topk[r])) for k in range(top_k)]
        flat.append(entries)
        for e in entries:
            if e is not None:
                tpe[r][e] += 1
    cum = [[sum(tpe[q][e] for q in range(r + 1)) for e in range(experts)] for r in range(ranks)]
    cnt = cum[ranks - 1]
    load = [sum(cnt[h * epn + j] for j in range(epn)) for h in range(ranks)]
    total = sum(tokens) * top_k
    cap = [total // ranks + (1 if d < total % ranks else 0) for d in range(ranks)]
    alloc = [[cnt[e] if d == e // epn else 0 for d in range(ranks)] for e in range(experts)]
    limit = oracle_bound(total, ranks, tolerance)
    if policy == "bounded":
        limit = max(limit, -(-total // ranks))
        cap = oracle_targets(load, limit)
    if policy in ("exact", "bounded") and max(load) > limit:
        bal = [load[h] - cap[h] for h in range(ranks)]
        z = [[0] * ranks for _ in range(ranks)]
        while True:
            h = max(range(ranks), key=lambda i: (bal[i], -i))
            u = min(range(ranks), key=lambda i: (bal[i], i))
            if bal[h] <= 0:
                break
            m = -bal[u]
            z[h][u] = m
            bal[h] -= m
            bal[u] = 0
        for h in range(ranks):
            remaining = [cnt[h * epn + j] for j in range(epn)]
            q = list(z[h])
            while True:
                d = max(range(ranks), key=lambda i: (q[i], -i))
                if q[d] <= 0:
                    break
                j = max(range(epn), key=lambda i: (remaining[i], -i))
                take = min(remaining[j], q[d])
                alloc[h * epn + j][d] += take
                alloc[h * epn + j][h] -= take
                remaining[j] -= take
                q[d] -= take
    seg_start = {}
    offsets, padding, slots = [], [], []
    for d in range(ranks):
        foreign = [e for e in range(experts) if alloc[e][d] > 0 and e // epn != d]
        slots.append(foreign + [-1] * (epn - len(foreign)))
        groups = list(range(d * epn, d * epn + epn)) + slots[d]
        row, offs, pads = 0, [], []
        for e in groups:
            c = alloc[e][d] if e >= 0 else 0
            p = -(-c // align) * align if c > 0 else 0
            if c > 0:
                seg_start[(d, e)] = row
            pads.append([row + c, p - c] if p > c else [0, 0])
            row += p
            offs.append(row)
        offsets.append(offs)
        padding.append(pads)
    acum = [[sum(alloc[e][q] for q in range(d + 1)) for d in range(ranks)] for e in range(experts)]
    dest = []
    for r in range(ranks):
        seen = [0] * experts
        out = []
        for e in flat[r]:
            if e is None:
                out.append(None)
                continue
            g = (cum[r - 1][e] if r > 0 else 0) + seen[e]
            seen[e] += 1
            d = next(d for d in range(ranks) if acum[e][d] > g)
            out.append((d, seg_start[(d, e)] + g - (acum[e][d - 1] if d > 0 else 0)))
        dest.append(out)
    received = [sum(alloc[e][d] for e in range(experts)) for d in range(ranks)]
    lent = [sum(1 for e in range(h * epn, (h + 1) * epn) for d in range(ranks) if d != h and alloc[e][d] > 0)
            for h in range(ranks)]
    return {"dest": dest, "offsets": offsets, "padding": padding, "slots": slots, "received": received,
            "alloc": alloc, "lent": lent}
