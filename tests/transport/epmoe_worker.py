"""One rank of the per-process EPMoE check (spawned by test_collective.py over gloo).

Ranks seed differently on purpose: the router and shared expert must still come out equal (rank
0's), each rank holds only its own E/R experts, and the layer equals a dense MoE built from every
rank's experts. With grad, its experts' gradients equal the local transport's layer's.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatep import EPConfig, EPMoE, dense_moe, init_group, route


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=world)
    torch.manual_seed(rank)
    config = EPConfig(ranks=world, experts=4 * world, top_k=3, hidden=32, intermediate=16, capacity=16, align=4)
    group = init_group(transport="collective")
    layer = EPMoE(config, group, shared_intermediate=8, dtype=torch.float32, backend="torch")
    assert layer.w13.shape[0] == config.experts_per_rank
    routers = group.all_gather(layer.router.detach())
    assert all(torch.equal(routers[0], r) for r in routers), "router differs across ranks"
    x = torch.randn(11, 32)
    with torch.no_grad():
        out = layer(x)
        ids, weights = route(x @ layer.router.T, config.top_k)
        w13 = group.all_gather(layer.w13.detach()).reshape(config.experts, 32, 32)
        w2 = group.all_gather(layer.w2.detach()).reshape(config.experts, 32, 16)
        projected = x @ layer.shared_w13.T
        shared = (F.silu(projected[:, :8]) * projected[:, 8:]) @ layer.shared_w2.T
        expected = dense_moe(x, ids, weights, w13, w2) + shared
    error = float((out - expected).norm() / expected.norm())
    assert error < 1e-5, error
    print(f"rank {rank}: EPMoE per process equals the dense MoE, relative error {error:.1e}")
    # Training: each rank backpropagates its tokens; its experts' gradients (its E/R, borrowed ones
    # sent back) equal those of the local transport's layer over every rank's tokens, bit for bit.
    local = init_group("local", ranks=world)
    reference = EPMoE(config, local, shared_intermediate=8, dtype=torch.float32, backend="torch")
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            mine = getattr(layer, name).detach()
            parameter.copy_(group.all_gather(mine).reshape(parameter.shape) if name in ("w13", "w2") else mine)
    xs = group.all_gather(x)
    grad = torch.randn(world, 11, 32, generator=torch.Generator().manual_seed(5))
    layer(x.requires_grad_()).backward(grad[rank])
    reference(xs.requires_grad_()).backward(grad)
    epn = config.experts_per_rank
    for name in ("w13", "w2"):
        expected = getattr(reference, name).grad[rank * epn : (rank + 1) * epn]
        assert torch.equal(getattr(layer, name).grad, expected), name
    assert float((x.grad - xs.grad[rank]).norm() / xs.grad[rank].norm()) < 1e-6
    print(f"rank {rank}: EPMoE per process trains like the local transport")
    group.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
