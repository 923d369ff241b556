"""One rank of the NVLink transport's backward check (spawned by test_nvlink_gpu.py; ranks may share one GPU).

Every rank builds the same global fp32 inputs on the GPU (:func:`step_inputs`, fixed seeds), runs
``ep_moe`` with grad on its own share over an ``nvlink`` group, backpropagates its share of a fixed
output gradient, and compares its gradients of ``x``, ``topk_weights``, ``w13``, ``w2`` (and the
biases) with those of the local transport (``R`` virtual ranks on this GPU, the same kernels) for
the same global inputs: ``x`` and ``topk_weights`` against the local gradient's row of this rank,
the weights against the local gradient's rows of this rank's home experts (zeros elsewhere when
all ``E`` were passed). Equality is bit for bit (``torch.equal``): both transports run the same
kernels on the same per-rank shapes and add the borrowed experts' gradients in the same order.
Then ``EPMoE`` trains one step and its expert gradients equal the local layer's likewise.

Prints ``PASSED`` (exit 0) when every check of this rank passed.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from flatep import EPConfig, EPMoE, ep_moe, init_group
from tests.helpers import make_inputs

TOKENS = 64
CONFIG = EPConfig(ranks=2, experts=8, top_k=3, hidden=256, intermediate=128, capacity=TOKENS, align=16)
# (policy, routing, weights form): "one" sends every token to one expert, so exact borrows it;
# "full" passes all E experts (with biases), "slice" this rank's E/R (without), as EPMoE does.
CASES = [("exact", "one", "full"), ("exact", "one", "slice"), ("exact", 2.0, "full"), ("none", 2.0, "slice")]


def step_inputs(routing, biases: bool) -> dict[str, torch.Tensor | None]:
    """Global inputs: ``x [R, s, H]``, ``topk_ids``, ``topk_weights [R, s, K]``, weights, ``grad_out [R, s, H]``."""
    x, ids, weights, w13, w2 = make_inputs(CONFIG, TOKENS, routing, torch.float32, seed=3)
    generator = torch.Generator().manual_seed(4)
    b13 = torch.randn(CONFIG.experts, 2 * CONFIG.intermediate, generator=generator) * 0.1 if biases else None
    b2 = torch.randn(CONFIG.experts, CONFIG.hidden, generator=generator) * 0.1 if biases else None
    grad_out = torch.randn(CONFIG.ranks, TOKENS, CONFIG.hidden, generator=generator)
    tensors = dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2, b13=b13, b2=b2, grad_out=grad_out)
    return {name: None if t is None else t.cuda() for name, t in tensors.items()}


def differentiate(group, inputs, leaves, policy, rank=None):
    """Gradients of ``sum(ep_moe(...) * grad_out)`` with respect to ``leaves`` (``rank``: this rank's share)."""
    share = (lambda t: t) if rank is None else (lambda t: t[rank])
    out = ep_moe(leaves["x"], share(inputs["topk_ids"]), leaves["topk_weights"], leaves["w13"], leaves["w2"],
                 b13=leaves["b13"], b2=leaves["b2"], config=CONFIG, group=group, policy=policy)
    names = [name for name, t in leaves.items() if t is not None]
    return dict(zip(names, torch.autograd.grad(out, [leaves[n] for n in names], share(inputs["grad_out"]))))


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=world)
    group = init_group(transport="nvlink", barrier_timeout=30.0)
    local = init_group("local", ranks=world, device="cuda")
    epn = CONFIG.experts_per_rank
    mine = slice(rank * epn, (rank + 1) * epn)
    failures = []

    def log(message):
        print(f"[rank {rank}] {message}", flush=True)

    for policy, routing, form in CASES:
        inputs = step_inputs(routing, biases=form == "full")
        weights = {name: inputs[name] for name in ("w13", "w2", "b13", "b2")}
        ours = {"x": inputs["x"][rank], "topk_weights": inputs["topk_weights"][rank],
                **{name: None if t is None else t if form == "full" else t[mine] for name, t in weights.items()}}
        ours = {name: None if t is None else t.clone().requires_grad_() for name, t in ours.items()}
        got = differentiate(group, inputs, ours, policy, rank)
        theirs = {"x": inputs["x"], "topk_weights": inputs["topk_weights"], **weights}
        theirs = {name: None if t is None else t.clone().requires_grad_() for name, t in theirs.items()}
        expected = differentiate(local, inputs, theirs, policy)
        for name, grad in got.items():
            reference = expected[name][rank] if name in ("x", "topk_weights") else expected[name][mine]
            if name not in ("x", "topk_weights") and form == "full":
                outside = torch.cat([grad[: mine.start], grad[mine.stop :]])
                if outside.numel() and outside.abs().max() > 0:
                    failures.append(f"{policy}/{routing}/{form}: {name} has gradients outside this rank's experts")
                grad = grad[mine]
            if not torch.equal(grad, reference):
                error = float((grad.double() - reference.double()).norm() / reference.double().norm().clamp_min(1e-30))
                failures.append(f"{policy}/{routing}/{form}: {name} differs from the local transport (relative {error:.2e})")
        log(f"{policy}/{routing}/{form}: compared {sorted(got)}")
    # EPMoE: the same layer on both transports (this rank holds its E/R experts), one backward.
    torch.manual_seed(0)
    reference = EPMoE(CONFIG, local, dtype=torch.float32)
    layer = EPMoE(CONFIG, group, dtype=torch.float32)
    with torch.no_grad():
        layer.router.copy_(reference.router)
        layer.w13.copy_(reference.w13[mine])
        layer.w2.copy_(reference.w2[mine])
    x = torch.randn(world, TOKENS, CONFIG.hidden, generator=torch.Generator().manual_seed(9)).cuda()
    layer(x[rank]).square().sum().backward()
    reference(x).square().sum().backward()
    for name in ("w13", "w2"):
        if not torch.equal(getattr(layer, name).grad, getattr(reference, name).grad[mine]):
            failures.append(f"EPMoE: {name} gradient differs from the local transport's")
    torch.cuda.synchronize()
    group.check()
    log("FAILED: " + "; ".join(failures) if failures else "PASSED")
    group.close()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
