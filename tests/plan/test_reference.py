"""The reference planner against a literal oracle and the guarantees of DESIGN.md."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from flatep import EPConfig
from flatep.plan import make_plan, plan_rank
from flatep.plan.policy import bounded_targets
from flatep.routing import ADVERSARIAL, adversarial_topk, skewed_topk
from tests.plan.cases import padded_ids, planner_cases
from tests.plan.oracle import oracle_bound, oracle_plan, oracle_targets


def check_against_oracle(ids: torch.Tensor, config: EPConfig, policy: str, tokens: list[int] | None) -> None:
    plan = make_plan(ids, config, policy, tokens)
    counts = tokens or [ids.shape[1]] * config.ranks
    expected = oracle_plan(ids.tolist(), counts, config.ranks, config.experts, config.top_k, config.align, policy,
                           config.tolerance)
    assert plan.alloc.tolist() == expected["alloc"]
    assert plan.offsets.tolist() == expected["offsets"]
    assert plan.padding.tolist() == expected["padding"]
    assert plan.slot_experts.tolist() == expected["slots"]
    assert plan.received.tolist() == expected["received"]
    for rank in range(config.ranks):
        got = [
            None if d < 0 else (d, row)
            for d, row in zip(plan.dest_rank[rank].reshape(-1).tolist(), plan.dest_row[rank].reshape(-1).tolist())
        ]
        assert got == expected["dest"][rank]


def check_guarantees(plan, ids: torch.Tensor, config: EPConfig, tokens: list[int] | None) -> None:
    """Every guarantee of DESIGN.md that a plan alone can show."""
    ranks, epn, align = config.ranks, config.experts_per_rank, config.step_align(plan.total_tokens)
    counts = tokens or [ids.shape[1]] * ranks
    total = sum(counts) * config.top_k
    valid = plan.dest_rank >= 0
    # Conservation: each real entry lands in exactly one row; rows never collide.
    assert int(valid.sum()) == total
    flat_rows = (plan.dest_rank.long() * plan.shard_rows + plan.dest_row.long())[valid]
    assert flat_rows.unique().numel() == total
    received = torch.bincount(plan.dest_rank[valid].long(), minlength=ranks)
    assert received.tolist() == plan.received.tolist()
    load = plan.tokens_per_expert.sum(0).view(ranks, epn).sum(1)
    limit = oracle_bound(total, ranks, config.tolerance)
    if plan.policy == "bounded":
        limit = max(limit, -(-total // ranks))
    if plan.policy != "none" and int(load.max()) <= limit:
        # Within the bound: nothing moves, every rank computes its own load.
        assert bool((plan.slot_experts == -1).all()) and plan.received.tolist() == load.tolist()
    elif plan.policy != "none":
        if plan.policy == "exact":
            cap = [total // ranks + (1 if d < total % ranks else 0) for d in range(ranks)]
        else:
            cap = oracle_targets(load.tolist(), limit)
            assert max(cap) <= limit
        assert plan.received.tolist() == cap  # flat, or bounded
        for d in range(ranks):
            borrowed = [e for e in plan.slot_experts[d].tolist() if e >= 0]
            assert len(borrowed) <= epn
            assert borrowed == sorted(borrowed)
            assert all(e // epn != d for e in borrowed)
            assert len({e // epn for e in borrowed}) <= 1  # one donor per receiver
    else:
        assert bool((plan.slot_experts == -1).all())
    # Rows per rank within the shard sizing of the policy.
    assert int(plan.received.max()) <= config.step_rows(ranks * ids.shape[1], plan.policy)
    # Groups: offsets monotone, non-empty segments multiples of align, within the shard.
    offsets = plan.offsets.long()
    lengths = torch.diff(offsets, dim=1, prepend=torch.zeros(ranks, 1, dtype=torch.long))
    assert bool((lengths >= 0).all()) and bool((lengths % align == 0).all())
    assert bool((offsets[:, -1] <= plan.shard_rows).all())
    assert int((lengths > 0).sum(1).max()) <= 2 * epn
    # Every entry sits inside its expert's group, among the real rows.
    group_of_entry = plan.group_experts[plan.dest_rank.long().clamp_min(0)]  # [R, s, K, 2epn]
    match = group_of_entry == ids.unsqueeze(-1).to(group_of_entry)
    group_index = match.int().argmax(-1)
    assert bool(match.any(-1)[valid].all())
    ends = offsets[plan.dest_rank.long().clamp_min(0)].gather(-1, group_index.unsqueeze(-1).long()).squeeze(-1)
    starts = ends - lengths[plan.dest_rank.long().clamp_min(0)].gather(-1, group_index.unsqueeze(-1).long()).squeeze(-1)
    rows = plan.dest_row.long()
    assert bool(((rows >= starts) & (rows < ends))[valid].all())
    # Padding: real rows then zero rows fill each group exactly.
    for d in range(ranks):
        for g in range(2 * epn):
            start, count = plan.padding[d, g].tolist()
            length = int(lengths[d, g])
            if count:
                assert start + count == int(offsets[d, g]) and count < align
            real_rows = length - count
            expert = int(plan.group_experts[d, g])
            assert real_rows == (int(plan.alloc[expert, d]) if expert >= 0 else 0) or length == 0
    # Determinism.
    again = make_plan(ids, config, plan.policy, tokens)
    for name, tensor in plan.tensors().items():
        assert torch.equal(tensor, getattr(again, name)), name


@settings(max_examples=150, deadline=None)
@given(planner_cases())
def test_reference_equals_oracle_and_keeps_guarantees(case):
    ids, config, policy, tokens = case
    check_against_oracle(ids, config, policy, tokens)
    check_guarantees(make_plan(ids, config, policy, tokens), ids, config, tokens)


def test_worked_example_from_the_design_notes():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=4, align=4)
    ids = torch.tensor([[[2, 3], [2, 0], [3, 2], [2, 1]], [[2, 3], [3, 2], [2, 0], [1, 2]]], dtype=torch.int32)
    plan = make_plan(ids, config)
    assert plan.offsets.tolist() == [[4, 8, 12, 12], [4, 8, 8, 8]]
    assert plan.padding.tolist() == [[[2, 2], [6, 2], [0, 0], [0, 0]], [[0, 0]] * 4]
    assert plan.slot_experts.tolist() == [[2, -1], [-1, -1]]
    raw = (plan.dest_rank * plan.shard_rows + plan.dest_row).view(2, -1)
    assert plan.shard_rows == 20
    assert raw.tolist() == [[8, 24, 9, 0, 25, 10, 11, 4], [20, 26, 27, 21, 22, 1, 5, 23]]


@pytest.mark.parametrize("kind", ADVERSARIAL)
@pytest.mark.parametrize("policy, tolerance", [("exact", 0.0), ("none", 0.0), ("bounded", 0.0), ("bounded", 0.3)])
def test_adversarial_routings_at_moderate_size(kind, policy, tolerance):
    config = EPConfig(ranks=8, experts=64, top_k=8, hidden=8, intermediate=8, capacity=64, align=16, tolerance=tolerance)
    ids = adversarial_topk(kind, 8, 64, 8, 64)
    check_guarantees(make_plan(ids, config, policy), ids, config, None)


def test_one_expert_taking_everything_is_spread_over_all_ranks():
    config = EPConfig(ranks=4, experts=8, top_k=1, hidden=8, intermediate=8, capacity=16, align=1)
    ids = torch.zeros(4, 16, 1, dtype=torch.int32)
    plan = make_plan(ids, config)
    assert plan.received.tolist() == [16, 16, 16, 16]
    assert plan.slot_experts[:, 0].tolist() == [-1, 0, 0, 0]
    classic = make_plan(ids, config, "none")
    assert classic.received.tolist() == [64, 0, 0, 0]


def test_plan_rank_matches_make_plan_for_every_rank():
    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=8, intermediate=8, capacity=32, align=8)
    ids = skewed_topk(4, 16, 4, 20, sigma=2.0, seed=7)
    tokens = [20, 5, 0, 17]
    ids = padded_ids(ids, tokens)
    for policy in ("exact", "none"):
        plan = make_plan(ids, config, policy, tokens)
        for rank in range(4):
            mine = plan_rank(rank, ids[rank], plan.tokens_per_expert, config, policy, total_tokens=sum(tokens), tokens=tokens[rank])
            assert torch.equal(mine.dest_rank, plan.dest_rank[rank])
            assert torch.equal(mine.dest_row, plan.dest_row[rank])
            assert torch.equal(mine.offsets, plan.offsets)


def test_plan_rank_rejects_disagreeing_token_counts():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=8)
    ids = skewed_topk(2, 4, 2, 8, 1.0)
    plan = make_plan(ids, config)
    with pytest.raises(ValueError, match="disagree"):
        plan_rank(0, ids[0], plan.tokens_per_expert, config, total_tokens=12)
    with pytest.raises(ValueError, match="does not match"):
        plan_rank(1, ids[0], plan.tokens_per_expert, config)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda ids: ids.view(1, *ids.shape), "shape"),
        (lambda ids: ids.float(), "int32 or int64"),
        (lambda ids: ids.fill_(4), r"not an expert id in \[0, 4\)"),
        (lambda ids: ids.fill_(-1), "not an expert id"),
        (lambda ids: ids.repeat(1, 3, 1), "capacity"),
    ],
)
def test_bad_input_is_rejected_before_planning(mutate, message):
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=4)
    ids = skewed_topk(2, 4, 2, 4, 1.0)
    with pytest.raises(ValueError, match=message):
        make_plan(mutate(ids.clone()), config)


def test_bad_policy_and_token_counts():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=8, intermediate=8, capacity=4)
    ids = skewed_topk(2, 4, 2, 4, 1.0)
    with pytest.raises(ValueError, match="policy must be one of"):
        make_plan(ids, config, "greedy")
    with pytest.raises(ValueError, match="tokens must hold 2 counts"):
        make_plan(ids, config, tokens=[5, 1])
    with pytest.raises(ValueError, match="positive sum"):
        make_plan(ids, config, tokens=[0, 0])


@pytest.mark.parametrize(
    "load, bound, expected",
    [
        ([10, 0, 0, 2], 4, [4, 3, 3, 2]),  # X = 6 = fill(3): ranks 1, 2 rise to level 3
        ([10, 1, 3, 0], 4, [4, 4, 3, 3]),  # fill(3) = 5 <= 6 < fill(4): one row left -> rank 1 first
        ([9, 0, 0, 0], 3, [3, 2, 2, 2]),  # X = 6 = fill(2): nothing left over
        ([5, 5, 1, 1], 5, [5, 5, 1, 1]),  # nobody above the bound: nothing moves
        ([8, 1, 2, 1], 3, [3, 3, 3, 3]),  # the level reaches the bound
        ([12, 0, 0], 4, [4, 4, 4]),  # R*b = T*K: everybody ends at the bound
        ([6, 6, 0, 0], 5, [5, 5, 1, 1]),  # two donors
    ],
)
def test_bounded_targets_water_fill(load, bound, expected):
    assert bounded_targets(load, bound) == expected == oracle_targets(load, bound)


def test_bounded_targets_reject_a_bound_below_the_mean():
    with pytest.raises(ValueError, match="bound must be >= ceil"):
        bounded_targets([5, 0], 2)


def test_bounded_moves_only_the_surplus():
    config = EPConfig(ranks=4, experts=8, top_k=1, hidden=8, intermediate=8, capacity=16, align=1, tolerance=0.25)
    ids = torch.zeros(4, 16, 1, dtype=torch.int32)  # all 64 rows on expert 0 (rank 0)
    assert config.bounded_rows(64) == 20
    plan = make_plan(ids, config, "bounded")
    assert plan.received.tolist() == [20, 15, 15, 14]
    assert plan.alloc[0].tolist() == [20, 15, 15, 14]
    assert make_plan(ids, config, "exact").received.tolist() == [16, 16, 16, 16]


def test_bounded_within_the_bound_equals_classic():
    config = EPConfig(ranks=4, experts=8, top_k=1, hidden=8, intermediate=8, capacity=16, align=1, tolerance=0.25)
    ids = (torch.arange(64) % 8).view(4, 16, 1).int()  # 16 rows homed on each rank ...
    ids[0, 2:6] = 0  # ... then rank 0 takes 4 more (20 = the bound): loads [20, 14, 14, 16]
    none, bounded = make_plan(ids, config, "none"), make_plan(ids, config, "bounded")
    assert none.received.tolist()[0] == 20
    for name, tensor in none.tensors().items():
        assert torch.equal(tensor, getattr(bounded, name)), name
    ids[1, 2] = 0  # loads [21, 13, 14, 16]: the one row above the bound fills rank 1 to level 14
    assert make_plan(ids, config, "bounded").received.tolist() == [20, 14, 14, 16]
