"""A tiny torchtitan Qwen3-MoE switched to FlatEP computes, differentiates and trains like torchtitan's own.

Virtual ranks on the CPU. The fp32 reference is torchtitan's model with its routed experts in fp32
(``ModelDtypeGroupedExperts``) against FlatEP's ``expert_dtype=None``; the stock model (bf16 experts)
against FlatEP's default ``expert_dtype=torch.bfloat16``. Skipped without torchtitan.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

# torchtitan 0.3.0 does not import on torch 2.11 (no torch.distributed.fsdp.DataParallelMeshDims): skip there too.
pytest.importorskip("torchtitan.models.qwen3", exc_type=ImportError)

from flatep import init_group  # noqa: E402
from flatep.integrations.tiny_torchtitan import TinyQwen3MoE, markov_batches, tiny_qwen3_moe, train  # noqa: E402
from flatep.integrations.torchtitan import FlatEPRoutedExperts, apply_flatep  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")
SIZES = TinyQwen3MoE()


def tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, SIZES.vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def switched(ranks: int, policy: str, expert_dtype: torch.dtype | None) -> torch.nn.Module:
    model = tiny_qwen3_moe(SIZES)
    apply_flatep(model, init_group("local", ranks=ranks, device="cpu"), policy, expert_dtype=expert_dtype,
                 capacity=4, backend="torch")  # a small capacity that the calls must grow
    return model


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).detach().abs().max() / expected.detach().abs().max())


@pytest.mark.parametrize("policy", ["exact", "none", "bounded", "auto"])
@pytest.mark.parametrize("ranks", [2, 4])
def test_forward_equals_torchtitans(ranks, policy):
    reference = tiny_qwen3_moe(SIZES, bf16_experts=False)
    model = switched(ranks, policy, expert_dtype=None)
    # 3 x 11 = 33 tokens: the last virtual ranks get padding.
    for seed in range(2):
        inputs = tokens(3, 11, seed)
        expected = reference(inputs)
        assert relative_error(model(inputs), expected) <= 1e-5
        with torch.no_grad():  # the pool path (no autograd) computes the same
            assert relative_error(model(inputs), expected) <= 1e-5


def test_bf16_experts_forward_equals_stock_torchtitans_to_bf16_rounding():
    inputs = tokens(2, 16, seed=3)
    expected = tiny_qwen3_moe(SIZES)(inputs)
    # FlatEP rounds the routed sum to bf16 once where torchtitan keeps it in fp32.
    assert relative_error(switched(2, "exact", torch.bfloat16)(inputs), expected) <= 2e-3


def test_the_switch_keeps_torchtitans_parameters_router_and_names():
    model = tiny_qwen3_moe(SIZES)
    names = [name for name, _ in model.named_parameters()]
    routers = [model.layers[str(i)].moe.router for i in range(SIZES.layers)]
    experts = [model.layers[str(i)].moe.routed_experts.inner_experts.w1_EFD for i in range(SIZES.layers)]
    replaced = apply_flatep(model, init_group("local", ranks=2, device="cpu"), "exact")
    assert replaced == [f"layers.{i}.moe.routed_experts" for i in range(SIZES.layers)]
    assert [name for name, _ in model.named_parameters()] == names
    for i in range(SIZES.layers):
        moe = model.layers[str(i)].moe
        assert isinstance(moe.routed_experts, FlatEPRoutedExperts)
        assert moe.router is routers[i] and moe.routed_experts.inner_experts.w1_EFD is experts[i]


@pytest.mark.parametrize("policy", ["exact", "none"])
def test_gradients_equal_torchtitans(policy):
    reference = tiny_qwen3_moe(SIZES, bf16_experts=False)
    model = switched(4, policy, expert_dtype=None)
    inputs = tokens(2, 24, seed=5)
    for net in (reference, model):
        logits = net(inputs)
        F.cross_entropy(logits[:, :-1].flatten(0, 1), inputs[:, 1:].flatten()).backward()
    for (name, expected), (_, actual) in zip(reference.named_parameters(), model.named_parameters()):
        assert relative_error(actual.grad, expected.grad) <= 1e-5, name


def test_training_steps_give_torchtitans_losses():
    batches = markov_batches(4, 4, 16, SIZES.vocab, seed=1)
    expected = train(tiny_qwen3_moe(SIZES, bf16_experts=False), batches)
    losses = train(switched(2, "exact", expert_dtype=None), batches)
    assert max(abs(a - b) / a for a, b in zip(expected, losses)) <= 1e-6


def test_refuses_what_it_cannot_switch():
    group = init_group("local", ranks=2, device="cpu")
    with pytest.raises(ValueError, match="policy"):
        apply_flatep(tiny_qwen3_moe(SIZES), group, "flat")
    with pytest.raises(ValueError, match="no torchtitan RoutedExperts"):
        apply_flatep(torch.nn.Linear(4, 4), group)
    with pytest.raises(ValueError, match="not torchtitan's GroupedExperts"):
        apply_flatep(tiny_qwen3_moe(SIZES, bf16_experts=False), group)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the switch itself warns about nothing
        apply_flatep(tiny_qwen3_moe(SIZES), group)
