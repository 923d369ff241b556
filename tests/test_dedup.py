"""Send once per destination rank (EPConfig.dedup): plan tables, both planners, the layer against the dense MoE."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, dense_moe, ep_moe, init_group, make_plan
from flatep.kernels.backend import use_triton
from flatep.layer import shard_buffers
from flatep.plan.triton import make_plan_triton
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs, relative_error, tolerance


def config(dedup: bool = True, ranks: int = 4, top_k: int = 4) -> EPConfig:
    return EPConfig(ranks=ranks, experts=4 * ranks, top_k=top_k, hidden=32, intermediate=16, capacity=9, align=4,
                    dedup=dedup)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("routing", [0.0, 2.0, "one", "duplicate"])
def test_carriers_are_the_first_entry_per_rank_and_the_send_order_sorts_by_rank(dedup, routing):
    cfg = config(dedup)
    _, ids, _, _, _ = make_inputs(cfg, 9, routing, torch.float32, seed=7)
    tokens = [9, 4, 0, 7]
    plan = make_plan(ids, cfg, tokens=tokens)
    for rank in range(cfg.ranks):
        for token in range(9):
            dest = plan.dest_rank[rank, token].tolist()
            planned = [k for k in range(cfg.top_k) if dest[k] >= 0]
            carriers = [min(j for j in planned if dest[j] == dest[k]) if dedup else k for k in planned]
            assert [plan.carrier[rank, token, k].item() for k in planned] == carriers
            assert all(plan.carrier[rank, token, k] == -1 for k in range(cfg.top_k) if k not in planned)
            order = sorted(planned, key=lambda k: (dest[k], k))
            assert plan.send_order[rank, token].tolist() == order + [-1] * (cfg.top_k - len(order))


@pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("routing", [1.0, "one"])
def test_triton_planner_tables_are_bit_equal(dedup, routing):
    cfg = config(dedup, top_k=5)
    _, ids, _, _, _ = make_inputs(cfg, 9, routing, torch.float32, seed=3)
    reference, fast = make_plan(ids, cfg, tokens=[9, 2, 0, 9]), make_plan_triton(ids, cfg, tokens=[9, 2, 0, 9])
    for name in ("carrier", "send_order"):
        assert torch.equal(getattr(reference, name), getattr(fast, name)), name


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dedup_layer_equals_dense_with_poisoned_buffers(backend, policy, dtype):
    cfg = config(True)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(cfg, 9, 2.0, dtype, seed=5)
    for buffer in shard_buffers(group, cfg, policy, dtype):
        buffer.fill_(float("nan"))
    out = ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, policy=policy, backend=backend)
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) < tolerance(dtype)
    plan = make_plan(ids, cfg, policy)
    assert int((plan.carrier == torch.arange(cfg.top_k, device=DEVICE)).sum()) < int((plan.dest_rank >= 0).sum())


@pytest.mark.xfail(strict=True, reason="open bug: the backward through the deduplicated step gives wrong gradients")
@pytest.mark.parametrize("backend", TRITON_BACKENDS)
def test_dedup_gradients_match_the_plain_step(backend):
    """The backward through the deduplicated dispatch and combine equals the one without, within fp32 rounding."""
    grads = []
    for dedup in (True, False):
        cfg = config(dedup)
        group = init_group("local", ranks=cfg.ranks, device=DEVICE)
        x, ids, weights, w13, w2 = make_inputs(cfg, 9, 2.0, torch.float32, seed=6)
        leaves = [t.clone().requires_grad_() for t in (x, weights, w13, w2)]
        ep_moe(leaves[0], ids, leaves[1], leaves[2], leaves[3], config=cfg, group=group, backend=backend).square().sum().backward()
        grads.append([leaf.grad for leaf in leaves])
    for with_dedup, without in zip(*grads):
        assert relative_error(with_dedup, without) < 1e-5
