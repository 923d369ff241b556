"""Link bytes per rank and phase, and the link model, on hand-made routings."""
from __future__ import annotations

import pytest
import torch

import flatep
from flatep.bench.accounting import (
    entry_metadata_bytes, link_model_us, plan_link_bytes, push_tables, rank_link_bytes, rows_to_ranks,
)
from flatep.plan import plan_rank
from flatep.routing import skewed_topk

ROW = 10  # bytes of one token row in these tests
EXPERT = 1000  # bytes of one expert's weights


def _config(ranks: int, experts: int, tokens: int) -> flatep.EPConfig:
    # The per-entry baseline (dedup=False): every dispatched row carries only its route weight.
    return flatep.EPConfig(ranks=ranks, experts=experts, top_k=1, hidden=8, intermediate=8, capacity=tokens, align=1,
                           dedup=False)


def _ids(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32).unsqueeze(-1)  # [R, s, K=1]


def test_classic_plan_counts_remote_rows_and_keeps_local_rows_apart():
    # R=2, E=4: rank 0 homes experts 0-1, rank 1 homes 2-3.
    # Rank 0 sends 2 rows to rank 1 (experts 2, 3) and keeps 2; rank 1 sends 1 (expert 1), keeps 3.
    plan = flatep.make_plan(_ids([[0, 0, 2, 3], [1, 2, 2, 3]]), _config(2, 4, 4), policy="none")
    link = plan_link_bytes(plan, ROW, EXPERT)
    weighted = ROW + 4  # the fp32 route weight travels with each dispatched row
    assert link["dispatch"] == dict(egress=[2 * weighted, 1 * weighted], ingress=[1 * weighted, 2 * weighted],
                                    local=[2 * weighted, 3 * weighted])
    assert link["combine"] == dict(egress=[1 * ROW, 2 * ROW], ingress=[2 * ROW, 1 * ROW], local=[2 * ROW, 3 * ROW])
    assert link["push"] == dict(egress=[0, 0], ingress=[0, 0])
    model = link_model_us(link, link_gbps=1.0)  # 1 GB/s = 1000 bytes per µs
    assert model["dispatch"] == pytest.approx([2 * weighted / 1e3, 2 * weighted / 1e3])
    assert model["combine"] == pytest.approx([2 * ROW / 1e3, 2 * ROW / 1e3])
    assert model["total"] == pytest.approx([(2 * weighted + 2 * ROW) / 1e3] * 2)


def test_push_is_paid_by_the_donor():
    # R=4, E=4 (one expert per rank), every entry to expert 0: rank 0 lends expert 0 to ranks 1-3.
    plan = flatep.make_plan(_ids([[0, 0, 0, 0]] * 4), _config(4, 4, 4), policy="exact")
    assert plan.received.tolist() == [4, 4, 4, 4]
    link = plan_link_bytes(plan, ROW, EXPERT)
    assert link["push"] == dict(egress=[3 * EXPERT, 0, 0, 0], ingress=[0, EXPERT, EXPERT, EXPERT])
    # Oracle: a literal loop over every entry of the plan.
    sent, arrived, local = [0] * 4, [0] * 4, [0] * 4
    for source in range(4):
        for dest in plan.dest_rank[source].reshape(-1).tolist():
            if dest == source:
                local[source] += 1
            elif dest >= 0:
                sent[source] += 1
                arrived[dest] += 1
    assert link["dispatch"] == dict(egress=[n * (ROW + 4) for n in sent], ingress=[n * (ROW + 4) for n in arrived],
                                    local=[n * (ROW + 4) for n in local])
    assert sum(local) + sum(sent) == 16
    model = link_model_us(link, link_gbps=2.0)
    # The donor's push (3 experts out) dominates its link time; an average over ranks would hide it.
    assert model["push"] == pytest.approx([3 * EXPERT / 2e3, EXPERT / 2e3, EXPERT / 2e3, EXPERT / 2e3])
    assert max(model["total"]) == pytest.approx(model["total"][0])


def test_push_tables_split_a_push_into_each_ranks_received_and_lent_parts():
    # R=3, epn=2: rank 0 homes experts 0-1, rank 1 homes 2-3, rank 2 homes 4-5.
    slots = torch.tensor([[3, -1], [0, 1], [0, 2]], dtype=torch.int32)
    by_rank = [push_tables(slots, rank) for rank in range(3)]
    empty = [-1, -1]
    assert [received.tolist() for received, _ in by_rank] == [
        [[3, -1], empty, empty], [empty, [0, 1], empty], [empty, empty, [0, 2]]]
    assert [lent.tolist() for _, lent in by_rank] == [
        [empty, [0, 1], [0, -1]], [[3, -1], empty, [-1, 2]], [empty, empty, empty]]
    # Every borrowed slot is in exactly one rank's received part and one rank's lent part: their
    # sizes are each rank's ingress and egress.
    ingress = [int((received >= 0).sum()) for received, _ in by_rank]
    egress = [int((lent >= 0).sum()) for _, lent in by_rank]
    assert ingress == [1, 2, 2] and egress == [3, 2, 0]


def test_padding_entries_cross_no_link():
    config = _config(2, 4, 4)
    ids = _ids([[3, 3, -1, -1], [0, 1, 2, 3]])
    plan = flatep.make_plan(ids, config, policy="none", tokens=[2, 4])
    link = plan_link_bytes(plan, ROW, EXPERT)
    assert link["dispatch"]["egress"] == [2 * (ROW + 4), 2 * (ROW + 4)]
    assert link["dispatch"]["local"] == [0, 2 * (ROW + 4)]


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_one_rank_of_a_per_process_group_counts_what_the_whole_plan_counts(policy, dedup):
    config = flatep.EPConfig(ranks=4, experts=8, top_k=3, hidden=8, intermediate=8, capacity=16, align=1, dedup=dedup)
    ids = skewed_topk(4, 8, 3, tokens=16, sigma=1.5, seed=3)
    whole = plan_link_bytes(flatep.make_plan(ids, config, policy), ROW, EXPERT)
    histogram = torch.stack([torch.bincount(ids[r].reshape(-1).long(), minlength=8) for r in range(4)])
    plans = [plan_rank(rank, ids[rank], histogram, config, policy) for rank in range(4)]
    rows = torch.stack([rows_to_ranks(plan) for plan in plans])  # [source, destination]
    for rank in range(4):
        mine = rank_link_bytes(plans[rank], ROW, EXPERT, int(rows[:, rank].sum() - rows[rank, rank]))
        for phase, directions in mine.items():
            for direction, value in directions.items():
                assert value == whole[phase][direction][rank], (phase, direction, rank)


def test_link_model_rejects_a_non_positive_bandwidth():
    plan = flatep.make_plan(_ids([[0, 1], [2, 3]]), _config(2, 4, 2), policy="none")
    with pytest.raises(ValueError, match="link_gbps"):
        link_model_us(plan_link_bytes(plan, ROW, EXPERT), 0.0)


@pytest.mark.parametrize("top_k", [8, 16])
def test_dedup_cuts_link_rows_by_the_expected_distinct_ranks_per_token(top_k):
    """Uniform routing at R = 8, s = 512 and Kimi-K2's 384 experts: with dedup a token's row crosses
    once per distinct remote rank. Under uniform experts a token reaches R(1 - (1 - 1/R)^K) distinct
    ranks in expectation, each remote with probability (R - 1)/R, as each of its K entries is; so
    every rank's remote rows, in dispatch and combine, each way, fall by that over K (within 3%;
    experts drawn without replacement shift it by under 1% at 48 experts per rank)."""
    ranks, tokens, row = 8, 512, 7168 * 2  # a Kimi-K2 bf16 row
    config = flatep.EPConfig(ranks=ranks, experts=384, top_k=top_k, hidden=8, intermediate=8, capacity=tokens, align=1)
    generator = torch.Generator().manual_seed(top_k)
    ids = torch.rand(ranks, tokens, config.experts, generator=generator).argsort(-1)[..., :top_k].int()
    ratio = ranks * (1 - (1 - 1 / ranks) ** top_k) / top_k
    per_entry, deduped = (plan_link_bytes(flatep.make_plan(ids, config.replace(dedup=dedup), "none"), row, EXPERT)
                          for dedup in (False, True))
    for direction in ("egress", "ingress"):
        for rank in range(ranks):
            entries = per_entry["dispatch"][direction][rank] // (row + 4)  # each a row and its route weight
            rows = {"dispatch": (deduped["dispatch"][direction][rank] - entries * entry_metadata_bytes(True)) / row,
                    "combine": deduped["combine"][direction][rank] / row}
            expected = {"dispatch": entries, "combine": per_entry["combine"][direction][rank] / row}
            for phase in rows:
                assert abs(rows[phase] / expected[phase] / ratio - 1) < 0.03, (phase, direction, rank, ratio)
