"""FP8 dispatch (ep_moe(dispatch_dtype=torch.float8_e4m3fn)): the layer against the dense MoE of the
quantized tokens, the received rows bit-equal across backends, bad input, the header, auto's row bytes."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, EPMoE, ExpertPool, dense_moe, ep_moe, init_group
from flatep.kernels.fp8_rows import pack_rows_torch, packed_row_bytes, unpack_rows_torch
from flatep.layer import (
    _cost_of_this_step, buffer_rows, dispatch_step, packed_buffer, plan_step, reads_packed_rows, route, shard_buffers,
)
from flatep.kernels.dispatch import real_rows_torch
from flatep.plan.cost import CostProfile
from tests.helpers import DEVICE, TRITON_BACKENDS, make_inputs, relative_error, tolerance

FP8 = torch.float8_e4m3fn


def config(dedup: bool, hidden: int = 200) -> EPConfig:
    # H = 200: one full 128-column scale group and a partial one.
    return EPConfig(ranks=4, experts=16, top_k=4, hidden=hidden, intermediate=16, capacity=9, align=4, dedup=dedup)


def quantized(x: torch.Tensor) -> torch.Tensor:
    """What the experts see with fp8 dispatch: each row's fp8 values times their scales, in x's dtype."""
    return unpack_rows_torch(pack_rows_torch(x), x.shape[-1], x.dtype)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("policy, routing", [("exact", 2.0), ("none", "one"), ("auto", 8.0), ("bounded", 2.0)])
def test_layer_equals_the_dense_moe_of_the_quantized_tokens(backend, dedup, policy, routing):
    cfg = config(dedup)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(cfg, 9, routing, torch.bfloat16, seed=11)
    # The step's own buffers, poisoned: all-ones bits are NaN in bf16, fp32 and e4m3 alike.
    poisoned = (*shard_buffers(group, cfg, policy, torch.bfloat16, FP8), packed_buffer(group, buffer_rows(cfg, policy), cfg.hidden))
    for buffer in poisoned:
        buffer.view(torch.int16 if buffer.element_size() == 2 else torch.int32).fill_(-1)
    out = ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, policy=policy, backend=backend, dispatch_dtype=FP8)
    assert out.dtype == x.dtype and bool(out.isfinite().all())
    assert relative_error(out, dense_moe(quantized(x), ids, weights, w13, w2)) < tolerance(torch.bfloat16)
    # The tokens really were quantized: e4m3's error, not bf16's, against the unquantized MoE.
    assert relative_error(out, dense_moe(x, ids, weights, w13, w2)) > 3 * tolerance(torch.bfloat16)


@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_received_rows_are_bit_equal_across_backends_and_equal_the_quantized_tokens(dedup, policy):
    cfg = config(dedup)
    x, ids, weights, _, _ = make_inputs(cfg, 9, 2.0, torch.bfloat16, seed=12)
    received = []
    for backend in TRITON_BACKENDS:
        group = init_group("local", ranks=cfg.ranks, device=DEVICE)
        plan = plan_step(ids, cfg, group, policy)
        shard, shard_weights = dispatch_step(x, weights, plan, group, backend, dispatch_dtype=FP8)
        real = real_rows_torch(plan.offsets, plan.padding, plan.slot_base, shard.shape[-2])
        received.append((shard.clone(), shard_weights.clone(), real))
    (shard, shard_weights, real), (other, other_weights, _) = received
    assert torch.equal(shard[real].view(torch.int16), other[real].view(torch.int16))
    assert torch.equal(shard_weights[real], other_weights[real])
    # Every planned entry's row holds its token's quantized row, and every real row is one such.
    planned = plan.dest_rank >= 0
    rank, token, _ = planned.nonzero(as_tuple=True)
    rows = shard[plan.dest_rank[planned].long(), plan.dest_row[planned].long()]
    assert torch.equal(rows.view(torch.int16), quantized(x)[rank, token].view(torch.int16))
    assert int(real.sum()) == int(planned.sum())

def test_epmoe_with_fp8_dispatch_equals_ep_moe_and_refuses_training():
    cfg = config(True)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    torch.manual_seed(3)
    layer = EPMoE(cfg, group, policy="exact", dispatch_dtype=FP8)
    x = torch.randn(cfg.ranks, 9, cfg.hidden, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        out = layer(x)
        ids, weights = route(x.float() @ layer.router.float().T, cfg.top_k)
        expected = ep_moe(x, ids, weights, layer.w13, layer.w2, config=cfg, group=group, dispatch_dtype=FP8)
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    with pytest.raises(NotImplementedError, match="fp8 dispatch"):
        layer(x)  # grad enabled, parameters require grad


def test_bad_dispatch_dtypes_are_refused_before_any_kernel():
    cfg = config(False)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(cfg, 9, 2.0, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="dispatch_dtype must be None, x's dtype"):
        ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, dispatch_dtype=torch.float16)
    odd = config(False, hidden=30)
    x, ids, weights, w13, w2 = make_inputs(odd, 9, 2.0, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="multiple of 4, got H=30"):
        ep_moe(x, ids, weights, w13, w2, config=odd, group=group, dispatch_dtype=FP8)
    with pytest.raises(ValueError, match="multiple of 4, got H=30"):
        EPMoE(odd, group, dispatch_dtype=FP8)
    with pytest.raises(ValueError, match="dispatch_dtype must be None, torch.bfloat16"):
        plan_step(ids, odd, group, dispatch_dtype=torch.float16)
    with pytest.raises(ValueError, match="multiple of 4, got H=30"):
        plan_step(ids, odd, group, dispatch_dtype=FP8)
    x, ids, weights, w13, w2 = make_inputs(cfg, 9, 2.0, torch.float32, seed=1)
    with pytest.raises(NotImplementedError, match="no backward through fp8 dispatch"):
        ep_moe(x.requires_grad_(), ids, weights, w13, w2, config=cfg, group=group, dispatch_dtype=FP8)


def test_a_plan_is_refused_for_another_dispatch_dtype_or_activation_dtype_than_it_was_made_for():
    # On a per-process group the ranks agree on dispatch_dtype in plan_step; a step with a
    # prebuilt plan must use that one, so that no rank sends rows the others do not expect.
    cfg = config(False)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(cfg, 9, 2.0, torch.bfloat16, seed=3)
    rows_plan, fp8_plan = plan_step(ids, cfg, group), plan_step(ids, cfg, group, dispatch_dtype=FP8)
    with pytest.raises(ValueError, match="plan was made for dispatch_dtype=None"):
        ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=rows_plan, dispatch_dtype=FP8)
    with pytest.raises(ValueError, match="plan was made for dispatch_dtype=torch.float8_e4m3fn, not None"):
        ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=fp8_plan)
    # x's own dtype named explicitly is the same step as None.
    expected = ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=rows_plan)
    assert torch.equal(ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=rows_plan,
                              dispatch_dtype=torch.bfloat16), expected)
    out = ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=fp8_plan, dispatch_dtype=FP8)
    assert torch.equal(out, ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, dispatch_dtype=FP8))
    # Likewise the activation dtype, where plan_step was given one.
    fp32_plan = plan_step(ids, cfg, group, dtype=torch.float32)
    with pytest.raises(ValueError, match="plan was made for activations in torch.float32"):
        ep_moe(x, ids, weights, w13, w2, config=cfg, group=group, plan=fp32_plan)
    assert torch.equal(ep_moe(x.float(), ids, weights, w13.float(), w2.float(), config=cfg, group=group, plan=fp32_plan),
                       ep_moe(x.float(), ids, weights, w13.float(), w2.float(), config=cfg, group=group))


def test_auto_prices_an_entry_at_a_packed_row_out_and_a_bf16_row_back():
    cfg = config(False, hidden=7168)
    cost = _cost_of_this_step(None, None, None, cfg, torch.bfloat16, FP8)
    assert cost.row_bytes == 7168 + 4 * 56 + 2 * 7168 + 4 == packed_row_bytes(7168) + cfg.token_bytes() + 4
    assert cost.constants(cfg).row_bytes == cost.row_bytes
    assert _cost_of_this_step(None, None, None, cfg, torch.bfloat16, None).constants(cfg).row_bytes == 2 * 2 * 7168 + 4
    own = CostProfile.default().with_row_bytes(123)
    assert _cost_of_this_step(own, None, None, cfg, torch.bfloat16, FP8).row_bytes == 123  # a profile that says keeps its own


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy", ["exact", "none"])
def test_fp8_experts_read_the_dispatched_rows_without_unpacking_them(backend, policy):
    """With an fp8 pool the gate/up GEMMs take the packed values and scales as they arrive. They are
    what those GEMMs would have made of the bf16 rows (the same quantization), so the step is bit
    for bit the one without fp8 dispatch, and the bf16 shard's rows are never read (poisoned)."""
    cfg = EPConfig(ranks=2, experts=8, top_k=2, hidden=256, intermediate=128, capacity=8, align=4, dedup=True)
    group = init_group("local", ranks=cfg.ranks, device=DEVICE)
    x, ids, weights, w13, w2 = make_inputs(cfg, 8, 2.0, torch.bfloat16, seed=21)
    pool = ExpertPool.from_weights(w13, w2, cfg, group, weights="fp8", dtype=torch.bfloat16)
    assert reads_packed_rows(pool, FP8) and not reads_packed_rows(pool, None)
    plan = plan_step(ids, cfg, group, policy)
    assert policy == "none" or bool((plan.slot_experts >= 0).any())  # borrowed experts read packed rows too
    shard, _ = shard_buffers(group, cfg, policy, torch.bfloat16, FP8)
    shard.fill_(float("nan"))
    out = ep_moe(x, ids, weights, config=cfg, group=group, policy=policy, pool=pool, backend=backend, dispatch_dtype=FP8)
    assert bool(out.isfinite().all())
    plain = ep_moe(x, ids, weights, config=cfg, group=group, policy=policy, pool=pool, backend=backend)
    assert torch.equal(out.view(torch.int16), plain.view(torch.int16))
