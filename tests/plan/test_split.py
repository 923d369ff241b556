"""The split layout: slot groups moved to a fixed row, every other fact of the plan unchanged."""
from __future__ import annotations

import torch
from hypothesis import given, settings

from flatep.plan.reference import make_plan
from flatep.plan.split import split_slot_rows
from tests.plan.cases import planner_cases


def group_ranges(plan, rank: int) -> list[tuple[int, int]]:
    """``[(first, end)]`` rows of each group of ``rank`` in the split layout."""
    epn = plan.slot_experts.shape[1]
    ends = plan.offsets[rank].tolist()
    ranges, first = [], 0
    for group, end in enumerate(ends):
        if group == epn:
            first = plan.slot_base
        ranges.append((first, end))
        first = end
    return ranges


@settings(max_examples=150, deadline=None)
@given(planner_cases())
def test_split_moves_only_slot_rows_and_keeps_every_group_intact(case):
    ids, config, policy, tokens = case
    plan = make_plan(ids, config, policy, tokens)
    split = split_slot_rows(plan)
    assert split_slot_rows(split) is split
    assert torch.equal(split.padded_rows(), plan.offsets[:, -1])
    if policy == "none":
        assert split is plan
        return
    epn = config.experts_per_rank
    assert split.slot_base == plan.shard_rows and split.shard_rows == 2 * plan.shard_rows
    for name in ("tokens_per_expert", "alloc", "slot_experts", "group_experts", "received"):
        assert torch.equal(getattr(split, name), getattr(plan, name)), name
    valid = split.dest_rank >= 0
    assert torch.equal(split.dest_rank, plan.dest_rank)
    rows = split.dest_row[valid].long()
    ranks = split.dest_rank[valid].long()
    assert bool((rows < split.shard_rows).all())
    assert (ranks * split.shard_rows + rows).unique().numel() == rows.numel(), "two entries share a row"
    # An entry lands in the slot half exactly when its expert is borrowed (not homed on the receiver).
    borrowed = ids[valid].long() // epn != ranks
    assert torch.equal(rows >= split.slot_base, borrowed)
    for rank in range(config.ranks):
        ranges = group_ranges(split, rank)
        assert all(end <= split.slot_base for _, end in ranges[:epn])
        for group, (first, end) in enumerate(ranges):
            expert = int(split.group_experts[rank, group])
            assert end - first == (int(plan.offsets[rank, group]) - (int(plan.offsets[rank, group - 1]) if group else 0))
            if expert < 0:
                continue
            if end > first:  # an empty home group has no start
                assert int(split.group_start[rank, expert]) == first
            # The group's entries fill its first rows; its padding (if any) the rest.
            mine = (ranks == rank) & (ids[valid].long() == expert)
            count = int(mine.sum())
            assert sorted(rows[mine].tolist()) == list(range(first, first + count))
            start, pad = split.padding[rank, group].tolist()
            assert pad == end - first - count and (pad == 0 or start == first + count)


@settings(max_examples=40, deadline=None)
@given(planner_cases())
def test_active_groups_counts_the_groups_with_rows_in_both_layouts(case):
    ids, config, policy, tokens = case
    plan = make_plan(ids, config, policy, tokens)
    split = split_slot_rows(plan)
    if split.slot_base:
        expected = [sum(end > first for first, end in group_ranges(split, rank)) for rank in range(config.ranks)]
    else:  # classic: one run of groups, each starting where the previous one ends
        expected = [sum(end > first for first, end in zip([0] + ends[:-1], ends)) for ends in split.offsets.tolist()]
    assert split.active_groups().tolist() == expected
    assert plan.active_groups().tolist() == expected


@settings(max_examples=40, deadline=None)
@given(planner_cases())
def test_the_one_launch_split_equals_the_torch_ops(case):
    """The Triton rewrite (CUDA, or the interpreter) writes the same tables as the torch ops, for
    group plans and for one rank's plan."""
    from flatep.kernels.backend import use_triton
    from flatep.plan.reference import plan_rank
    from flatep.plan.split import _split_torch, _split_triton

    ids, config, policy, tokens = case
    if not use_triton(ids.device) or policy == "none":
        return
    plan = make_plan(ids, config, policy, tokens)
    last = config.ranks - 1
    counts = [ids.shape[1]] * config.ranks if tokens is None else list(tokens)
    rank_plan = plan_rank(last, ids[last], plan.tokens_per_expert, config, policy, total_tokens=sum(counts),
                          tokens=counts[last])
    for layout in (plan, rank_plan):
        expected, got = _split_torch(layout, layout.shard_rows), _split_triton(layout, layout.shard_rows)
        assert expected.keys() == got.keys() and "dest_row" in got
        for name in expected:
            assert torch.equal(expected[name], got[name]), name
