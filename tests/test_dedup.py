"""Send once per destination rank (EPConfig.dedup): plan tables, both planners, the layer against the dense MoE."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, dense_moe, ep_moe, init_group, make_plan
from flatep.kernels.backend import use_triton
from flatep.layer import shard_buffers
from flatep.plan.triton import make_plan_triton
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs, relative_error, tolerance
from tests.test_backward import check_against_dense, small_config


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


@pytest.mark.parametrize("backend, policy, dtype", [
    ("torch", "exact", torch.float32), ("torch", "none", torch.bfloat16),
    ("triton", "exact", torch.bfloat16), ("triton", "none", torch.float32),
])
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


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("dedup", [True, False])
def test_gradients_equal_the_dense_moe_with_and_without_dedup(backend, dedup):
    """The backward through the deduplicated step, and through the per-entry baseline, equals the fp64 dense MoE's."""
    cfg = small_config(ranks=2, top_k=3).replace(dedup=dedup)
    plan = check_against_dense(cfg, 5, 2.0, "exact", backend, seed=6)
    carried = int((plan.carrier == torch.arange(cfg.top_k, device=DEVICE)).sum())
    assert (carried < int((plan.dest_rank >= 0).sum())) == dedup  # tokens with several rows on one rank
