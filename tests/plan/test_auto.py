"""policy="auto": the plan of the cheapest candidate by the cost model, chosen on the device."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatep import CostProfile, EPConfig
from flatep.plan import make_plan, plan_rank, split_slot_rows
from flatep.plan.auto import CANDIDATES, candidates_for, moving_never_pays
from flatep.plan.cost import predict
from flatep.routing import skewed_topk
from tests.plan.cases import planner_cases

# Infinitely fast link, weights read for free, no per-group or push overhead: rows-only GEMM cost.
ROWS_ONLY = CostProfile(link_gbps=1e12, hbm_gbps=1e12, gemm_tflops=1.0, group_us=1e-12, push_us=1e-12, tile_rows=1)
# A link of ~0 bandwidth.
NO_LINK = CostProfile(link_gbps=1e-9, hbm_gbps=3000.0, gemm_tflops=600.0, group_us=2.0, push_us=20.0, tile_rows=128)
# The generic profile with decision margins: a moving candidate must win by 3-20%.
MARGINS = dataclasses.replace(CostProfile.default(), margins=((1, 0.2), (8, 0.03)), name="margins")


def candidate_plans(ids, config, tokens):
    return [make_plan(ids, candidate.config(config), candidate.policy, tokens) for candidate in CANDIDATES]


def check_structure(plan, ids, config, tokens):
    """The plan guarantees that do not depend on the policy."""
    ranks, epn, align = config.ranks, config.experts_per_rank, config.step_align(plan.total_tokens)
    counts = tokens or [ids.shape[1]] * ranks
    total = sum(counts) * config.top_k
    valid = plan.dest_rank >= 0
    assert int(valid.sum()) == total
    flat_rows = (plan.dest_rank.long() * plan.shard_rows + plan.dest_row.long())[valid]
    assert flat_rows.unique().numel() == total
    assert torch.bincount(plan.dest_rank[valid].long(), minlength=ranks).tolist() == plan.received.tolist()
    assert plan.alloc.sum(0).tolist() == plan.received.tolist()
    assert plan.alloc.sum(1).tolist() == plan.tokens_per_expert.sum(0).tolist()
    for d in range(ranks):
        borrowed = [e for e in plan.slot_experts[d].tolist() if e >= 0]
        assert len(borrowed) <= epn and borrowed == sorted(borrowed)
        assert all(e // epn != d for e in borrowed) and len({e // epn for e in borrowed}) <= 1
    offsets = plan.offsets.long()
    lengths = torch.diff(offsets, dim=1, prepend=torch.zeros(ranks, 1, dtype=torch.long))
    assert bool((lengths >= 0).all()) and bool((lengths % align == 0).all())
    assert bool((offsets[:, epn - 1] <= plan.shard_rows).all())
    group_of_entry = plan.group_experts[plan.dest_rank.long().clamp_min(0)]  # [R, s, K, 2epn]
    assert bool((group_of_entry == ids.unsqueeze(-1).to(group_of_entry)).any(-1)[valid].all())


@settings(max_examples=40, deadline=None)
@given(planner_cases(max_tokens=16), st.sampled_from(["generic", "h200", "rows_only", "no_link", "margins"]))
def test_auto_is_the_first_cheapest_candidate_and_keeps_the_guarantees(case, profile_name):
    ids, config, _, tokens = case
    cost = {"rows_only": ROWS_ONLY, "no_link": NO_LINK, "margins": MARGINS}.get(profile_name) or CostProfile.preset(profile_name)
    plan = make_plan(ids, config, "auto", tokens, cost=cost)
    plans = candidate_plans(ids, config, tokens)
    constants = cost.constants(config, total_tokens=plan.total_tokens)  # the decode fields where they apply
    layer = [int(predict(p.tokens_per_expert, p.alloc.unsqueeze(0), constants).layer_fs) for p in plans]
    # A candidate that moves experts is charged the margin, a fraction of classic's time.
    penalty = layer[0] // 10**6 * constants.margin_ppm
    scores = [time + (penalty if bool((p.slot_experts >= 0).any()) else 0) for time, p in zip(layer, plans)]
    choice = int(plan.auto.choice)
    assert choice == scores.index(min(scores))
    planned = len(candidates_for(config, cost, plan.total_tokens))
    # Pruned (moving_never_pays): classic alone was planned, and it is the cheapest of all.
    assert plan.policy == "auto" and plan.auto.prediction.layer_fs.tolist() == layer[:planned]
    chosen = plans[choice]
    for name, tensor in chosen.tensors().items():
        assert torch.equal(getattr(plan, name), tensor), name
    check_structure(plan, ids, config, tokens)
    check_structure(split_slot_rows(plan), ids, config, tokens)
    report = plan.auto.report()
    assert report["choice"] == CANDIDATES[choice].label()
    assert report["experts_moved"] == int((plan.slot_experts >= 0).sum())


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([2, 4]), st.integers(0, 2**16), st.sampled_from([1.0, 2.0, 4.0]))
def test_rows_only_cost_chooses_the_flat_plan(ranks, seed, sigma):
    config = EPConfig(ranks=ranks, experts=4 * ranks, top_k=2, hidden=8, intermediate=8, capacity=256, align=1)
    ids = skewed_topk(ranks, config.experts, 2, 256, sigma, seed=seed)
    plan = make_plan(ids, config, "auto", cost=ROWS_ONLY)
    exact = make_plan(ids, config, "exact")
    busiest = [int(p.received.max()) for p in candidate_plans(ids, config, None)]
    # The flat plan has the least busiest-rank rows there is: ceil(T*K/R).
    assert int(plan.received.max()) == int(exact.received.max()) == -(-ranks * 256 * 2 // ranks)
    if all(rows > busiest[-1] for rows in busiest[:-1]):
        assert CANDIDATES[int(plan.auto.choice)].policy == "exact"


@pytest.mark.parametrize("seed", range(4))
def test_a_moving_plan_must_beat_classic_by_the_margin(seed):
    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=8, intermediate=8, capacity=256, align=1)
    ids = skewed_topk(4, config.experts, 2, 256, 2.0, seed=seed)
    plain = make_plan(ids, config, "auto", cost=ROWS_ONLY)
    layer = plain.auto.prediction.layer_fs.tolist()
    best = int(plain.auto.choice)
    assert best != 0, "the skewed routing must make moving pay under rows-only costs"
    saving = 1 - layer[best] / layer[0]
    # The step holds 4*256*2/16 = 128 rows per expert (beyond the decode regime), where the margin
    # measured at 128 rows applies. Just inside the best saving it still moves; just beyond it
    # classic wins (no candidate saves more).
    for margin, expected in ((saving * 0.9, best), (saving * 1.1, 0)):
        plan = make_plan(ids, config, "auto", cost=dataclasses.replace(ROWS_ONLY, margins=((128.0, margin),)))
        assert plan.auto.prediction.layer_fs.tolist() == layer  # the margin changes the choice, not the model
        assert int(plan.auto.choice) == expected
        assert plan.auto.report()["margin"] == pytest.approx(margin, abs=1e-6)  # kept in millionths


@settings(max_examples=15, deadline=None)
@given(st.sampled_from([2, 4, 8]), st.integers(1, 8), st.integers(0, 2**16), st.sampled_from([0.5, 2.0, 8.0]))
def test_a_link_of_no_bandwidth_chooses_classic(ranks, step, seed, sigma):
    # One expert's weights outweigh every row a rank can exchange (R*s*K*row_bytes): any move
    # costs a busiest rank more link time than it can save.
    config = EPConfig(ranks=ranks, experts=2 * ranks, top_k=2, hidden=64, intermediate=512, capacity=8, align=8)
    assert ranks * step * 2 * (2 * 64 * 2 + 4) < config.expert_bytes()
    ids = skewed_topk(ranks, config.experts, 2, step, sigma, seed=seed)
    plan = make_plan(ids, config, "auto", cost=NO_LINK)
    assert CANDIDATES[int(plan.auto.choice)].policy == "none"
    assert bool((plan.slot_experts == -1).all())


def test_plan_rank_equals_the_group_plan_under_auto():
    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=64, intermediate=64, capacity=32, align=4)
    ids = skewed_topk(4, 8, 2, 32, 3.0, seed=5)
    for cost in (ROWS_ONLY, NO_LINK, CostProfile.default()):
        group = make_plan(ids, config, "auto", cost=cost)
        for rank in range(4):
            mine = plan_rank(rank, ids[rank], group.tokens_per_expert, config, "auto", cost=cost)
            assert torch.equal(mine.auto.choice, group.auto.choice)
            assert torch.equal(mine.dest_row, group.dest_row[rank]) and torch.equal(mine.offsets, group.offsets)


def test_auto_shards_hold_every_candidate():
    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=8, intermediate=8, capacity=32, align=4)
    ids = skewed_topk(4, 8, 2, 32, 3.0, seed=1)
    plan = split_slot_rows(make_plan(ids, config, "auto"))
    assert plan.slot_base == config.step_rows(4 * 32, "none")
    widest = max(c.config(config).step_rows(4 * 32, c.policy) for c in CANDIDATES if c.policy != "none")
    assert plan.shard_rows == plan.slot_base + widest


def test_cost_is_for_auto_only():
    config = EPConfig(ranks=2, experts=4, top_k=1, hidden=8, intermediate=8, capacity=4)
    ids = torch.zeros(2, 4, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="cost is used by policy='auto' only"):
        make_plan(ids, config, "exact", cost=CostProfile.default())
    with pytest.raises(ValueError, match="cost must be a flatep.CostProfile"):
        make_plan(ids, config, "auto", cost={"link_gbps": 1})


@pytest.mark.parametrize("cost", [None, ROWS_ONLY, NO_LINK], ids=["default", "rows_only", "no_link"])
def test_layer_equals_dense_under_auto(cost):
    from flatep import dense_moe, ep_moe, init_group
    from tests.helpers import DEVICE, make_inputs, relative_error

    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=32, intermediate=16, capacity=16, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 16, 3.0, torch.float32, seed=2)
    with torch.no_grad():
        out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, policy="auto", cost=cost, backend="torch")
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < 1e-5


SLOW_LINK = CostProfile(link_gbps=10.0, hbm_gbps=2700.0, gemm_tflops=620.0, group_us=2.0, push_us=20.0, tile_rows=128)


@pytest.mark.parametrize("routing", ["skewed", "next"])
@pytest.mark.parametrize("seed", range(6))
def test_when_moving_never_pays_every_candidate_is_at_least_classic(routing, seed):
    """The host-side bound is safe: on every routing with distinct ids per token, no candidate the model sees beats classic."""
    from flatep.routing import adversarial_topk

    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=256, intermediate=128, capacity=8)
    tokens = 1 + seed
    assert moving_never_pays(config, SLOW_LINK, config.ranks * tokens)
    if routing == "skewed":
        ids = skewed_topk(config.ranks, config.experts, config.top_k, tokens, 3.0, seed=seed)
    else:
        ids = adversarial_topk(routing, config.ranks, config.experts, config.top_k, tokens)
    plans = candidate_plans(ids, config, None)
    layer = [int(predict(p.tokens_per_expert, p.alloc.unsqueeze(0), SLOW_LINK.constants(config)).layer_fs) for p in plans]
    assert min(layer) == layer[0], layer
    plan = make_plan(ids, config, "auto", cost=SLOW_LINK)
    assert len(plan.auto.candidates) == 1 and plan.auto.report()["choice"] == "classic"
    assert torch.equal(plan.dest_row, plans[0].dest_row) and torch.equal(plan.alloc, plans[0].alloc)


def test_moving_never_pays_at_decode_only():
    """Kimi-K2 bf16 on the H200 preset: classic alone at s=1 per rank; every candidate from s=128 on."""
    from flatep import preset

    cost = CostProfile.preset("h200")
    config = preset("kimi-k2", ranks=8, capacity=8192)
    assert moving_never_pays(config, cost, 8 * 1) and candidates_for(config, cost, 8) == CANDIDATES[:1]
    assert not moving_never_pays(config, cost, 8 * 128) and candidates_for(config, cost, 8 * 128) == CANDIDATES
