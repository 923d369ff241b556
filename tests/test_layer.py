"""The EP layer equals a dense fp32 MoE, for every policy, backend and routing."""
from __future__ import annotations

import itertools

import pytest
import torch

from flatep import EPConfig, EPMoE, ExpertPool, dense_moe, ep_moe, init_group, make_plan, route
from flatep.plan.split import split_slot_rows
from flatep.routing import ADVERSARIAL
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs, relative_error, tolerance


def run_case(ranks, experts_per_rank, top_k, tokens, routing, policy, backend, dtype, capacity=None):
    experts = ranks * experts_per_rank
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=32, intermediate=16,
                      capacity=capacity or tokens, align=8)
    group = init_group("local", ranks=ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, tokens, routing, dtype, seed=ranks * 100 + tokens)
    plan = split_slot_rows(make_plan(ids, config, policy))  # the layout ep_moe's buffers follow
    group.buffer("shard", (plan.shard_rows, config.hidden), dtype).fill_(float("nan"))  # poison
    group.buffer("shard_weights", (plan.shard_rows,), torch.float32).fill_(float("nan"))
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, policy=policy, backend=backend)
    reference = dense_moe(x, ids, weights, w13, w2)
    assert out.shape == x.shape and out.dtype == dtype
    assert relative_error(out, reference) < tolerance(dtype)


MATRIX = [
    case
    for case in itertools.product([1, 2, 4, 8], [1, 8], [1, 2, 8], [1, 7, 16], [0.0, 1.0, 4.0, *ADVERSARIAL])
    if case[2] <= case[0] * case[1]
]


@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("ranks, experts_per_rank, top_k, tokens, routing", MATRIX)
def test_layer_equals_dense_torch_path(ranks, experts_per_rank, top_k, tokens, routing, policy):
    run_case(ranks, experts_per_rank, top_k, tokens, routing, policy, "torch", torch.float32, capacity=16)


@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize(
    "ranks, experts_per_rank, top_k, tokens, routing",
    [(1, 8, 2, 5, 1.0), (2, 1, 2, 7, "one"), (4, 2, 8, 3, 4.0), (8, 1, 1, 16, "next"), (4, 8, 2, 1, 0.0)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_equals_dense_triton_kernels(ranks, experts_per_rank, top_k, tokens, routing, policy, dtype):
    run_case(ranks, experts_per_rank, top_k, tokens, routing, policy, "triton", dtype, capacity=16)


@pytest.mark.parametrize("target", [0.0, 2.0, 10.0, 20.0])
def test_layer_holds_under_high_maxvio(target):
    from flatep.routing import maxvio, sigma_for_maxvio

    config = EPConfig(ranks=4, experts=128, top_k=2, hidden=32, intermediate=16, capacity=64, align=8)
    sigma, reached = sigma_for_maxvio(target, 4, 128, 2, 64)
    assert abs(reached - target) <= max(0.02 * target, 0.05)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 64, sigma, torch.bfloat16, seed=1234)  # the seed of the bisection
    assert maxvio(ids, 128) == pytest.approx(reached)
    for policy in ("exact", "none"):
        out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, policy=policy, backend="torch")
        assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < 1e-2


def test_pool_and_precomputed_plan_match_the_plain_call():
    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 3.0, torch.float32)
    plain = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch")
    pool = ExpertPool.from_weights(w13, w2, config, group)
    plan = make_plan(ids, config)
    again = ep_moe(x, ids, weights, config=config, group=group, pool=pool, plan=plan, backend="torch")
    assert torch.equal(plain, again)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_layers_share_one_set_of_slots(backend):
    """Two layers, one set of slots per process: each step computes with the experts it pushed."""
    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=32, intermediate=16, capacity=12, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    layers = []
    for seed in (1, 2):
        *_, w13, w2 = make_inputs(config, 12, 0.0, torch.float32, seed=seed)
        layers.append((w13, w2, ExpertPool.from_weights(w13, w2, config, group)))
    for name in ("w13", "w2"):
        assert layers[0][2].slots(name).data_ptr() == layers[1][2].slots(name).data_ptr()
        assert layers[0][2].home(name).shape[:2] == (4, config.experts_per_rank)
    # Alternate the layers with routings that borrow: a layer reading the other's slots would be wrong.
    for step, (w13, w2, pool) in enumerate([layers[0], layers[1], layers[0], layers[1]]):
        x, ids, weights, _, _ = make_inputs(config, 12, ("one", 4.0)[step % 2], torch.float32, seed=10 + step)
        assert bool((make_plan(ids, config).slot_experts >= 0).any())
        out = ep_moe(x, ids, weights, config=config, group=group, pool=pool, backend=backend)
        assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)


def test_slots_are_shared_by_shape_and_dtype_only():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=4, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    first, same = (ExpertPool(config, group, torch.float32) for _ in range(2))
    wider = ExpertPool(config.replace(intermediate=24), group, torch.float32)
    bf16 = ExpertPool(config, group, torch.bfloat16)
    assert first.slots("w2").data_ptr() == same.slots("w2").data_ptr()
    assert first.home("w2").data_ptr() != same.home("w2").data_ptr()
    for other in (wider, bf16):
        assert other.slots("w2").data_ptr() != first.slots("w2").data_ptr()
    assert first.slots("w13").shape == first.home("w13").shape == (2, 2, 32, 32)


@pytest.mark.parametrize("imbalance_tolerance, moves", [(0.0, True), (0.5, True), (3.0, False)])
def test_tolerance_lets_mild_skew_pass_without_moving_weights(imbalance_tolerance, moves):
    """All tokens to rank 0's experts: load 4x the mean. Tolerance 3 lets it pass unbalanced."""
    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=32, intermediate=16, capacity=8, align=4,
                      tolerance=imbalance_tolerance)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, "one", torch.float32, seed=7)
    plan = make_plan(ids, config)
    assert bool((plan.slot_experts >= 0).any()) == moves
    expected = [16] * 4 if moves else [64, 0, 0, 0]
    assert plan.received.tolist() == expected
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch")
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)


def test_module_routes_and_adds_shared_expert():
    config = EPConfig(ranks=2, experts=8, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    torch.manual_seed(0)
    layer = EPMoE(config, group, shared_intermediate=24, dtype=torch.float32, backend="torch")
    x = torch.randn(2, 8, 32, device=DEVICE)
    ids, weights = route(x @ layer.router.T, 2)
    assert torch.allclose(weights.sum(-1), torch.ones(2, 8, device=DEVICE))
    with torch.no_grad():
        out = layer(x)
        projected = x @ layer.shared_w13.T
        shared = (torch.nn.functional.silu(projected[..., :24]) * projected[..., 24:]) @ layer.shared_w2.T
        expected = dense_moe(x, ids, weights, layer.w13, layer.w2) + shared
    assert relative_error(out, expected) < 1e-5
    with torch.no_grad():
        layer.w13.mul_(2)  # the pool must follow the weights
        expected = dense_moe(x, ids, weights, layer.w13, layer.w2) + shared
        assert relative_error(layer(x), expected) < 1e-5


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda a: {**a, "x": a["x"][:, :, :16]}, "x must have shape"),
        (lambda a: {**a, "x": a["x"].half()}, "bfloat16 or float32"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:1]}, "topk_ids must have shape"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "int32 or int64"),
        (lambda a: {**a, "topk_ids": a["topk_ids"] + 16}, "not an expert id"),
        (lambda a: {**a, "topk_weights": a["topk_weights"].int()}, "floating-point"),
        (lambda a: {**a, "w13": a["w13"][:8]}, "w13 must have shape"),
        (lambda a: {**a, "w2": a["w2"].double()}, "bfloat16 or float32"),
        (lambda a: {**a, "x": a["x"].repeat(1, 2, 1), "topk_ids": a["topk_ids"].repeat(1, 2, 1),
                    "topk_weights": a["topk_weights"].repeat(1, 2, 1)}, "capacity"),
    ],
)
def test_bad_input_raises_before_any_kernel(change, message):
    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    args = change(dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2))
    with pytest.raises(ValueError, match=message):
        ep_moe(**args, config=config, group=group, backend="torch")


def test_non_contiguous_input_is_copied():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    strided = torch.randn(2, 8, 64, device=DEVICE)[..., ::2]
    strided.copy_(x)
    assert not strided.is_contiguous()
    out = ep_moe(strided, ids, weights, w13, w2, config=config, group=group, backend="torch")
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < 1e-5


def test_autograd_is_refused_clearly():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    with pytest.raises(NotImplementedError, match="no backward"):
        ep_moe(x.requires_grad_(), ids, weights, w13, w2, config=config, group=group)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fp32_combine_rounds_each_token_once(backend):
    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 3.0, torch.bfloat16)
    reference = dense_moe(x, ids, weights, w13, w2)
    rounded_rows = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend=backend, precision="native")
    fp32_rows = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend=backend, precision="native",
                       combine_dtype=torch.float32)
    assert fp32_rows.dtype == torch.bfloat16
    assert relative_error(fp32_rows, reference) < 1e-2
    assert not torch.equal(fp32_rows, rounded_rows)  # the per-row bf16 rounding is gone
    with pytest.raises(ValueError, match="combine_dtype"):
        ep_moe(x, ids, weights, w13, w2, config=config, group=group, combine_dtype=torch.float16)
