"""Dispatch, combine and weight push: Triton kernels against the plain-torch paths and the plan."""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from flatep import EPConfig, ExpertPool, init_group, make_plan
from flatep.kernels.backend import MAX_WORK_ITEMS, comm_grid, round_to_bf16, tma_fits, use_triton
from flatep.kernels.combine import combine_grid, combine_triton
from flatep.kernels.dispatch import dispatch_grid, dispatch_triton
from flatep.kernels.push import push_programs
from flatep.layer import combine_step, dispatch_step
from flatep.plan.split import split_slot_rows
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs

POISON = 1e4


def traceable_rows(ranks: int, tokens: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Row ``(r, t)`` holds values that identify it (exact in bf16), plus a random part."""
    ident = (torch.arange(ranks).view(-1, 1, 1) * 64 + torch.arange(tokens).view(1, -1, 1) % 64).float()
    noise = torch.randint(-8, 8, (ranks, tokens, hidden)).float() / 8
    return (ident + noise).to(dtype=dtype, device=DEVICE)


CASES = [
    (EPConfig(ranks=4, experts=16, top_k=4, hidden=48, intermediate=16, capacity=9, align=8), 9, 3.0),
    (EPConfig(ranks=2, experts=2, top_k=2, hidden=32, intermediate=16, capacity=5, align=4), 5, "one"),
    (EPConfig(ranks=3, experts=6, top_k=3, hidden=40, intermediate=16, capacity=7, align=1), 1, "duplicate"),
    (EPConfig(ranks=8, experts=16, top_k=1, hidden=32, intermediate=16, capacity=4, align=16), 3, "next"),
]


# The planner's layout, and the layer's split layout (slot groups from a fixed row).
LAYOUTS = [("exact", False), ("exact", True), ("none", False)]


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy, split", LAYOUTS)
@pytest.mark.parametrize("config, tokens, routing", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dispatch_puts_every_row_where_the_plan_says(config, tokens, routing, policy, split, backend, dtype):
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    _, ids, weights, _, _ = make_inputs(config, tokens, routing, dtype, seed=tokens)
    x = traceable_rows(config.ranks, tokens, config.hidden, dtype)
    plan = make_plan(ids, config, policy)
    plan = split_slot_rows(plan) if split else plan
    shard = group.buffer("shard", (plan.shard_rows, config.hidden), dtype).fill_(POISON)
    shard_weights = group.buffer("shard_weights", (plan.shard_rows,), torch.float32).fill_(POISON)
    dispatch_step(x, weights, plan, group, backend)
    expected = torch.full_like(shard, POISON)
    expected_weights = torch.full_like(shard_weights, POISON)
    valid = plan.dest_rank >= 0
    index = (plan.dest_rank[valid].long(), plan.dest_row[valid].long())
    expected[index] = x.unsqueeze(2).expand(-1, -1, config.top_k, -1)[valid]
    expected_weights[index] = weights[valid]
    # Real rows exact, and every other row, padding included, still poisoned (nothing else written).
    assert torch.equal(shard, expected)
    assert torch.equal(shard_weights, expected_weights)


def combined(shard: torch.Tensor, plan) -> torch.Tensor:
    """``[R, s, H]`` fp32: every token's rows of ``shard [R, rows, H]`` summed as combine sums them
    (a literal loop): with dedup, each destination rank's rows of a token in fp32 in ascending ``k``,
    rounded to the shard's dtype, then those partial sums in fp32 in ascending rank."""
    ranks, tokens, top_k = plan.dest_rank.shape
    out = torch.zeros(ranks, tokens, shard.shape[-1], device=shard.device)
    for rank in range(ranks):
        for token in range(tokens):
            dest, row = plan.dest_rank[rank, token].tolist(), plan.dest_row[rank, token].tolist()
            runs = {}
            for k in range(top_k):
                if dest[k] >= 0:
                    run = dest[k] if plan.dedup else (dest[k], k)  # without dedup every entry is its own run
                    runs.setdefault(run, []).append(shard[dest[k], row[k]].float())
            for run in sorted(runs):
                out[rank, token] += torch.stack(runs[run]).sum(0).to(shard.dtype).float()
    return out


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("config, tokens, routing", CASES)
def test_combine_sums_the_k_rows_of_each_token(config, tokens, routing, split, backend):
    # fp32 rows: combine rounds each rank's partial sum to the rows' dtype, and bf16 would round
    # these traceable values (and the interpreter rounds ties unlike torch).
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    _, ids, weights, _, _ = make_inputs(config, tokens, routing, torch.float32, seed=1)
    x = traceable_rows(config.ranks, tokens, config.hidden, torch.float32)
    plan = make_plan(ids, config)
    plan = split_slot_rows(plan) if split else plan
    group.buffer("shard", (plan.shard_rows, config.hidden), torch.float32).fill_(float("nan"))  # tail poison
    shard, _ = dispatch_step(x, weights, plan, group, backend)
    dispatched = shard.clone()  # combine may overwrite carrier rows with their runs' sums
    out = combine_step(shard, plan, group, tokens, config.top_k, torch.float32, backend)
    # Identity round trip: combine of the untouched shard is K * x (exact: small integers and eighths).
    assert torch.equal(out, x * config.top_k)
    # Each row scaled by a distinct factor: the sum must attribute rows to the right entry.
    scale = torch.randn(shard.shape[:2], device=DEVICE).abs() + 0.5
    scaled = dispatched * scale.unsqueeze(-1)
    shard.copy_(scaled)
    out = combine_step(shard, plan, group, tokens, config.top_k, torch.float32, backend)
    torch.testing.assert_close(out, combined(scaled, plan), rtol=1e-6, atol=1e-5)


def test_combine_paths_agree_bit_for_bit_and_skip_padded_tokens():
    config = EPConfig(ranks=4, experts=8, top_k=3, hidden=40, intermediate=16, capacity=6, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, _, _ = make_inputs(config, 6, 2.0, torch.bfloat16, seed=5)
    tokens = [6, 2, 0, 5]
    for rank, count in enumerate(tokens):
        ids[rank, count:] = -1
    plan = make_plan(ids, config, tokens=tokens)
    # bf16 rows and output: combine rounds each rank's partial sum to the rows' dtype, to nearest even
    # on both paths (the interpreted kernel rounds before its cast, which truncates).
    dtype = torch.bfloat16
    shard, _ = dispatch_step(x.to(dtype), weights, plan, group)  # writes the links combine reads
    shard.normal_()
    rows = shard.clone()
    outs = []
    for backend in TRITON_BACKENDS:
        shard.copy_(rows)  # combine overwrites carrier rows with their runs' sums
        outs.append(combine_step(shard, plan, group, 6, 3, dtype, backend))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0][2], torch.zeros_like(outs[0][2]))


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_push_copies_borrowed_experts_and_nothing_else(backend):
    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=32, intermediate=24, capacity=16, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 16, "one", torch.bfloat16, seed=2)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    for name in ("w13", "w2"):
        pool.slots(name).fill_(POISON)
    plan = make_plan(ids, config)
    assert int((plan.slot_experts >= 0).sum()) > 0
    pool.push(plan.slot_experts, backend)
    for name, weights_all in (("w13", w13), ("w2", w2)):
        assert torch.equal(pool.home(name).reshape(weights_all.shape), weights_all)
        slots = pool.slots(name)
        for rank in range(4):
            for slot, expert in enumerate(plan.slot_experts[rank].tolist()):
                expected = weights_all[expert] if expert >= 0 else torch.full_like(weights_all[0], POISON)
                assert torch.equal(slots[rank, slot], expected), (name, rank, slot)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("columns", [6, 5, 20_001])  # the last spans several chunks
def test_push_of_one_byte_pools_copies_them_in_chunks_of_the_same_bytes(backend, columns):
    """fp8 / mxfp4 pools: the push copies the same bytes per chunk as for bf16 pools, odd sizes included."""
    from flatep.kernels.push import chunk_elements

    assert chunk_elements(torch.zeros(1, dtype=torch.uint8)) == 2 * chunk_elements(torch.zeros(1, dtype=torch.bfloat16))
    group = init_group("local", ranks=2, device=DEVICE)
    generator = torch.Generator().manual_seed(columns)
    home = group.symmetric_empty((2, 2, columns), torch.uint8)
    home.copy_(torch.randint(0, 256, home.shape, generator=generator, dtype=torch.uint8).to(DEVICE))
    slots = group.symmetric_empty((2, 2, columns), torch.uint8)
    slots.fill_(0xAB)
    group.push_experts(home, slots, torch.tensor([[3, -1], [-1, 0]], dtype=torch.int32, device=DEVICE), backend)
    assert torch.equal(slots[0, 0], home[1, 1]) and torch.equal(slots[1, 1], home[0, 0])
    assert bool((slots[0, 1] == 0xAB).all()) and bool((slots[1, 0] == 0xAB).all())


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("programs", [None, 1, 3])
@pytest.mark.parametrize("columns", [(20_001, 7, 1024), (20_000, 8, 1024)])  # one-byte, then int64 copy views
def test_one_push_moves_every_pool_of_a_layer_whatever_its_type_and_size(backend, programs, columns):
    """Values, scales and biases in one launch: pools of a few chunks an expert and of less than one
    (most programs get no chunk of them), any cap on the programs; slots not lent stay untouched."""
    group = init_group("local", ranks=3, device=DEVICE)
    generator = torch.Generator().manual_seed(sum(columns) + (programs or 0))
    pools = []
    for dtype, width in zip((torch.uint8, torch.float32, torch.bfloat16), columns):
        home = group.symmetric_empty((2, 3, width), dtype)
        home.view(torch.uint8).copy_(torch.randint(0, 256, home.view(torch.uint8).shape, generator=generator,
                                                   dtype=torch.uint8).to(DEVICE))
        slots = group.symmetric_empty((2, 3, width), dtype)
        slots.view(torch.uint8).fill_(0xAB)
        pools.append((home, slots))
    # [R, epn]: rank 0 borrows expert 3 (owned by rank 1), rank 1 experts 0 and 5, rank 2 expert 2.
    table = torch.tensor([[3, -1], [0, 5], [-1, 2]], dtype=torch.int32, device=DEVICE)
    group.push_pools(pools, table, backend, programs)
    for home, slots in pools:
        for rank, borrowed in enumerate(table.tolist()):
            for slot, expert in enumerate(borrowed):
                got = slots[rank, slot].view(torch.uint8)
                if expert < 0:
                    assert bool((got == 0xAB).all())
                else:
                    assert torch.equal(got, home[expert // 2, expert % 2].view(torch.uint8)), (home.dtype, rank, slot)


@pytest.mark.parametrize(("dtype", "columns", "expected"), [
    (torch.bfloat16, 7168, torch.int64), (torch.bfloat16, 6, torch.int32), (torch.bfloat16, 3, torch.int16),
    (torch.uint8, 224, torch.int64), (torch.uint8, 6, torch.int16), (torch.uint8, 5, torch.uint8),
    (torch.float32, 2, torch.int64),
])
def test_copy_views_take_the_widest_integers_that_divide_the_rows(dtype, columns, expected):
    from flatep.kernels.push import copy_views

    pool = torch.arange(2 * 3 * columns).to(dtype).reshape(2, 3, columns)
    (view,) = copy_views(pool)
    assert view.dtype == expected and view.data_ptr() == pool.data_ptr()
    assert torch.equal(view.view(torch.uint8), pool.view(torch.uint8))
    if expected == torch.int64:
        # A pool starting off the wide alignment narrows every view: home and slots share one type.
        shifted = pool.view(torch.uint8).reshape(-1)[1:9]
        assert copy_views(shifted)[0].dtype == torch.uint8
        assert [v.dtype for v in copy_views(pool, shifted)] == [torch.uint8, torch.uint8]


CUDA_AXIS0_LIMIT = 2**31 - 1


@pytest.mark.parametrize("tokens", [1, 65_535, 65_536, 131_071, 131_072, 2**20])
@pytest.mark.parametrize("ranks_here", [1, 8])
@pytest.mark.parametrize("programs", [None, 1, 3, 528])
def test_comm_grids_stay_within_cuda_limits(tokens, ranks_here, programs):
    """Every launch is 1-D (CUDA caps axes 1 and 2 at 65,535 programs, axis 0 at 2**31 - 1) and covers all its work."""
    for block_t in (1, 2, 8):
        dispatch = dispatch_grid(ranks_here, tokens, block_t, programs)
        combine = combine_grid(ranks_here, tokens, block_t, programs)
        work = ranks_here * -(-tokens // block_t)
        for grid, items in ((dispatch, work), (combine, work)):
            assert len(grid) == 1 and 1 <= grid[0] <= CUDA_AXIS0_LIMIT
            assert grid[0] == (items if programs is None else min(items, programs))
    assert push_programs(torch.device("cpu"), programs) == min(2, programs or 2)


def test_launch_beyond_the_kernel_limits_raises_before_any_kernel():
    tokens = MAX_WORK_ITEMS + 1
    # Expanded views: the shapes of a huge launch without its memory (nothing may be read).
    out = torch.zeros(1, 1, 8).expand(1, tokens, 8)
    entries = torch.zeros(1, 1, 1, dtype=torch.int32).expand(1, tokens, 1)
    shard, peers = torch.zeros(1, 4, 8), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="token blocks in one launch exceed"):
        combine_triton(out, entries, entries, entries, entries, shard, peers)
    with pytest.raises(ValueError, match="token blocks in one launch exceed"):
        dispatch_triton(out, out, entries, entries, entries, entries, shard, shard[:, :, 0], shard, peers, peers, peers,
                        False, block_t=1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="comm_programs must be None or a positive int"):
            comm_grid(4, bad)


@pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("config, tokens, routing", CASES[:2])
def test_capped_programs_give_bit_identical_results(config, tokens, routing):
    """A grid capped at 1 or 3 programs walks the same work items in the same arithmetic as an uncapped one."""
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    _, ids, weights, w13, w2 = make_inputs(config, tokens, routing, torch.bfloat16, seed=3)
    x = traceable_rows(config.ranks, tokens, config.hidden, torch.bfloat16)
    plan = split_slot_rows(make_plan(ids, config))
    pool = ExpertPool.from_weights(w13, w2, config, group)
    results = []
    for programs in (None, 1, 3):
        group.buffer("shard", (plan.shard_rows, config.hidden), torch.bfloat16).fill_(POISON)
        group.buffer("shard_weights", (plan.shard_rows,), torch.float32).fill_(POISON)
        for name in pool.names:
            pool.slots(name).fill_(POISON)
        shard, shard_weights = dispatch_step(x, weights, plan, group, "triton", comm_programs=programs)
        dispatched = (shard.clone(), shard_weights.clone())
        shard.copy_((shard.float() * 0.75).bfloat16())
        out = combine_step(shard, plan, group, tokens, config.top_k, torch.float32, "triton", comm_programs=programs)
        pool.push(plan.slot_experts, "triton", programs)
        results.append((*dispatched, out, *(pool.slots(name).clone() for name in pool.names)))
    for other in results[1:]:
        for first, again in zip(results[0], other):
            assert torch.equal(first, again)


def test_column_parts_split_small_launches_only():
    from flatep.kernels.backend import SPLIT_BELOW_ITEMS, column_parts

    assert column_parts(SPLIT_BELOW_ITEMS, 7168, 1024) == (1, 7)  # large launches keep whole rows
    assert column_parts(SPLIT_BELOW_ITEMS - 1, 7168, 1024) == (7, 1)  # small ones: one chunk per item
    assert column_parts(1, 7168, 1024) == (7, 1)
    assert column_parts(8, 40, 16) == (3, 1)  # a ragged last chunk


def test_combine_takes_more_warps_in_small_launches():
    from flatep.kernels.backend import SPLIT_BELOW_ITEMS
    from flatep.kernels.combine import combine_warps

    assert combine_warps(SPLIT_BELOW_ITEMS - 1) == 8 and combine_warps(SPLIT_BELOW_ITEMS) == 4


@pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dedup", [False, True])
def test_rows_split_into_column_parts_give_bit_identical_results(dedup):
    """Narrow column chunks (40 columns in chunks of 16, the last ragged): dispatch splits each row
    over three work items, combine walks three chunks per row; both equal the one-chunk launch bit for bit."""
    from flatep.layer import link_buffer

    config = EPConfig(ranks=4, experts=8, top_k=3, hidden=40, intermediate=16, capacity=5, align=4, dedup=dedup)
    group = init_group("local", ranks=4, device=DEVICE)
    _, ids, weights, _, _ = make_inputs(config, 5, 2.0, torch.float32, seed=11)
    x = traceable_rows(4, 5, config.hidden, torch.float32)
    plan = split_slot_rows(make_plan(ids, config))
    tables = (plan.dest_rank, plan.dest_row, plan.carrier, plan.send_order)
    results = []
    for block_h in (64, 16):
        shard = group.buffer("shard", (plan.shard_rows, config.hidden), torch.float32).fill_(POISON)
        shard_weights = group.buffer("shard_weights", (plan.shard_rows,), torch.float32).fill_(POISON)
        links = link_buffer(group, plan.shard_rows).fill_(-7)
        peers = [group.peer_offsets(t) for t in (shard, shard_weights, links)]
        dispatch_triton(x, weights, *tables, shard, shard_weights, links, *peers, dedup, block_h=block_h)
        dispatched = (shard.clone(), shard_weights.clone(), links.clone())
        out = torch.full_like(x, POISON)
        combine_triton(out, *tables, shard, peers[0], block_h=block_h)
        results.append((*dispatched, out))
    for first, again in zip(*results):
        assert torch.equal(first, again)
    assert not torch.equal(results[0][0], torch.full_like(results[0][0], POISON))


def test_tma_fits_needs_aligned_bases_and_strides_and_a_unit_last_stride():
    """The TMA descriptor rules both packed GEMMs check before taking descriptors."""
    rows = torch.zeros(8, 64, dtype=torch.bfloat16)  # 128-byte rows
    assert tma_fits(rows) and tma_fits(torch.zeros(2, 16, 32, dtype=torch.uint8))
    assert not tma_fits(torch.zeros(8, 68, dtype=torch.bfloat16)[:, :64])  # 136-byte row stride
    assert not tma_fits(rows[:, 1:])  # base 2 bytes past an aligned one
    assert not tma_fits(rows.T)  # no unit stride along the last dimension
    assert not tma_fits(rows[:0])  # empty


@triton.jit
def _rounded_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, round_to_bf16(tl.load(x_ptr + offsets)))


@pytest.mark.skipif(DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs CUDA or TRITON_INTERPRET=1")
def test_round_to_bf16_rounds_to_nearest_even_and_keeps_nan():
    """The kernels' fp32 -> bf16 rounding (in fp32) equals torch's cast on finite values, infinities
    and overflow, and keeps NaN: the GPU's NaN (bits 0x7FFFFFFF) used to carry into the sign bit
    and come out as -0."""
    bits = torch.tensor([0x7FFFFFFF, 0x7FC00000, 0xFFFFFFFF, 0x7F800001], dtype=torch.int64).to(torch.int32)
    nans = bits.view(torch.float32)
    finite = torch.tensor([1.0, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-20), 3.4028235e38, -3.4e38, 1e-40, 0.0,
                           float("inf"), float("-inf"), -0.0, 2.5e-39])
    x = torch.cat([nans, finite, torch.randn(16)]).to(DEVICE)
    out = torch.empty_like(x)
    _rounded_kernel[(1,)](x, out, N=x.numel())
    assert out[:4].isnan().all()
    expected = x[4:].bfloat16().float()
    assert torch.equal(out[4:].view(torch.int32), expected.view(torch.int32))
