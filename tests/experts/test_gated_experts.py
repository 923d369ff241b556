"""Expert biases and other gated activations (gpt-oss) through the EP layer equal the dense MoE."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, ExpertPool, dense_moe, ep_moe, init_group, make_plan
from flatep.experts import ClampedSwiGLU, swiglu
from tests.helpers import DEVICE, make_inputs, relative_error, tolerance


def biases(config: EPConfig, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    b13 = torch.randn(config.experts, 2 * config.intermediate, generator=generator)
    b2 = torch.randn(config.experts, config.hidden, generator=generator)
    return b13.to(DEVICE, dtype), b2.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype, precision", [(torch.float32, "fp32"), (torch.float32, "native"), (torch.bfloat16, "native")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("activation", [swiglu, ClampedSwiGLU(alpha=1.0, limit=0.5)])
@pytest.mark.parametrize("ranks, experts_per_rank, top_k, tokens, routing", [(4, 2, 2, 7, 4.0), (4, 2, 4, 7, "one"), (2, 4, 2, 16, "one")])
def test_biased_experts_equal_dense(ranks, experts_per_rank, top_k, tokens, routing, activation, policy, backend, dtype,
                                    precision):
    config = EPConfig(ranks=ranks, experts=ranks * experts_per_rank, top_k=top_k, hidden=32, intermediate=16,
                      capacity=16, align=8)
    group = init_group("local", ranks=ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, tokens, routing, dtype, seed=tokens)
    b13, b2 = biases(config, dtype, seed=tokens)
    plan = make_plan(ids, config, policy)
    if policy == "exact":
        assert (plan.slot_experts >= 0).any(), "the case must borrow experts, so that bias pools are pushed"
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, policy=policy, plan=plan, backend=backend,
                 b13=b13, b2=b2, activation=activation, precision=precision)
    reference = dense_moe(x, ids, weights, w13, w2, b13=b13, b2=b2, activation=activation)
    assert relative_error(out, reference) < tolerance(dtype)


def test_bias_pool_follows_the_weight_layout():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    _, _, _, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    b13, b2 = biases(config, torch.float32, seed=0)
    pool = ExpertPool.from_weights(w13, w2, config, group, b13, b2)
    assert pool.names == ("w13", "w2", "b13", "b2")
    assert torch.equal(pool.home("b13").reshape(4, -1), b13) and torch.equal(pool.home("b2").reshape(4, -1), b2)
    slots = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32, device=DEVICE)
    pool.push(slots, backend="torch")
    assert torch.equal(pool.slots("b13")[0, 0], b13[2])
    assert torch.equal(pool.slots("b2")[1, 0], b2[0]) and torch.equal(pool.slots("b2")[1, 1], b2[1])
    assert ExpertPool.from_weights(w13, w2, config, group).compute_view(0)[2:] == (None, None)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b13, b2: (b13, None), "both expert biases"),
        (lambda b13, b2: (b13[:, :8], b2), "b13 must have shape"),
        (lambda b13, b2: (b13, b2[:2]), "b2 must have shape"),
        (lambda b13, b2: (b13, b2.bfloat16()), "weights' dtype"),
    ],
)
def test_bad_biases_raise(change, message):
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    b13, b2 = change(*biases(config, torch.float32, seed=0))
    with pytest.raises(ValueError, match=message):
        ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch", b13=b13, b2=b2)


def test_default_activation_is_silu_gate_times_up():
    """Without ``activation=`` every row is ``w * W2 (silu(gate) * up)``, gate = the first ``I`` rows of
    ``w13``: checked against a per-entry loop written here in fp64, not against FlatEP's own ``swiglu``."""
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch")
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for rank in range(config.ranks):
        for token in range(x.shape[1]):
            for k in range(config.top_k):
                expert = int(ids[rank, token, k])
                projected = w13[expert].double().cpu() @ x[rank, token].double().cpu()
                gate, up = projected[: config.intermediate], projected[config.intermediate:]
                hidden = gate / (1 + torch.exp(-gate)) * up
                expected[rank, token] += float(weights[rank, token, k]) * (w2[expert].double().cpu() @ hidden)
    assert relative_error(out.cpu(), expected) < 1e-5
    swapped = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch",
                     activation=lambda gate, up: torch.nn.functional.silu(up) * gate)
    assert relative_error(swapped.cpu(), expected) > 1e-2  # the check can tell gate from up


def test_native_precision_rounds_like_a_bf16_expert_loop():
    """Under ``native`` a row is ``bf16(w * bf16(bf16(W2 act(...)) + b2))``, the loop transformers runs.

    On the CPU, where a row's GEMM result does not depend on the rows around it; GPU GEMM kernels
    may sum in another order for another grouping.
    """
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    group = init_group("local", ranks=2, device="cpu")
    x, ids, weights, w13, w2 = (tensor.cpu() for tensor in make_inputs(config, 8, 1.0, torch.bfloat16))
    weights = weights.bfloat16()
    b13, b2 = (tensor.cpu() for tensor in biases(config, torch.bfloat16, seed=1))
    activation = ClampedSwiGLU()
    out = ep_moe(x, ids, weights, w13, w2, config=config, group=group, backend="torch", b13=b13, b2=b2,
                 activation=activation, precision="native")
    expected = torch.zeros(x.shape, dtype=torch.float32)
    for rank, token, k in torch.cartesian_prod(*(torch.arange(n) for n in ids.shape)).tolist():
        expert = int(ids[rank, token, k])
        gate_up = x[rank, token] @ w13[expert].T + b13[expert]
        row = activation(gate_up[:16], gate_up[16:]) @ w2[expert].T + b2[expert]
        expected[rank, token] += (row * weights[rank, token, k]).float()
    assert torch.equal(out, expected.bfloat16())


def test_unknown_precision_raises():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=32, intermediate=16, capacity=8, align=4)
    x, ids, weights, w13, w2 = make_inputs(config, 8, 1.0, torch.float32)
    with pytest.raises(ValueError, match="precision must be one of"):
        ep_moe(x, ids, weights, w13, w2, config=config, group=init_group("local", ranks=2, device=DEVICE), precision="fp16")
