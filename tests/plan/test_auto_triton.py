"""policy="auto" on the Triton planners: bit-equal to the reference, the choice made on the device.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py) on small shapes; with one,
a CUDA graph captured once replays the decision for routings that flip it.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flatep.plan.triton as planner
from flatep import CostProfile, EPConfig
from flatep.plan import make_plan, plan_rank
from flatep.plan.auto import CANDIDATES
from flatep.plan.triton import make_plan_triton, plan_rank_triton
from flatep.routing import skewed_topk
from tests.plan.cases import planner_cases

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PROFILES = {
    "rows_only": CostProfile(link_gbps=1e12, hbm_gbps=1e12, gemm_tflops=1.0, group_us=1e-12, push_us=1e-12, tile_rows=1),
    "no_link": CostProfile(link_gbps=1e-9, hbm_gbps=3000.0, gemm_tflops=600.0, group_us=2.0, push_us=20.0, tile_rows=128),
    "generic": CostProfile.default(),
    "margins": CostProfile(link_gbps=1e12, hbm_gbps=1e12, gemm_tflops=1.0, group_us=1e-12, push_us=1e-12, tile_rows=1,
                           margins=((1, 0.1), (4, 0.02))),
}


def assert_same(expected, got) -> None:
    for name in ("policy", "shard_rows", "slot_rows", "total_tokens"):
        assert getattr(got, name) == getattr(expected, name), name
    for name, tensor in expected.tensors().items():
        assert torch.equal(getattr(got, name), tensor.to(DEVICE)), name
    assert torch.equal(got.auto.choice.cpu(), expected.auto.choice)
    for name in ("rank_fs", "layer_fs", "experts_moved", "bytes_moved"):
        assert torch.equal(getattr(got.auto.prediction, name).cpu(), getattr(expected.auto.prediction, name)), name


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(planner_cases(ranks=(1, 2, 4), experts_per_rank=(1, 2), max_top_k=4, max_tokens=12), st.sampled_from(sorted(PROFILES)))
def test_triton_auto_equals_reference(case, profile):
    ids, config, _, tokens = case
    cost = PROFILES[profile]
    expected = make_plan(ids, config, "auto", tokens, cost=cost)
    assert_same(expected, make_plan_triton(ids.to(DEVICE), config, "auto", tokens, cost=cost))
    total = sum(tokens) if tokens else None
    rank = config.ranks - 1
    own = tokens[rank] if tokens else None
    reference = plan_rank(rank, ids[rank], expected.tokens_per_expert, config, "auto", total, own, cost=cost)
    got = plan_rank_triton(rank, ids[rank].to(DEVICE), expected.tokens_per_expert.to(DEVICE), config, "auto", total, own,
                           cost=cost)
    assert_same(reference, got)


def test_rank_auto_with_several_count_segments(monkeypatch):
    """A rank's count spans several segments (counted, then scanned, before the candidates' layouts)."""
    monkeypatch.setattr(planner, "_tile_size", lambda entries: 4)
    ranks, experts, top_k, step = 4, 8, 2, 9
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=4, capacity=step, align=4)
    ids = skewed_topk(ranks, experts, top_k, step, 2.0, seed=5)
    cost = PROFILES["rows_only"]
    expected = make_plan(ids, config, "auto", cost=cost)
    reference = plan_rank(2, ids[2], expected.tokens_per_expert, config, "auto", cost=cost)
    counts = planner.count_rank_triton(ids[2].to(DEVICE), experts)
    assert counts.segment_prefix.shape[0] > 1
    got = plan_rank_triton(2, ids[2].to(DEVICE), expected.tokens_per_expert.to(DEVICE), config, "auto", cost=cost,
                           counts=counts)
    assert_same(reference, got)
    assert len(got.auto.candidates) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graph_replays_the_decision_for_routings_that_flip_it():
    config = EPConfig(ranks=8, experts=64, top_k=8, hidden=7168, intermediate=2048, capacity=1024, align=128)
    cost = CostProfile.preset("h200")
    balanced = skewed_topk(8, 64, 8, 1024, 0.0, seed=0).to(DEVICE)
    skewed = skewed_topk(8, 64, 8, 1024, 3.0, seed=0).to(DEVICE)
    ids = balanced.clone()
    make_plan_triton(ids, config, "auto", cost=cost)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = make_plan_triton(ids, config, "auto", cost=cost)
    choices = set()
    for routing in (balanced, skewed, balanced):
        ids.copy_(routing)
        graph.replay()
        eager = make_plan_triton(routing, config, "auto", cost=cost)
        assert torch.equal(plan.auto.choice, eager.auto.choice)
        for name, tensor in eager.tensors().items():
            assert torch.equal(getattr(plan, name), tensor), name
        choices.add(CANDIDATES[int(plan.auto.choice)].policy)
    assert len(choices) > 1, f"the routings did not flip the decision: {choices}"
