"""The Triton planner is bit-equal to the reference planner on every field.

Without a GPU the kernels run in Triton's interpreter on small shapes (it must be chosen before
the kernels are defined, hence the environment variable before the import); with one, the same
tests run on CUDA, plus large shapes and CUDA-graph capture.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import flatep.plan.triton as planner  # noqa: E402
from flatep import EPConfig  # noqa: E402
from flatep.plan import make_plan, plan_rank  # noqa: E402
from flatep.plan.reference import build_layout  # noqa: E402
from flatep.plan.triton import count_rank_triton, make_plan_triton, plan_rank_triton  # noqa: E402
from flatep.routing import ADVERSARIAL, adversarial_topk, skewed_topk  # noqa: E402
from tests.plan.cases import padded_ids, planner_cases  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def config_for(ranks: int, experts: int, top_k: int, step: int, align: int = 4) -> EPConfig:
    return EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=step, align=align)


def assert_same(expected, got) -> None:
    """Every field equal: host scalars, and tensors in shape, dtype and value."""
    for name in ("policy", "shard_rows", "total_tokens"):
        assert getattr(got, name) == getattr(expected, name), name
    for name, tensor in expected.tensors().items():
        mine = getattr(got, name)
        assert mine.dtype == torch.int32 and mine.device.type == DEVICE.type, name
        assert mine.shape == tensor.shape, name
        assert torch.equal(mine, tensor.to(DEVICE)), name


def check_group(ids: torch.Tensor, config: EPConfig, policy: str, tokens: list[int] | None = None):
    """make_plan_triton == make_plan; returns the reference plan."""
    expected = make_plan(ids, config, policy, tokens)
    assert_same(expected, make_plan_triton(ids.to(DEVICE), config, policy, tokens))
    return expected


def check_rank(rank: int, ids: torch.Tensor, config: EPConfig, policy: str, tokens: list[int] | None, expected) -> None:
    """count_rank_triton and plan_rank_triton == plan_rank for one rank of ``expected``, with
    the counts made before the exchange and without them."""
    total = sum(tokens) if tokens else None
    own = tokens[rank] if tokens else None
    mine = ids[rank].to(DEVICE)
    counts = count_rank_triton(mine, config.experts, own)
    assert torch.equal(counts.tokens_per_expert, expected.tokens_per_expert[rank].to(DEVICE).int())
    reference = plan_rank(rank, ids[rank], expected.tokens_per_expert, config, policy, total, own)
    gathered = expected.tokens_per_expert.to(DEVICE)
    for supplied in (counts, None):
        got = plan_rank_triton(rank, mine, gathered, config, policy, total, own, counts=supplied)
        assert_same(reference, got)
        assert got.rank == rank


def check_all(ids: torch.Tensor, config: EPConfig, policy: str, tokens: list[int] | None = None, ranks=None) -> None:
    expected = check_group(ids, config, policy, tokens)
    for rank in range(config.ranks) if ranks is None else ranks:
        check_rank(rank, ids, config, policy, tokens, expected)


@st.composite
def triton_cases(draw):
    """A planner case at interpreter-friendly sizes, and one rank to plan on its own."""
    ids, config, policy, tokens = draw(planner_cases(
        ranks=(1, 2, 3, 4), experts_per_rank=(1, 2, 3, 5), max_top_k=4, max_tokens=12, aligns=(1, 2, 4, 128),
        sigmas=(0.0, 0.5, 3.0, 8.0)))
    return ids, config, policy, tokens, draw(st.integers(0, config.ranks - 1))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(triton_cases())
def test_random_cases_match_the_reference(case):
    ids, config, policy, tokens, rank = case
    expected = check_group(ids, config, policy, tokens)
    check_rank(rank, ids, config, policy, tokens, expected)


def test_worked_example_from_the_design_notes():
    config = config_for(2, 4, 2, 4, align=4)
    ids = torch.tensor([[[2, 3], [2, 0], [3, 2], [2, 1]], [[2, 3], [3, 2], [2, 0], [1, 2]]], dtype=torch.int32)
    check_all(ids, config, "exact")


@pytest.mark.parametrize("policy", ["exact", "none", "bounded"])
@pytest.mark.parametrize(
    "ranks, experts, top_k, step, align, routing",
    [
        (4, 8, 2, 1, 4, 2.0),  # s = 1
        (4, 8, 1, 16, 1, 0.0),  # K = 1, align = 1, balanced
        (4, 4, 3, 6, 2, "uniform_repeats"),  # E = R, ids repeated within a token
        (3, 9, 3, 7, 4, 0.0),  # uneven sizes, sigma 0
        (3, 9, 3, 7, 4, 8.0),  # uneven sizes, very high sigma
        (2, 6, 5, 5, 1, "local"),  # K > epn: local ids repeat within a token
    ],
)
def test_edge_shapes(ranks, experts, top_k, step, align, routing, policy):
    config = config_for(ranks, experts, top_k, step, align)
    if routing == "uniform_repeats":
        generator = torch.Generator().manual_seed(5)
        ids = torch.randint(0, experts, (ranks, step, top_k), generator=generator, dtype=torch.int32)
    elif isinstance(routing, str):
        ids = adversarial_topk(routing, ranks, experts, top_k, step)
    else:
        ids = skewed_topk(ranks, experts, top_k, step, routing, seed=11)
    check_all(ids, config, policy)


@pytest.mark.parametrize("kind", ADVERSARIAL)
def test_adversarial_routings(kind):
    config = config_for(4, 8, 4, 8, align=4)
    ids = adversarial_topk(kind, 4, 8, 4, 8)
    for policy in ("exact", "none", "bounded"):
        check_all(ids, config, policy, ranks=[0, 3])
    check_all(ids, config.replace(tolerance=0.3), "bounded", ranks=[1])


@pytest.mark.parametrize("tolerance", [0.0, 0.01, 0.25, 1 / 3, 1.0, 4.0])
def test_bounded_tolerances_with_per_rank_tokens(tolerance):
    config = config_for(4, 8, 3, 9, align=2).replace(tolerance=tolerance)
    tokens = [9, 2, 0, 7]
    ids = padded_ids(skewed_topk(4, 8, 3, 9, 3.0, seed=9), tokens)
    check_all(ids, config, "bounded", tokens, ranks=[0, 2])


def test_eight_ranks_skewed_with_per_rank_tokens():
    config = config_for(8, 32, 4, 8, align=8)
    tokens = [8, 0, 3, 8, 1, 7, 8, 2]
    ids = padded_ids(skewed_topk(8, 32, 4, 8, 3.0, seed=2), tokens)
    check_all(ids, config, "exact", tokens, ranks=[0, 1, 7])


@pytest.mark.parametrize("policy", ["exact", "bounded", "none"])
@pytest.mark.parametrize("ranks", [8, 40])
def test_ragged_tokens_plan_exactly_without_the_total_on_the_host(policy, ranks):
    """total_tokens=None with fewer real tokens on some ranks: the tables are those of the group's
    real total (taken from the histogram on the device, fused and staged layouts); only the
    host-side sizes take the bound R*s."""
    step, experts = 64, 4 * ranks
    config = config_for(ranks, experts, 4, step, align=128).replace(tolerance=0.25)
    tokens = [(23 * rank) % (step + 1) for rank in range(ranks)]
    ids = padded_ids(skewed_topk(ranks, experts, 4, step, 3.0, seed=4), tokens)
    expected = make_plan(ids, config, policy, tokens)
    assert config.step_align(sum(tokens)) != config.step_align(ranks * step)  # the padding tells the totals apart
    for rank in (1, ranks - 1):
        reference = plan_rank(rank, ids[rank], expected.tokens_per_expert, config, policy, sum(tokens), tokens[rank])
        got = plan_rank_triton(rank, ids[rank].to(DEVICE), expected.tokens_per_expert.to(DEVICE), config, policy,
                               tokens=tokens[rank])
        for name, tensor in reference.tensors().items():
            assert torch.equal(getattr(got, name).cpu(), tensor), name
        assert got.total_tokens == ranks * step and got.shard_rows == config.step_rows(ranks * step, policy)


def test_int64_ids_are_accepted():
    config = config_for(2, 4, 2, 3)
    ids = skewed_topk(2, 4, 2, 3, 1.0, seed=1).long()
    check_all(ids, config, "exact")


@pytest.mark.parametrize("segments_per_rank", [256, 2, 1])
@pytest.mark.parametrize("scan_rows", [1024, 2])
def test_many_tiles_per_rank(monkeypatch, scan_rows, segments_per_rank):
    """Tiles of 16 entries: several tiles per rank, in segments of one tile (256), of several
    (2: two or three segments per rank) or all in one segment (1), the segments prefixed by the
    scan launch in one pass or in chunks of two rows."""
    monkeypatch.setattr(planner, "_tile_size", lambda entries: 16)
    monkeypatch.setattr(planner, "_SCAN_ROWS", scan_rows)
    monkeypatch.setattr(planner, "_SEGMENTS_PER_RANK", segments_per_rank)
    config = config_for(3, 6, 3, 20, align=4)
    tokens = [20, 9, 14]
    ids = padded_ids(skewed_topk(3, 6, 3, 20, 2.0, seed=4), tokens)
    expected = check_group(ids, config, "exact", tokens)
    check_rank(1, ids, config, "exact", tokens, expected)
    check_rank(2, ids, config, "exact", tokens, expected)


@pytest.mark.parametrize("segment", [16, 64])
@pytest.mark.parametrize("experts_per_rank", [2, 4])  # E = 8: a power of two, the histogram's spare bin past it
def test_sorted_count_equals_the_reference(monkeypatch, segment, experts_per_rank):
    """The count by sorting (large steps), forced on small ones: segments of 16 entries (several
    per rank, scanned) or of 64 (one per rank), ragged tokens, repeated and out-of-range ids."""
    monkeypatch.setattr(planner, "SORTED_COUNT_ENTRIES", 1)
    monkeypatch.setattr(planner, "_SORTED_SEGMENT", segment)
    monkeypatch.setattr(planner, "_tile_size", lambda entries: 8)
    ranks, top_k, step = 2, 3, 20
    experts = ranks * experts_per_rank
    config = config_for(ranks, experts, top_k, step, align=4)
    tokens = [20, 13]
    ids = padded_ids(skewed_topk(ranks, experts, top_k, step, 2.0, seed=segment + experts), tokens)
    ids[0, :4] = ids[0, 0, 0]  # the same expert for several entries of a token
    for policy in ("exact", "none"):
        expected = check_group(ids, config, policy, tokens)
        check_rank(1, ids, config, policy, tokens, expected)
    mine = ids[0].clone()
    mine[2, 1], mine[5, 0] = experts + 3, -2  # skipped, not counted
    counted = count_rank_triton(mine.to(DEVICE), experts, 20)
    valid = (mine >= 0) & (mine < experts)
    assert torch.equal(counted.tokens_per_expert.cpu(), torch.bincount(mine[valid].long(), minlength=experts).int())


def test_out_of_range_ids_are_skipped_not_read():
    """The documented no-sync behaviour: ids outside [0, E) of real tokens count nowhere."""
    ids = torch.tensor([[0, 9], [-3, 1], [1, 1]], dtype=torch.int32)
    assert count_rank_triton(ids.to(DEVICE), 4).tokens_per_expert.tolist() == [1, 3, 0, 0]
    assert count_rank_triton(ids.to(DEVICE), 4, tokens=2).tokens_per_expert.tolist() == [1, 1, 0, 0]


def test_bad_input_is_rejected_before_any_kernel():
    config = config_for(2, 4, 2, 4)
    ids = skewed_topk(2, 4, 2, 4, 1.0).to(DEVICE)
    hist = make_plan(ids.cpu(), config).tokens_per_expert.to(DEVICE)
    with pytest.raises(ValueError, match="policy must be one of"):
        make_plan_triton(ids, config, "greedy")
    with pytest.raises(ValueError, match="topk_ids must have shape"):
        make_plan_triton(ids[0], config)
    with pytest.raises(ValueError, match="int32 or int64"):
        make_plan_triton(ids.float(), config)
    with pytest.raises(ValueError, match="capacity"):
        make_plan_triton(ids.repeat(1, 2, 1), config)
    with pytest.raises(ValueError, match="tokens must hold 2 counts"):
        make_plan_triton(ids, config, tokens=[5, 1])
    with pytest.raises(ValueError, match="config.ranks must be <= 256"):
        make_plan_triton(ids, EPConfig(ranks=512, experts=512, top_k=2, hidden=8, intermediate=8, capacity=4))
    with pytest.raises(ValueError, match="config.experts must be <= 2048"):
        make_plan_triton(ids, EPConfig(ranks=2, experts=4096, top_k=2, hidden=8, intermediate=8, capacity=4))
    with pytest.raises(ValueError, match="rank must be"):
        plan_rank_triton(2, ids[0], hist, config)
    with pytest.raises(ValueError, match="tokens_per_expert must be a tensor of shape"):
        plan_rank_triton(0, ids[0], hist[0], config)
    with pytest.raises(ValueError, match="tokens_per_expert must be int32 or int64"):
        plan_rank_triton(0, ids[0], hist.float(), config)
    with pytest.raises(ValueError, match="total_tokens must be in"):
        plan_rank_triton(0, ids[0], hist, config, total_tokens=9)
    with pytest.raises(ValueError, match="tokens must be in"):
        plan_rank_triton(0, ids[0], hist, config, tokens=5)
    with pytest.raises(ValueError, match="experts must be an int"):
        count_rank_triton(ids[0], 0)
    with pytest.raises(ValueError, match=r"\[s, K\]"):
        count_rank_triton(ids, 4)
    counts = count_rank_triton(ids[0], config.experts)
    with pytest.raises(ValueError, match="counts were made for tokens=4, got tokens=3"):
        plan_rank_triton(0, ids[0], hist, config, tokens=3, counts=counts)
    with pytest.raises(ValueError, match=r"counts were made for ids of shape \[4, 2\]"):
        plan_rank_triton(0, ids[0, :3], hist, config, counts=counts)
    with pytest.raises(ValueError, match="counts were made for E=4"):
        plan_rank_triton(0, ids[0], torch.zeros(2, 6, dtype=torch.int32, device=DEVICE),
                         config.replace(experts=6), counts=counts)
    with pytest.raises(ValueError, match="counts were made from another topk_ids tensor"):
        plan_rank_triton(0, ids[0].clone(), hist, config, counts=counts)
    with pytest.raises(ValueError, match="counts must be a RankCounts"):
        plan_rank_triton(0, ids[0], hist, config, counts=hist)


def test_int32_limits_are_guarded_before_any_kernel():
    """Steps whose entries overflow int32 are refused on the host. The ids are stride-0 views
    (no memory): without the guards the planners would copy and plan 2**31 entries."""
    config = EPConfig(ranks=256, experts=256, top_k=8, hidden=8, intermediate=8, capacity=1 << 20)
    ids = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE).expand(256, 1 << 20, 8)
    assert not ids.is_contiguous()
    with pytest.raises(ValueError, match=r"topk_ids: R\*s\*K must be < 2\*\*31"):
        make_plan_triton(ids, config)
    hist = torch.zeros(256, 256, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"topk_ids: R\*s\*K must be < 2\*\*31"):
        plan_rank_triton(0, ids[0], hist, config)
    with pytest.raises(ValueError, match=r"topk_ids: s\*K must be < 2\*\*31"):
        count_rank_triton(ids.reshape(1 << 28, 8), 256)


@pytest.mark.parametrize("ranks", [2, 64])
@pytest.mark.parametrize("policy", ["exact", "bounded"])
def test_imbalance_bound_past_int32(ranks, policy):
    """T*K*(1 + tolerance)/R above 2**31: the bound is clamped to T*K on the device, not wrapped.

    Entries this many cannot run through the interpreter, so the layout launches are fed a
    gathered histogram directly and compared with the reference layout."""
    experts, step = 2 * ranks, 1 << 22
    config = EPConfig(ranks=ranks, experts=experts, top_k=1, hidden=8, intermediate=8, capacity=step, align=128,
                      tolerance=1024.0)
    total = ranks * step
    # Rank 0's experts hold three quarters of the entries: over the mean, under the bound.
    hist = torch.zeros(ranks, experts, dtype=torch.int64)
    hist[:, 0] = 3 * step // 4
    hist[:, 1:] = (step - 3 * step // 4) // (experts - 1)
    hist[:, 1] += step - hist[0].sum()
    assert int(hist.sum()) == total
    assert config.rebalance_limit(total) >= 2**31 > int(hist[:, :2].sum())
    expected = build_layout(hist, config, policy, total, step)
    tables = planner._Tables(config, DEVICE)
    planner._launch_layout(hist.to(device=DEVICE, dtype=torch.int32), config, policy, tables)
    for name, tensor in tables.layout_fields().items():
        assert torch.equal(tensor, getattr(expected, name).to(DEVICE)), name


# ----------------------------------------------------------------------------------------------
# Many ranks: the staged layout (R > 32), up to R = 256 and E = 2048. The interpreter runs one
# program at a time (a plan at R = 256 takes it seconds), so each case plans a few tokens with one
# policy, the group only where marked, and one or two ranks.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ranks, experts_per_rank, top_k, step, routing, policy, group, planned",
    [
        (64, 2, 2, 3, 3.0, "exact", True, [0, 63]),  # skewed
        (64, 32, 2, 2, 2.0, "bounded", True, [40]),  # E = 2048
        (128, 1, 2, 2, "one", "exact", True, [127]),  # every entry to expert 0: 127 receivers
        (256, 1, 2, 1, 2.0, "exact", False, [255]),
        (256, 1, 2, 2, 2.0, "bounded", False, [3]),
    ],
)
def test_many_ranks_match_the_reference(ranks, experts_per_rank, top_k, step, routing, policy, group, planned):
    experts = ranks * experts_per_rank
    config = config_for(ranks, experts, top_k, step, align=4)
    if isinstance(routing, str):
        ids = adversarial_topk(routing, ranks, experts, top_k, step)
    else:
        ids = skewed_topk(ranks, experts, top_k, step, routing, seed=ranks)
    expected = check_group(ids, config, policy) if group else make_plan(ids, config, policy)
    for rank in planned:
        check_rank(rank, ids, config, policy, None, expected)


def test_staged_layout_with_several_segments_per_rank(monkeypatch):
    """R > 32 (the staged layout) with several count segments per rank."""
    monkeypatch.setattr(planner, "_tile_size", lambda entries: 4)
    ranks, top_k, step = 40, 2, 5
    config = config_for(ranks, 2 * ranks, top_k, step, align=4)
    ids = skewed_topk(ranks, 2 * ranks, top_k, step, 2.0, seed=3)
    expected = make_plan(ids, config, "exact")
    check_rank(39, ids, config, "exact", None, expected)


def test_many_ranks_per_rank_tokens_and_tolerance():
    config = config_for(64, 64, 2, 4, align=2).replace(tolerance=0.25)
    tokens = [4, 0, 1, 3] * 16
    ids = padded_ids(skewed_topk(64, 64, 2, 4, 3.0, seed=6), tokens)
    check_all(ids, config, "bounded", tokens, ranks=[2])


# ----------------------------------------------------------------------------------------------
# GPU only: real sizes and CUDA graphs
# ----------------------------------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("model", [(8, 384, 8), (8, 896, 16)], ids=["kimi-k2", "kimi-k3"])
@pytest.mark.parametrize("sigma", [0.0, 1.0, 5.0])
def test_large_shapes_on_cuda(model, sigma):
    ranks, experts, top_k = model
    step = 8192
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=step, align=128)
    ids = skewed_topk(ranks, experts, top_k, step, sigma, seed=3, device=DEVICE)
    for policy in ("exact", "none", "bounded"):
        check_all(ids, config, policy, ranks=[0, ranks - 1] if policy != "exact" else None)
    check_all(ids, config.replace(tolerance=0.2), "bounded", ranks=[0, 5])
    tokens = [step, 1, 0, 5000, step, 77, 8191, 4096]
    check_all(padded_ids(ids, tokens), config, "exact", tokens, ranks=[1, 3])


@cuda_only
def test_adversarial_routings_at_scale_on_cuda():
    config = EPConfig(ranks=8, experts=896, top_k=16, hidden=8, intermediate=8, capacity=1024, align=128)
    for kind in ADVERSARIAL:
        ids = adversarial_topk(kind, 8, 896, 16, 1024, device=DEVICE)
        check_all(ids, config, "exact", ranks=[0, 5])


@cuda_only
@pytest.mark.parametrize("step", [1, 128, 8192])
def test_cuda_graph_replays_follow_new_ids(step):
    ranks, experts, top_k = 8, 384, 8
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=step, align=128)
    ids = skewed_topk(ranks, experts, top_k, step, 1.0, seed=0, device=DEVICE)
    hist = make_plan(ids, config).tokens_per_expert
    rank = 3
    # Compile outside the capture (the first call builds the kernels).
    make_plan_triton(ids, config)
    plan_rank_triton(rank, ids[rank], hist, config)
    torch.cuda.synchronize()
    group_graph, rank_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(group_graph):
        group = make_plan_triton(ids, config)
    with torch.cuda.graph(rank_graph):
        mine = plan_rank_triton(rank, ids[rank], hist, config)
    for expected, new_ids in replays(ids, hist, config, step, group_graph, rank_graph):
        assert_same(expected, group)
        assert_same(plan_rank(rank, new_ids[rank], expected.tokens_per_expert, config), mine)


def replays(ids, hist, config, step, *graphs):
    """Refill ``ids`` (and the gathered ``hist``) with routings that change the plan (balanced, very
    skewed, skewed), replay ``graphs`` after each and yield ``(reference plan, the new ids)``."""
    for seed, sigma in [(1, 0.0), (2, 5.0), (3, 1.0)]:
        new_ids = skewed_topk(config.ranks, config.experts, config.top_k, step, sigma, seed=seed, device=DEVICE)
        expected = make_plan(new_ids, config)
        ids.copy_(new_ids)
        hist.copy_(expected.tokens_per_expert)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        yield expected, new_ids


def test_programmatic_launch_only_on_cuda_hopper():
    """PDL_LAUNCHES names real launches (a misspelt one would silently launch plainly), and the CPU
    (interpreter) launches never ask for programmatic dependent launch."""
    assert planner.PDL_LAUNCHES and planner.PDL_LAUNCHES <= set(planner.LAUNCHES)
    for launch in planner.LAUNCHES:
        assert planner._launch_options(torch.device("cpu"), launch) == {"PDL": False}


@cuda_only
@pytest.mark.parametrize("launches", [planner.LAUNCHES, ()], ids=["all", "none"])
@pytest.mark.parametrize("ranks, experts, top_k, step", [(8, 896, 16, 8192), (64, 384, 8, 256)], ids=["fused", "staged"])
def test_programmatic_launches_replay_back_to_back(monkeypatch, launches, ranks, experts, top_k, step):
    """With every planner launch programmatic (or none), three counts and plans of one rank back to back
    in one CUDA graph (each launch may start while the one before it runs), and the group planner,
    equal the reference over routings that change between replays."""
    monkeypatch.setattr(planner, "PDL_LAUNCHES", frozenset(launches))
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=8, intermediate=8, capacity=step, align=128)
    ids = skewed_topk(ranks, experts, top_k, step, 1.0, seed=0, device=DEVICE)
    hist = make_plan(ids, config).tokens_per_expert.to(DEVICE)
    planned = [0, ranks // 2, ranks - 1]

    def plan_all():
        mine = [plan_rank_triton(rank, ids[rank], hist, config, counts=count_rank_triton(ids[rank], experts))
                for rank in planned]
        return mine, make_plan_triton(ids, config)

    plan_all()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mine, group = plan_all()
    for expected, new_ids in replays(ids, hist, config, step, graph):
        assert_same(expected, group)
        for rank, plan in zip(planned, mine):
            assert_same(plan_rank(rank, new_ids[rank], expected.tokens_per_expert, config), plan)
