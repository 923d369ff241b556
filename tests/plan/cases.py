"""Random and adversarial planner inputs shared by the reference and Triton planner tests."""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from flatep import EPConfig
from flatep.routing import ADVERSARIAL, adversarial_topk, skewed_topk


def padded_ids(ids: torch.Tensor, tokens: list[int] | None) -> torch.Tensor:
    """``ids`` with rows ``t >= tokens[r]`` of rank ``r`` set to -1 (per-rank token counts)."""
    if tokens is None:
        return ids
    ids = ids.clone()
    for rank, count in enumerate(tokens):
        ids[rank, count:] = -1
    return ids


@st.composite
def planner_cases(draw, ranks=(1, 2, 3, 4, 8), experts_per_rank=(1, 2, 3, 8), max_top_k=8, max_tokens=24,
                  aligns=(1, 2, 4, 8, 128), sigmas=(0.0, 0.5, 1.0, 3.0, 8.0), tolerances=(0.0, 0.0, 0.0, 0.01, 0.2, 1 / 3, 1.0, 4.0)):
    """``(topk_ids [R, s, K] int32, config, policy, tokens or None)``: skewed, uniform with repeated
    ids, or adversarial routings; per-rank token counts half of the time; every policy."""
    group = draw(st.sampled_from(ranks))
    experts = group * draw(st.sampled_from(experts_per_rank))
    top_k = draw(st.integers(1, min(experts, max_top_k)))
    step = draw(st.integers(1, max_tokens))
    config = EPConfig(ranks=group, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=step,
                      align=draw(st.sampled_from(aligns)), tolerance=draw(st.sampled_from(tolerances)))
    kind = draw(st.sampled_from(["skewed", "uniform_repeats", *ADVERSARIAL]))
    seed = draw(st.integers(0, 2**16))
    if kind == "skewed":
        ids = skewed_topk(group, experts, top_k, step, draw(st.sampled_from(sigmas)), seed=seed)
    elif kind == "uniform_repeats":
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, experts, (group, step, top_k), generator=generator, dtype=torch.int32)
    else:
        ids = adversarial_topk(kind, group, experts, top_k, step)
    tokens = None
    if draw(st.booleans()):
        tokens = [draw(st.integers(0, step)) for _ in range(group)]
        if sum(tokens) == 0:
            tokens[0] = 1
    policy = draw(st.sampled_from(["exact", "none", "bounded"]))
    return padded_ids(ids, tokens), config, policy, tokens
