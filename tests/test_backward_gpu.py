"""On a GPU: the backward reads nothing back to the host, equals a dense fp64 MoE and repeats bit for bit."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, ep_moe, init_group, plan_step
from tests.test_backward import NAMES, check_against_dense, gradients, leaves

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def config(ranks=4):
    return EPConfig(ranks=ranks, experts=4 * ranks, top_k=4, hidden=256, intermediate=128, capacity=96, align=16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("routing, policy", [("one", "exact"), (2.0, "exact"), (2.0, "none")])
def test_backward_has_no_host_synchronisation(dtype, routing, policy):
    cfg = config()
    group = init_group("local", ranks=cfg.ranks, device="cuda", eager_check=False)
    ids, tensors = leaves(cfg, 96, routing, dtype=dtype)
    plan = plan_step(ids, cfg, group, policy)
    out = ep_moe(tensors["x"], ids, tensors["topk_weights"], tensors["w13"], tensors["w2"], b13=tensors["b13"],
                 b2=tensors["b2"], config=cfg, group=group, policy=policy, plan=plan)
    grad_out = torch.randn_like(out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = torch.autograd.grad(out, list(tensors.values()), grad_out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(grad).all() for grad in grads)
    if routing == "one" and policy == "exact":
        assert (plan.slot_experts >= 0).any()


@pytest.mark.parametrize("routing, policy", [("one", "exact"), (2.0, "exact"), ("next", "none")])
def test_gradients_equal_a_dense_fp64_moe_on_the_gpu(routing, policy):
    check_against_dense(config(), 64, routing, policy, "auto")


def test_the_same_step_twice_gives_bit_identical_gradients_on_the_gpu():
    cfg = config()
    group = init_group("local", ranks=cfg.ranks, device="cuda")
    ids, tensors = leaves(cfg, 96, "one", dtype=torch.bfloat16)
    grad_out = torch.randn(cfg.ranks, 96, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    step = lambda x, topk_weights, w13, w2, b13, b2: ep_moe(  # noqa: E731
        x, ids, topk_weights, w13, w2, b13=b13, b2=b2, config=cfg, group=group)
    first, second = gradients(step, tensors, grad_out), gradients(step, tensors, grad_out)
    assert all(torch.equal(first[name], second[name]) for name in NAMES)
