"""Random layer steps (hypothesis): every policy equals the dense MoE, forward and backward.

The fixed matrices of ``test_layer.py`` and ``tests/quant/test_layer_quant.py`` cover chosen
shapes; here hypothesis draws the group (1-4 ranks, up to 3 experts a rank, top-k up to 6), the
weights' format, the routing (skewed, adversarial, uniform with an expert repeated within a
token, one hot expert), per-rank token counts (rows past a rank's count are padding), the
planner's tolerance and the dispatch dtype, on the plain-torch path (fast enough for many
examples; the Triton kernels' own matrices run them under the interpreter).

``FLATEP_PROPERTY_EXAMPLES=N`` multiplies every test's examples by ``N`` (a longer search, e.g. 100
before a release); by default each draws the same examples every run.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flatep import EPConfig, ExpertPool, dense_moe, ep_moe, init_group, plan_step
from flatep.layer import prefetch_experts
from flatep.quant import dequantize_fp8_activations, quantize_fp8_activations
from flatep.routing import ADVERSARIAL, adversarial_topk, skewed_topk
from tests.helpers import DEVICE, borrowing_cost, dense_fp8_activations, random_expert_weights, relative_error

POLICIES = ("exact", "none", "bounded", "auto")
SIZES = {"fp32": (16, 8), "bf16": (16, 8), "mxfp4": (128, 128), "fp8": (128, 128)}  # (hidden, intermediate)
# Against the dense fp32 MoE over the weights as the pool holds them: fp32 exact up to summation
# order; bf16 and mxfp4 (exact in bf16) up to bf16 roundings of the activations, which for a single
# token of a 16-wide row reach 1-2%; fp8 against the dense MoE that quantizes its activations alike.
ERROR = {"fp32": 1e-5, "bf16": 3e-2, "mxfp4": 3e-2, "fp8": 1e-2}
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
EXAMPLE_SCALE = int(os.environ.get("FLATEP_PROPERTY_EXAMPLES", "1"))


@st.composite
def steps(draw, formats=tuple(SIZES)):
    """``(config, x [R, s, H], topk_ids [R, s, K], route weights, tokens or None, format, seed)``."""
    ranks = draw(st.sampled_from([1, 2, 3, 4]))
    experts = ranks * draw(st.integers(1, 3))
    top_k = draw(st.integers(1, min(experts, 6)))
    format = draw(st.sampled_from(formats))
    hidden, intermediate = SIZES[format]
    step = draw(st.integers(1, 6))
    config = EPConfig(ranks=ranks, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                      capacity=draw(st.integers(step, 8)), align=draw(st.sampled_from([1, 4, 8])),
                      tolerance=draw(st.sampled_from([0.0, 0.2, 1.0])))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    kind = draw(st.sampled_from(["skewed", "repeats", "hot", *ADVERSARIAL]))
    if kind == "skewed":
        ids = skewed_topk(ranks, experts, top_k, step, draw(st.sampled_from([0.0, 2.0, 6.0])), seed=seed)
    elif kind in ("repeats", "hot"):  # uniform ids, an expert may repeat within a token; or half on one
        ids = torch.randint(0, experts, (ranks, step, top_k), generator=generator, dtype=torch.int32)
        if kind == "hot":
            ids[ids % 2 == 0] = draw(st.integers(0, experts - 1))
    else:
        ids = adversarial_topk(kind, ranks, experts, top_k, step)
    tokens = draw(st.none() | st.lists(st.integers(0, step), min_size=ranks, max_size=ranks).filter(any))
    dtype = torch.float32 if format == "fp32" else torch.bfloat16
    x = torch.randn(ranks, step, hidden, generator=generator).to(dtype)
    route_weights = torch.rand(ranks, step, top_k, generator=generator) + 0.1
    return config, x.to(DEVICE), ids.to(DEVICE), route_weights.to(DEVICE), tokens, format, seed


def expert_weights(config: EPConfig, format: str, seed: int):
    """``(w13, w2)`` as the pool takes them (:func:`tests.helpers.random_expert_weights`), and their fp32 values."""
    w13, w2 = random_expert_weights(config, format, seed + 1)
    if format in ("fp8", "mxfp4"):
        return (w13, w2), (w13.dequantize(), w2.dequantize())
    return (w13, w2), (w13.float(), w2.float())


@settings(max_examples=60 * EXAMPLE_SCALE, **SETTINGS)
@given(case=steps(), dispatch_fp8=st.booleans(), link_gbps=st.sampled_from([1e-3, 1e6]))
def test_every_policy_equals_the_dense_moe_on_the_real_tokens(case, dispatch_fp8, link_gbps):
    config, x, ids, route_weights, tokens, format, seed = case
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    (w13, w2), (d13, d2) = expert_weights(config, format, seed)
    pool = ExpertPool.from_weights(w13, w2, config, group, dtype=x.dtype)
    dispatch = torch.float8_e4m3fn if dispatch_fp8 and x.dtype == torch.bfloat16 else None
    # fp8 dispatch quantizes the tokens once before they cross: the reference takes them so.
    sent = x if dispatch is None else dequantize_fp8_activations(
        *quantize_fp8_activations(x.reshape(-1, config.hidden))).view(x.shape)
    outputs = {}
    for policy in POLICIES:
        cost = borrowing_cost(link_gbps).with_expert_bytes(pool.expert_nbytes()) if policy == "auto" else None
        plan = plan_step(ids, config, group, policy, tokens=tokens, cost=cost, dispatch_dtype=dispatch)
        outputs[policy] = ep_moe(x, ids, route_weights, config=config, group=group, pool=pool, policy=policy,
                                 plan=plan, cost=cost, dispatch_dtype=dispatch, backend="torch")
    for rank in range(config.ranks):
        real = x.shape[1] if tokens is None else tokens[rank]
        if real == 0:
            continue
        rows = (slice(rank, rank + 1), slice(0, real))
        dense = dense_fp8_activations if format == "fp8" else dense_moe
        reference = dense(sent[rows].float(), ids[rows], route_weights[rows], d13, d2)
        for policy, out in outputs.items():
            assert relative_error(out[rows], reference) < ERROR[format], (policy, rank)


@settings(max_examples=8 * EXAMPLE_SCALE, **SETTINGS)
@given(case=steps(), policy=st.sampled_from(["exact", "none"]))
def test_the_triton_kernels_equal_the_torch_path(case, policy):
    """The same random steps through the Triton kernels (interpreted on a CPU): the torch path's
    output, up to a few bf16 roundings (the kernels' exp and summation order differ from torch's)."""
    config, x, ids, route_weights, tokens, format, seed = case
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    (w13, w2), _ = expert_weights(config, format, seed)
    pool = ExpertPool.from_weights(w13, w2, config, group, dtype=x.dtype)
    plan = plan_step(ids, config, group, policy, tokens=tokens)
    torch_path, kernels = (ep_moe(x, ids, route_weights, config=config, group=group, pool=pool, policy=policy,
                                  plan=plan, backend=backend) for backend in ("torch", "triton"))
    for rank in range(config.ranks):
        real = x.shape[1] if tokens is None else tokens[rank]
        rows = (slice(rank, rank + 1), slice(0, real))
        assert relative_error(kernels[rows], torch_path[rows]) < (1e-5 if format == "fp32" else 1e-2), rank


@settings(max_examples=40 * EXAMPLE_SCALE, **SETTINGS)
@given(case=steps(formats=("fp32",)), policy=st.sampled_from(["exact", "none", "bounded"]), biases=st.booleans())
def test_gradients_equal_the_dense_moes(case, policy, biases):
    config, x, ids, route_weights, tokens, _, seed = case
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    _, (w13, w2) = expert_weights(config, "fp32", seed)
    generator = torch.Generator().manual_seed(seed + 2)
    leaves = {"x": x, "route_weights": route_weights, "w13": w13, "w2": w2}
    if biases:
        leaves["b13"] = torch.randn(config.experts, 2 * config.intermediate, generator=generator).to(DEVICE) * 0.1
        leaves["b2"] = torch.randn(config.experts, config.hidden, generator=generator).to(DEVICE) * 0.1
    output_grad = torch.randn(x.shape, generator=generator).to(DEVICE)
    results = []
    for layer in ("ep", "dense"):
        inputs = {name: value.clone().requires_grad_(True) for name, value in leaves.items()}
        arguments = (inputs["x"], ids, inputs["route_weights"], inputs["w13"], inputs["w2"])
        biases_given = dict(b13=inputs.get("b13"), b2=inputs.get("b2"))
        if layer == "ep":
            out = ep_moe(*arguments, **biases_given, config=config, group=group, policy=policy, backend="torch")
        else:
            out = dense_moe(*arguments, **biases_given)
        (out * output_grad).sum().backward()
        results.append((out.detach(), {name: value.grad for name, value in inputs.items()}))
    (out, grads), (reference, reference_grads) = results
    assert relative_error(out, reference) < 1e-5
    for name, reference_grad in reference_grads.items():
        assert relative_error(grads[name], reference_grad) < 1e-4, name


@pytest.mark.parametrize("slot_sets", [1, 2])
@settings(max_examples=12 * EXAMPLE_SCALE, **SETTINGS)
@given(case=steps(formats=("bf16", "mxfp4")), layers=st.integers(2, 4))
def test_prefetched_layers_equal_layers_that_push_for_themselves(case, layers, slot_sets):
    """Layers sharing slot sets, each step's borrowed experts pushed ahead by :func:`prefetch_experts`
    (with two sets, layer ``L+1``'s before layer ``L``'s step), give the same bits as steps that
    push their own."""
    config, x, ids, route_weights, tokens, format, seed = case
    group = init_group("local", ranks=config.ranks, device=DEVICE)
    pools = [ExpertPool.from_weights(*expert_weights(config, format, seed + layer)[0], config, group, dtype=x.dtype,
                                     layer=layer, slot_sets=slot_sets) for layer in range(layers)]
    routes = [(ids + layer) % config.experts for layer in range(layers)]  # a routing per layer

    def run(prefetch: bool) -> list[torch.Tensor]:
        plans = [plan_step(route, config, group, "exact", tokens=tokens) for route in routes]
        pushed = {0: prefetch_experts(pools[0], plans[0], backend="torch")} if prefetch else {}
        hidden, outputs = x, []
        for layer in range(layers):
            ahead = layer + 1 if slot_sets == 2 else None  # two sets: the next layer's push before this step
            if prefetch and ahead is not None and ahead < layers:
                pushed[ahead] = prefetch_experts(pools[ahead], plans[ahead], backend="torch")
            ahead_of_step = {"pushed": pushed.pop(layer)} if layer in pushed else {}
            out = ep_moe(hidden, routes[layer], route_weights, config=config, group=group, pool=pools[layer],
                         plan=plans[layer], backend="torch", **ahead_of_step)
            if prefetch and slot_sets == 1 and layer + 1 < layers:
                pushed[layer + 1] = prefetch_experts(pools[layer + 1], plans[layer + 1], backend="torch")
            outputs.append(out)
            hidden = (hidden.float() + out.float()).to(x.dtype)
        return outputs

    real = [x.shape[1]] * config.ranks if tokens is None else tokens  # rows past a rank's count are padding
    for plain, prefetched in zip(run(False), run(True)):
        for rank, count in enumerate(real):
            assert torch.equal(plain[rank, :count], prefetched[rank, :count])
