"""The EP layer equals a dense fp32 MoE, for every policy, backend and routing."""
from __future__ import annotations

import itertools

import pytest
import torch

import numpy as np

from flatep import EPConfig, EPMoE, ExpertPool, dense_moe, ep_moe, init_group, make_plan, plan_step, route
from flatep.kernels.backend import MAX_WORK_ITEMS, use_triton
from flatep.layer import prefetch_experts, shard_buffers
from flatep.routing import ADVERSARIAL
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs, relative_error, tolerance


def run_case(ranks, experts_per_rank, top_k, tokens, routing, policy, backend, dtype, capacity=None):
    experts = ranks * experts_per_rank
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=32, intermediate=16,
                      capacity=capacity or tokens, align=8)
    group = init_group("local", ranks=ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, tokens, routing, dtype, seed=ranks * 100 + tokens)
    for buffer in shard_buffers(group, config, policy, dtype):  # the buffers ep_moe uses: poisoned
        buffer.fill_(float("nan"))
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


def small_case(ranks=2, experts=4, tokens=8, routing=1.0, dtype=torch.float32, seed=0, **group_options):
    config = EPConfig(ranks=ranks, experts=experts, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=ranks, device=DEVICE, **group_options)
    return config, group, *make_inputs(config, tokens, routing, dtype, seed=seed)


@pytest.mark.parametrize("needs_grad", ["x", "topk_weights", "w13", "w2", "b13", "b2", "pool"])
def test_autograd_reaches_every_input_that_requires_grad_and_refuses_a_pool(needs_grad):
    """On the local transport every input of the step gets its gradient; a step through a pool has no backward."""
    config, group, x, ids, weights, w13, w2 = small_case()
    b13 = torch.randn(config.experts, 2 * config.intermediate, device=DEVICE)
    b2 = torch.randn(config.experts, config.hidden, device=DEVICE)
    tensors = dict(x=x, topk_weights=weights, w13=w13, w2=w2, b13=b13, b2=b2)
    if needs_grad == "pool":
        pool = ExpertPool.from_weights(w13, w2, config, group)
        pool.w2.requires_grad_()
        call = lambda: ep_moe(x, ids, weights, group=group, pool=pool)  # noqa: E731
    else:
        tensors[needs_grad].requires_grad_()
        call = lambda: ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"],  # noqa: E731
                              b13=tensors["b13"], b2=tensors["b2"], config=config, group=group)
    if needs_grad == "pool":
        with pytest.raises(NotImplementedError, match="no backward through a prebuilt pool= .* but pool.w2 require grad"):
            call()
    else:
        out = call()
        out.sum().backward()
        grad = tensors[needs_grad].grad
        assert grad is not None and grad.shape == tensors[needs_grad].shape and torch.isfinite(grad).all()
        assert grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.isfinite(call()).all()


def test_module_trains_with_grad_and_runs_without_it():
    """With grad on, EPMoE's router and experts get gradients; the values are those of the inference step."""
    config, group, x, *_ = small_case()
    layer = EPMoE(config, group, dtype=torch.float32, backend="torch")
    with torch.no_grad():
        expected = layer(x)
    with torch.inference_mode():
        assert torch.equal(layer(x), expected)
    out = layer(x)
    assert torch.equal(out, expected)
    out.square().sum().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and parameter.grad.abs().sum() > 0, name
    for parameter in layer.parameters():
        parameter.requires_grad_(False)
    inputs = x.clone().requires_grad_()
    layer(inputs).sum().backward()
    assert inputs.grad is not None and inputs.grad.abs().sum() > 0
    assert torch.equal(layer(x), expected)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("precision", ["fp32", "native"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_route_weights_propagate_like_the_dense_moe(backend, precision, bad):
    config, group, x, ids, weights, w13, w2 = small_case(ranks=4, experts=8, routing="one", seed=3)
    weights[1, 2, 0] = bad
    weights[3, 7, 1] = bad
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend=backend, precision=precision)
    dense = dense_moe(x, ids, weights, w13, w2)
    poisoned = torch.zeros(4, 8, dtype=torch.bool, device=DEVICE)
    poisoned[1, 2] = poisoned[3, 7] = True
    assert not torch.isfinite(dense[poisoned]).any()
    assert not torch.isfinite(out[poisoned]).any(), "a non-finite route weight was dropped"
    assert relative_error(out[~poisoned], dense[~poisoned]) < tolerance(torch.float32)


def test_plan_for_other_ids_raises_before_any_kernel():
    config, group, x, ids, weights, w13, w2 = small_case(ranks=4, experts=8, routing=2.0)
    other = ids.roll(1, dims=1)  # same histogram, other tokens: the plan's rows would mix experts
    plan = plan_step(ids, config, group)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    good = ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, backend="torch")
    assert relative_error(good, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)
    with pytest.raises(ValueError, match="not made for these topk_ids"):
        ep_moe(x, other, weights, group=group, pool=pool, plan=plan, backend="torch")
    with pytest.raises(ValueError, match="not made for these topk_ids"):  # a planner plan carries no fingerprint
        ep_moe(x, other, weights, group=group, pool=pool, plan=make_plan(ids, config), backend="torch")
    assert torch.equal(ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, backend="torch"), good)


def test_plan_for_another_step_raises_on_host_facts():
    config, group, x, ids, weights, w13, w2 = small_case(ranks=4, experts=8, routing=2.0)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    with pytest.raises(ValueError, match="policy 'none'"):
        ep_moe(x, ids, weights, group=group, pool=pool, plan=plan_step(ids, config, group, "none"))
    with pytest.raises(ValueError, match="ids of shape"):
        ep_moe(x[:, :5], ids[:, :5], weights[:, :5], group=group, pool=pool, plan=plan_step(ids, config, group))
    looser = config.replace(tolerance=1.0)
    with pytest.raises(ValueError, match="plan was made for EPConfig"):
        ep_moe(x, ids, weights, config=config, group=group, pool=pool, plan=plan_step(ids, looser, group))


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_without_eager_checks_a_wrong_plan_sets_a_flag_that_check_raises(backend):
    """No read-back in the step (as inside a CUDA graph): the error waits for group.check(), and
    destinations beyond the shard are clamped into it rather than written out of bounds."""
    config, group, x, ids, weights, w13, w2 = small_case(ranks=4, experts=8, routing=2.0, eager_check=False)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    plan = plan_step(ids, config, group)
    group.check()  # nothing recorded yet
    ep_moe(x, ids.roll(1, dims=1), weights, group=group, pool=pool, plan=plan, backend=backend)
    with pytest.raises(ValueError, match="not made for these topk_ids"):
        group.check()
    group.check()  # the flags were cleared: the group goes on
    wild = make_plan(ids, config)
    wild.dest_row[0, 0, 0] = 10**6
    shard, _ = shard_buffers(group, config, "exact", torch.float32)
    tail = shard[:, -1:].clone()
    ep_moe(x, ids, weights, group=group, pool=pool, plan=wild, backend=backend)
    with pytest.raises(ValueError, match="outside its expert's rows"):
        group.check()
    out = ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, backend=backend)
    group.check()
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)
    del tail


def test_bad_ids_raise_at_once_on_cpu_even_without_eager_checks():
    config, group, x, ids, weights, w13, w2 = small_case(eager_check=False)
    group = init_group("local", ranks=config.ranks, device="cpu", eager_check=False)
    x, ids, weights, w13, w2 = (tensor.cpu() for tensor in (x, ids, weights, w13, w2))
    bad = ids.clone()
    bad[1, 3, 0] = config.experts
    with pytest.raises(ValueError, match="not an expert id"):  # the CPU reference planner raises at once
        ep_moe(x, bad, weights, w13, w2, config=config, group=group)


def test_plan_prints_a_summary():
    config, group, x, ids, *_ = small_case(ranks=4, experts=8, routing="one")
    plan = plan_step(ids, config, group)
    text = repr(plan)
    assert str(plan) == text and len(text.splitlines()) == 3 and "tensor(" not in text
    assert "policy='exact'" in text and "ranks=4" in text and "s=8" in text
    assert f"rows per rank: {plan.received.tolist()}" in text
    borrowed = {rank: [e for e in slots if e >= 0] for rank, slots in enumerate(plan.slot_experts.tolist())}
    assert any(borrowed.values())  # all tokens to one expert: others borrow it
    assert f"borrowed experts by rank: { {rank: e for rank, e in borrowed.items() if e} }" in text


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(config={"ranks": 2}), "config must be a flatep.EPConfig, got dict"),
        (dict(group="local"), "group must be a flatep Group"),
        (dict(topk_ids=[[0, 1]]), "topk_ids must be a torch.Tensor, got list"),
        (dict(x=np.zeros((2, 8, 32))), "x must be a torch.Tensor, got ndarray"),
    ],
)
def test_wrong_argument_types_raise_clearly(change, message):
    config, group, x, ids, weights, w13, w2 = small_case()
    arguments = dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2, config=config, group=group) | change
    with pytest.raises(ValueError, match=message):
        ep_moe(**arguments)
    if "x" not in change and "topk_ids" not in change:
        with pytest.raises(ValueError, match=message):
            plan_step(ids, arguments["config"], arguments["group"])


def test_numpy_integer_sizes_are_accepted():
    config = EPConfig(ranks=np.int64(2), experts=np.int32(4), top_k=np.int64(2), hidden=32, intermediate=16,
                      capacity=np.int64(8), align=4)
    assert config == EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    assert type(config.ranks) is int
    assert init_group("local", ranks=np.int64(2), device="cpu").world == 2
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        init_group("local", ranks=2.0, device="cpu")


def test_buffers_are_sized_from_the_capacity_not_each_step():
    """A run that sees many batch sizes holds the memory of its first step, no more."""
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=24, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    *_, w13, w2 = make_inputs(config, 24, 0.0, torch.float32)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    sizes = [1 + (step * 7) % 20 for step in range(50)]
    assert len(set(sizes)) == 20
    held = []
    for step, tokens in enumerate(sizes):
        x, ids, weights, _, _ = make_inputs(config, tokens, ("one", 2.0)[step % 2], torch.float32, seed=step)
        out = ep_moe(x, ids, weights, group=group, pool=pool, backend="torch")
        if step < 2:
            assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)
        held.append(group.buffer_bytes())
    assert held == [held[0]] * 50


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
    # The per-row bf16 rounding is gone: closer to the dense fp32 MoE, not merely different.
    assert relative_error(fp32_rows, reference) < relative_error(rounded_rows, reference) < 1e-2
    with pytest.raises(ValueError, match="combine_dtype"):
        ep_moe(x, ids, weights, w13, w2, config=config, group=group, combine_dtype=torch.float16)
    with pytest.raises(ValueError, match="needs precision='native'"):  # would pay twice the bytes for nothing
        ep_moe(x, ids, weights, w13, w2, config=config, group=group, combine_dtype=torch.float32)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_comm_programs_cap_gives_bit_identical_steps(backend, policy):
    config, group, x, ids, weights, w13, w2 = small_case(ranks=4, experts=8, routing="one", dtype=torch.bfloat16, seed=4)
    pool = ExpertPool.from_weights(w13, w2, config, group)
    outs = [ep_moe(x, ids, weights, group=group, pool=pool, policy=policy, backend=backend, comm_programs=programs)
            for programs in (None, 1, 3)]
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    assert relative_error(outs[0], dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.bfloat16)
    for bad in (0, 2.5, False):
        with pytest.raises(ValueError, match="comm_programs must be None or a positive int"):
            ep_moe(x, ids, weights, group=group, pool=pool, comm_programs=bad)


def test_two_slot_sets_alternate_by_layer():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=4, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    pools = [ExpertPool(config, group, torch.float32, layer=layer, slot_sets=2) for layer in range(3)]
    single = ExpertPool(config, group, torch.float32, layer=1)
    for name in ("w13", "w2"):
        assert pools[0].slots(name).data_ptr() == pools[2].slots(name).data_ptr() == single.slots(name).data_ptr()
        assert pools[1].slots(name).data_ptr() != pools[0].slots(name).data_ptr()
    assert [pool.slot_set for pool in pools] == [0, 1, 0] and single.slot_set == 0
    for bad in (dict(slot_sets=3), dict(slot_sets=True), dict(layer=-1), dict(layer=1.0)):
        with pytest.raises(ValueError, match="slot_sets must be 1 or 2|layer must be a non-negative int"):
            ExpertPool(config, group, torch.float32, **bad)
        with pytest.raises(ValueError, match="slot_sets must be 1 or 2|layer must be a non-negative int"):
            EPMoE(config, group, dtype=torch.float32, **bad)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_prefetched_push_of_the_next_layer_gives_bit_identical_steps(backend):
    """Two slot sets: layer 1's experts are pushed before layer 0 runs; both layers equal their plain steps."""
    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    layers = []
    for layer, routing in enumerate(("one", 3.0)):
        x, ids, weights, w13, w2 = make_inputs(config, 8, routing, torch.float32, seed=20 + layer)
        pool = ExpertPool.from_weights(w13, w2, config, group, layer=layer, slot_sets=2)
        plan = plan_step(ids, config, group)
        assert bool((plan.slot_experts >= 0).any())
        layers.append((x, ids, weights, pool, plan))
    plain = [ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, backend=backend)
             for x, ids, weights, pool, plan in layers]
    for pool in (layers[0][3], layers[1][3]):
        for name in pool.names:
            pool.slots(name).fill_(float("nan"))
    x, ids, weights, pool, plan = layers[1]
    ahead = prefetch_experts(pool, plan, backend, comm_programs=2)
    with pytest.raises(ValueError, match="already holds a prefetch"):
        prefetch_experts(pool, plan, backend)
    first = ep_moe(*layers[0][:3], group=group, pool=layers[0][3], plan=layers[0][4], backend=backend)
    with pytest.raises(ValueError, match="another pool or plan"):
        ep_moe(x, ids, weights, group=group, pool=pool, plan=layers[0][4], pushed=ahead, backend=backend)
    second = ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, pushed=ahead, backend=backend)
    assert torch.equal(first, plain[0]) and torch.equal(second, plain[1])
    with pytest.raises(ValueError, match="already used by a step"):
        ep_moe(x, ids, weights, group=group, pool=pool, plan=plan, pushed=ahead, backend=backend)


def test_a_step_refuses_to_overwrite_a_prefetch_in_its_slot_set():
    """One slot set: layer 1's prefetch would be overwritten by layer 0's own push, so layer 0 raises."""
    config = EPConfig(ranks=4, experts=8, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, "one", torch.float32, seed=5)
    pools = [ExpertPool.from_weights(w13, w2, config, group, layer=layer) for layer in range(2)]
    plan = plan_step(ids, config, group)
    expected = ep_moe(x, ids, weights, group=group, pool=pools[1], plan=plan, backend="torch")
    ahead = prefetch_experts(pools[1], plan, "torch")
    with pytest.raises(ValueError, match="would overwrite slots that hold a prefetch"):
        ep_moe(x, ids, weights, group=group, pool=pools[0], backend="torch")
    assert torch.equal(ep_moe(x, ids, weights, group=group, pool=pools[1], plan=plan, pushed=ahead, backend="torch"), expected)
    assert torch.equal(ep_moe(x, ids, weights, group=group, pool=pools[0], backend="torch"), expected)


def test_module_passes_comm_programs_and_slot_set():
    config, group, x, *_ = small_case(ranks=4, experts=8)
    torch.manual_seed(3)
    plain = EPMoE(config, group, dtype=torch.float32)
    torch.manual_seed(3)
    tuned = EPMoE(config, group, dtype=torch.float32, comm_programs=1, layer=1, slot_sets=2)
    with torch.no_grad():
        assert torch.equal(tuned(x), plain(x))
    assert tuned.expert_pool().slot_set == 1 and plain.expert_pool().slot_set == 0


@pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
def test_a_step_beyond_the_kernels_launch_limits_raises_before_anything_runs():
    tokens = MAX_WORK_ITEMS * 2 + 1  # dispatch moves 2 tokens per work item
    config = EPConfig(ranks=1, experts=2, top_k=1, hidden=8, intermediate=8, capacity=tokens, align=1)
    group = init_group("local", ranks=1, device=DEVICE)
    # Expanded views: the shapes of a huge step without its memory (nothing may be copied or read).
    x = torch.zeros(1, 1, 8, device=DEVICE).expand(1, tokens, 8)
    ids = torch.zeros(1, 1, 1, dtype=torch.int32, device=DEVICE).expand(1, tokens, 1)
    weights = torch.ones(1, 1, 1, device=DEVICE).expand(1, tokens, 1)
    w13, w2 = torch.zeros(2, 16, 8, device=DEVICE), torch.zeros(2, 8, 8, device=DEVICE)
    with pytest.raises(ValueError, match="token blocks in one launch exceed"):
        ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="triton")


def test_auto_buffers_hold_every_step_without_doubling_the_classic_half():
    """auto's receive buffers: a home half sized like classic's plus the slot half of the largest
    step, enough for the split plan of every step size (they were twice classic's, 113 GiB at
    Kimi-K2 with s = 8192, which no GPU holds)."""
    from flatep.layer import buffer_rows
    from flatep.plan.split import split_slot_rows

    config = EPConfig(ranks=4, experts=16, top_k=4, hidden=8, intermediate=8, capacity=64, align=16)
    rows = buffer_rows(config, "auto")
    assert config.shard_rows("none") < rows < 2 * config.shard_rows("none")
    for step in (1, 3, 17, 64):
        ids = torch.randint(0, config.experts, (config.ranks, step, config.top_k), dtype=torch.int32)
        ids[:, :, 0] = 0  # skewed: the exact candidates borrow
        plan = split_slot_rows(make_plan(ids, config, "auto"))
        assert plan.shard_rows <= rows, step


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_auto_where_moving_never_pays_runs_the_classic_step(backend):
    """A step where no moving candidate can pay (a slow link, decode sizes) is planned as classic:
    no slot half, no model, the classic plan itself; the plan says it was made for auto and is
    accepted back by ep_moe(policy="auto"); the layer equals the dense MoE. Larger steps of the
    same layer still plan auto."""
    from flatep import CostProfile
    from flatep.plan.auto import moving_never_pays

    slow_link = CostProfile(link_gbps=10.0, hbm_gbps=2700.0, gemm_tflops=620.0, group_us=2.0, push_us=20.0, tile_rows=128)
    config = EPConfig(ranks=4, experts=16, top_k=2, hidden=256, intermediate=128, capacity=64)
    group = init_group("local", ranks=4, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 2, "one", torch.float32, seed=5)
    assert moving_never_pays(config, slow_link, config.ranks * 2)
    plan = plan_step(ids, config, group, "auto", cost=slow_link)
    assert plan.policy == "none" and plan.auto is None and plan.made_for.policy == "auto"
    classic = plan_step(ids, config, group, "none")
    assert torch.equal(plan.dest_row, classic.dest_row) and torch.equal(plan.offsets, classic.offsets)
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, policy="auto", cost=slow_link, plan=plan,
                 backend=backend)
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(torch.float32)
    big = make_inputs(config, 64, 3.0, torch.float32, seed=6)[1]
    assert not moving_never_pays(config, slow_link, config.ranks * 64)
    assert plan_step(big, config, group, "auto", cost=slow_link).policy == "auto"
