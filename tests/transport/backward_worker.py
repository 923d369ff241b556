"""One rank of the collective transport's backward check (spawned by test_collective.py over gloo).

Every rank builds the same global inputs (:func:`backward_steps`: the fixed :data:`CASES` and
:data:`RANDOM_STEPS` random ones, from fixed seeds), runs ``ep_moe`` with grad on its own share,
backpropagates its share of a fixed output gradient and saves the gradients of ``x``,
``topk_weights``, ``w13``, ``w2`` (and the biases) to ``rank<r>.pt``; the parent computes the
local transport's gradients for the same global inputs and compares.
"""
from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from flatep import EPConfig, ep_moe, init_group
from flatep.routing import skewed_topk
from tests.helpers import make_inputs, random_expert_weights

TOKENS = 16


def config_for(world: int) -> EPConfig:
    """The step's sizes for ``world`` ranks."""
    return EPConfig(ranks=world, experts=4 * world, top_k=3, hidden=32, intermediate=16, capacity=TOKENS, align=4)


# (policy, routing, weights form): "one" sends every token to one expert, so exact borrows it;
# "full" passes all E experts (with biases), "slice" this rank's E/R (without), as EPMoE does.
CASES = [("exact", "one", "full"), ("exact", "one", "slice"), ("none", 2.0, "full"), ("none", "one", "slice")]


def case_name(policy: str, routing: str | float, form: str) -> str:
    return f"{policy}-{routing}-{form}"


def step_inputs(world: int, routing: str | float, biases: bool) -> dict[str, torch.Tensor | None]:
    """Global fp32 inputs ``x [R, s, H]``, ``topk_ids``, ``topk_weights [R, s, K]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, ``b13 [E, 2I]`` and ``b2 [E, H]`` (or None), and ``grad_out [R, s, H]``."""
    config = config_for(world)
    # On the CPU also on a GPU machine: the workers and the local reference run plain torch there.
    x, ids, weights, w13, w2 = (t.cpu() for t in make_inputs(config, TOKENS, routing, torch.float32, seed=3))
    generator = torch.Generator().manual_seed(4)
    b13 = torch.randn(config.experts, 2 * config.intermediate, generator=generator) * 0.1 if biases else None
    b2 = torch.randn(config.experts, config.hidden, generator=generator) * 0.1 if biases else None
    grad_out = torch.randn(world, TOKENS, config.hidden, generator=generator)
    return dict(x=x, topk_ids=ids, topk_weights=weights, w13=w13, w2=w2, b13=b13, b2=b2, grad_out=grad_out)


RANDOM_STEPS = 12


@dataclass(frozen=True)
class BackwardStep:
    """One step of the check: ``form`` ``full`` passes all E experts' weights (with biases where
    ``inputs`` has them), ``slice`` this rank's E/R (as EPMoE does)."""

    name: str
    config: EPConfig
    policy: str
    form: str
    inputs: dict[str, torch.Tensor | None]


def random_backward_step(seed: int, world: int) -> BackwardStep:
    """A random group size, routing (skewed, or half of the entries on one expert), policy and form."""
    draw = random.Random(seed)
    experts = world * draw.choice([1, 2, 3])
    top_k = draw.randint(1, min(experts, 4))
    tokens = draw.randint(1, 8)
    config = EPConfig(ranks=world, experts=experts, top_k=top_k, hidden=draw.choice([8, 16, 32]),
                      intermediate=draw.choice([8, 16]), capacity=tokens, align=draw.choice([1, 4, 8]),
                      tolerance=draw.choice([0.0, 0.2]))
    generator = torch.Generator().manual_seed(seed)
    if draw.random() < 0.5:
        ids = torch.randint(0, experts, (world, tokens, top_k), generator=generator, dtype=torch.int32)
        ids[ids % 2 == 0] = draw.randrange(experts)
    else:
        ids = skewed_topk(world, experts, top_k, tokens, draw.choice([0.0, 2.0, 6.0]), seed=seed)
    form = draw.choice(["full", "slice"])
    hidden, intermediate = config.hidden, config.intermediate
    w13, w2 = random_expert_weights(config, "fp32", seed + 1, torch.device("cpu"))
    inputs = dict(
        x=torch.randn(world, tokens, hidden, generator=generator), topk_ids=ids,
        topk_weights=torch.rand(world, tokens, top_k, generator=generator) + 0.1, w13=w13, w2=w2,
        b13=torch.randn(experts, 2 * intermediate, generator=generator) * 0.1 if form == "full" else None,
        b2=torch.randn(experts, hidden, generator=generator) * 0.1 if form == "full" else None,
        grad_out=torch.randn(world, tokens, hidden, generator=generator),
    )
    policy = draw.choice(["exact", "none", "bounded"])
    return BackwardStep(f"random{seed}-E{experts}-K{top_k}-s{tokens}-{policy}-{form}", config, policy, form, inputs)


def backward_steps(world: int) -> list[BackwardStep]:
    """The fixed :data:`CASES`, then :data:`RANDOM_STEPS` random steps."""
    fixed = [BackwardStep(case_name(policy, routing, form), config_for(world), policy, form,
                          step_inputs(world, routing, biases=form == "full")) for policy, routing, form in CASES]
    return fixed + [random_backward_step(seed, world) for seed in range(RANDOM_STEPS)]


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=world)
    group = init_group(transport="collective")
    results: dict[str, dict[str, torch.Tensor]] = {}
    for step in backward_steps(world):
        inputs, epn = step.inputs, step.config.experts_per_rank
        mine = slice(rank * epn, (rank + 1) * epn)
        leaves = {
            "x": inputs["x"][rank], "topk_weights": inputs["topk_weights"][rank],
            **{name: None if inputs[name] is None else inputs[name] if step.form == "full" else inputs[name][mine]
               for name in ("w13", "w2", "b13", "b2")},
        }
        leaves = {name: None if t is None else t.clone().requires_grad_() for name, t in leaves.items()}
        out = ep_moe(leaves["x"], inputs["topk_ids"][rank], leaves["topk_weights"], leaves["w13"], leaves["w2"],
                     b13=leaves["b13"], b2=leaves["b2"], config=step.config, group=group, policy=step.policy)
        out.backward(inputs["grad_out"][rank])
        results[step.name] = {"out": out.detach(), **{name: t.grad for name, t in leaves.items() if t is not None}}
    torch.save(results, Path(sys.argv[2]) / f"rank{rank}.pt")
    print(f"rank {rank}: backward steps done", flush=True)
    group.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
