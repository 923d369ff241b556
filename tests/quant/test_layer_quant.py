"""The EP layer over quantized pools equals a dense fp32 MoE over the dequantized weights, under
every policy, including steps that borrow (push) experts; pushes move packed values and scales."""
from __future__ import annotations

import os

import pytest
import torch

from flatep import EPConfig, ExpertPool, dense_moe, ep_moe, init_group, make_plan, plan_step
from flatep.quant import QuantizedTensor, expert_weight_nbytes, pool_layout
from flatep.routing import skewed_topk
from flatep.layer import shard_buffers
from tests.helpers import (DEVICE, TRITON_BACKENDS, borrowing_cost, dense_fp8_activations, relative_error,
                           second_pass_flags)

# Relative error of the layer against the dense fp32 MoE over the dequantized weights (bf16 x):
# bf16 and mxfp4 weights are exact in bf16, so only bf16 roundings of the activations remain;
# fp8 also quantizes the activations of both GEMMs to e4m3 per token per 128 columns (as the
# models run), which costs about 4.5% here (0.24% against a dense MoE that quantizes alike).
LAYER_ERROR = {"bf16": 1e-2, "mxfp4": 1e-2, "fp8": 6e-2}


def quantized_inputs(config: EPConfig, tokens: int, skew: float, seed: int):
    generator = torch.Generator().manual_seed(seed)
    ids = skewed_topk(config.ranks, config.experts, config.top_k, tokens, skew, seed=seed)
    x = torch.randn(config.ranks, tokens, config.hidden, generator=generator).bfloat16()
    weights = torch.rand(config.ranks, tokens, config.top_k, generator=generator) + 0.1
    w13 = torch.randn(config.experts, 2 * config.intermediate, config.hidden, generator=generator) * config.hidden**-0.5
    w2 = torch.randn(config.experts, config.hidden, config.intermediate, generator=generator) * config.intermediate**-0.5
    return x.to(DEVICE), ids.to(DEVICE), weights.to(DEVICE), w13.to(DEVICE), w2.to(DEVICE)


def packed(weights: torch.Tensor, format: str):
    return weights.bfloat16() if format == "bf16" else QuantizedTensor.quantize(weights, format)


def dequantized(weights, format: str) -> torch.Tensor:
    return weights.float() if format == "bf16" else weights.dequantize()


CONFIG = EPConfig(ranks=4, experts=8, top_k=2, hidden=128, intermediate=128, capacity=16, align=8)


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("format", ["bf16", "fp8", "mxfp4"])
def test_layer_equals_dense_over_dequantized_weights(format, policy, backend):
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=7)
    q13, q2 = packed(w13, format), packed(w2, format)
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16)
    assert pool.weights == format
    plan = make_plan(ids, CONFIG, policy)
    if policy == "exact":
        assert (plan.slot_experts >= 0).sum() >= 2, "the step must borrow experts, so that packed weights are pushed"
    out = ep_moe(x, ids, route_weights, config=CONFIG, group=group, policy=policy, pool=pool, plan=plan, backend=backend)
    d13, d2 = dequantized(q13, format), dequantized(q2, format)
    reference = dense_moe(x, ids, route_weights, d13, d2)
    assert out.dtype == torch.bfloat16
    assert relative_error(out, reference) < LAYER_ERROR[format]
    if format == "fp8":  # against the fp8 experts' own function (quantized activations): bf16 tolerance
        assert relative_error(out, dense_fp8_activations(x, ids, route_weights, d13, d2)) < 1e-2


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("policy", ["exact", "none", "auto"])
def test_mxfp4_pools_for_fp8_activations_equal_dense_over_dequantized_weights(policy, backend, monkeypatch):
    """Pools made with ``FLATEP_MXFP4_FP8_ACTIVATIONS`` hold the ``mma`` layout and push it; the layer
    (the fp8 kernel on a Hopper GPU, the exact pass of that layout elsewhere, the torch path) equals
    the dense MoE over the dequantized weights, borrowing steps included."""
    from flatep.quant import tensor

    monkeypatch.setattr(tensor, "MXFP4_FP8_ACTIVATIONS", True)
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=31)
    q13, q2 = packed(w13, "mxfp4"), packed(w2, "mxfp4")
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16)
    assert pool.layout == "mma" and pool.compute_view(0)[0].layout == "mma"
    cost = borrowing_cost().with_expert_bytes(pool.expert_nbytes()) if policy == "auto" else None
    plan = plan_step(ids, CONFIG, group, policy, cost=cost)
    if policy != "none":
        assert int((plan.slot_experts >= 0).sum()) >= 2, "the step must borrow, so that packed weights are pushed"
    out = ep_moe(x, ids, route_weights, config=CONFIG, group=group, policy=policy, pool=pool, plan=plan,
                 backend=backend)
    reference = dense_moe(x, ids, route_weights, dequantized(q13, "mxfp4"), dequantized(q2, "mxfp4"))
    assert relative_error(out, reference) < LAYER_ERROR["mxfp4"]


def test_a_pools_fp8_activations_argument_overrides_the_environment(monkeypatch):
    """``fp8_activations`` picks an mxfp4 pool's layout either way, whatever the environment says; the
    layer over a pool made so equals the dense MoE; other formats refuse it."""
    from flatep.quant import tensor

    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=43)
    q13, q2 = packed(w13, "mxfp4"), packed(w2, "mxfp4")
    for environment in (False, True):
        monkeypatch.setattr(tensor, "MXFP4_FP8_ACTIVATIONS", environment)
        assert ExpertPool(CONFIG, group, torch.bfloat16, weights="mxfp4").layout == ("mma" if environment else "words")
        for argument, layout in ((True, "mma"), (False, "words")):
            assert ExpertPool(CONFIG, group, torch.bfloat16, weights="mxfp4", fp8_activations=argument).layout == layout
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16, fp8_activations=True)
    assert pool.layout == "mma" and pool.compute_view(0)[0].layout == "mma"
    out = ep_moe(x, ids, route_weights, config=CONFIG, group=group, policy="exact", pool=pool)
    reference = dense_moe(x, ids, route_weights, dequantized(q13, "mxfp4"), dequantized(q2, "mxfp4"))
    assert relative_error(out, reference) < LAYER_ERROR["mxfp4"]
    for weights in ("bf16", "fp8"):
        with pytest.raises(ValueError, match=f"fp8_activations .* applies to mxfp4 weights, got {weights}"):
            ExpertPool(CONFIG, group, torch.bfloat16, weights=weights, fp8_activations=True)
    with pytest.raises(ValueError, match="fp8_activations must be None, True or False"):
        ExpertPool(CONFIG, group, torch.bfloat16, weights="mxfp4", fp8_activations="yes")


def test_mma_pools_warn_where_many_tiles_lie_outside_the_fp8_window(monkeypatch):
    """Loading mxfp4 weights into pools for fp8 activations warns, naming the projection and the share,
    where more than WINDOW_WARNING_SHARE of the fp8 kernel's tiles would be computed twice; weights
    inside the window load silently."""
    import warnings

    from flatep.quant import tensor

    monkeypatch.setattr(tensor, "MXFP4_FP8_ACTIVATIONS", True)
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    *_, w13, w2 = quantized_inputs(CONFIG, 4, skew=1.0, seed=41)
    q13, q2 = packed(w13, "mxfp4"), packed(w2, "mxfp4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16)
    smaller = QuantizedTensor("mxfp4", q2.values, q2.scales - 10)  # every block 2**-10 of its size
    with pytest.warns(UserWarning, match=r"w2: 100\.0% of its experts' 128-column tiles .* outside 118\.\.129"):
        ExpertPool.from_weights(q13, smaller, CONFIG, group, dtype=torch.bfloat16)


@pytest.mark.parametrize("policy", ["exact", "none"])
def test_mxfp4_steps_over_nan_buffers_take_one_pass(policy, monkeypatch):
    """The step's shard buffers filled with NaN first, as a reused buffer may hold them: dispatch
    writes only the real rows, and the padding rows it leaves must not send the mxfp4 GEMMs
    through their second pass (which a tile reading a scale byte past 128 needs, and these
    weights have none); the layer still equals the dense MoE."""
    if DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=23)
    q13, q2 = packed(w13, "mxfp4"), packed(w2, "mxfp4")
    assert int(q13.scales.max()) <= 128 and int(q2.scales.max()) <= 128
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16)
    plan = make_plan(ids, CONFIG, policy)
    assert int(plan.padding[..., 1].sum()) > 0, "the step must pad groups"
    for buffer in shard_buffers(group, CONFIG, policy, torch.bfloat16):
        buffer.fill_(float("nan"))
    flags = second_pass_flags(monkeypatch)
    out = ep_moe(x, ids, route_weights, config=CONFIG, group=group, policy=policy, pool=pool, plan=plan,
                 backend="triton")
    assert flags and [int(flag) for flag in flags] == [0] * len(flags)
    reference = dense_moe(x, ids, route_weights, dequantized(q13, "mxfp4"), dequantized(q2, "mxfp4"))
    assert relative_error(out, reference) < LAYER_ERROR["mxfp4"]


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_auto_steps_that_borrow_equal_dense_over_dequantized_weights(format, backend):
    """``auto`` with a profile where moving weights is nearly free borrows experts (packed pushes)
    and, like ``exact``, equals the dense MoE over the dequantized weights."""
    cheap = borrowing_cost()
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=8)
    q13, q2 = packed(w13, format), packed(w2, format)
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group, dtype=torch.bfloat16)
    plan = plan_step(ids, CONFIG, group, "auto", cost=cheap.with_expert_bytes(pool.expert_nbytes()))
    assert plan.policy != "none" and int((plan.slot_experts >= 0).sum()) >= 2, "auto must borrow here"
    out = ep_moe(x, ids, route_weights, config=CONFIG, group=group, policy="auto", pool=pool, plan=plan, backend=backend)
    reference = dense_moe(x, ids, route_weights, dequantized(q13, format), dequantized(q2, format))
    assert relative_error(out, reference) < LAYER_ERROR[format]


@pytest.mark.parametrize("backend", TRITON_BACKENDS)
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_push_moves_packed_values_and_scales(format, backend):
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=128, intermediate=128, capacity=8, align=8)
    group = init_group("local", ranks=2, device=DEVICE)
    _, _, _, w13, w2 = quantized_inputs(config, 4, 1.0, seed=3)
    q13, q2 = QuantizedTensor.quantize(w13, format), QuantizedTensor.quantize(w2, format)
    pool = ExpertPool.from_weights(q13, q2, config, group)
    q13, q2 = q13.in_layout(pool_layout(format)), q2.in_layout(pool_layout(format))  # what the pool holds
    for name in pool.names:
        pool.slots(name).view(torch.uint8).fill_(0xFF)  # poison: NaN in fp8, 255 (NaN scale) in mxfp4
    slots = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32, device=DEVICE)
    pool.push(slots, backend=backend)
    for receiver, slot, expert in ((0, 0, 2), (1, 0, 0), (1, 1, 1)):
        for name, tensor in (("w13", q13.values), ("w13_scale", q13.scales), ("w2", q2.values), ("w2_scale", q2.scales)):
            assert torch.equal(pool.slots(name)[receiver, slot].view(torch.uint8), tensor[expert].view(torch.uint8)), name
    assert (pool.slots("w13")[0, 1].view(torch.uint8) == 0xFF).all()  # empty slot untouched
    expert_bytes = (q13.nbytes + q2.nbytes) // config.experts
    assert pool.expert_nbytes() == expert_bytes == expert_weight_nbytes(format, 128, 128)
    # bf16 / packed bytes: fp8 = 1 byte a weight + one fp32 per 128x128 block (3 blocks); mxfp4 = 4.25 bits a weight.
    ratio = {"fp8": 2 * 3 * 128 * 128 / (3 * 128 * 128 + 4 * 3), "mxfp4": 16 / 4.25}[format]
    bf16_bytes = ExpertPool(config, group, torch.bfloat16).expert_nbytes()
    assert bf16_bytes == config.expert_bytes() and bf16_bytes / expert_bytes == pytest.approx(ratio)


def test_bias_pools_stay_in_the_activation_dtype():
    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=64, intermediate=32, capacity=8, align=8)
    group = init_group("local", ranks=2, device=DEVICE)
    pool = ExpertPool(config, group, torch.bfloat16, biases=True, weights="mxfp4")
    assert pool.names == ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2")
    assert pool.b13.dtype == torch.bfloat16 and pool.w13.dtype == torch.uint8 and pool.w13.shape == (2, 2, 64, 32)
    # mxfp4 scales stored column-fastest, home experts and slots alike (the GPU kernel pipelines their loads)
    for scales in (pool.w13_scale, pool.slots("w13_scale")):
        assert scales.shape == (2, 2, 64, 2) and scales.stride()[-2:] == (1, 64)
        assert scales.transpose(-1, -2).is_contiguous()
    assert pool.expert_nbytes() == 64 * 64 // 2 + 64 * 2 + 64 * 32 // 2 + 64 + 2 * (64 + 64)


@pytest.mark.parametrize("make, message", [
    (lambda g: ExpertPool(EPConfig(2, 4, 2, 192, 128, 8), g, torch.bfloat16, weights="fp8"), "hidden to be a multiple of 128"),
    (lambda g: ExpertPool(EPConfig(2, 4, 2, 128, 48, 8), g, torch.bfloat16, weights="mxfp4"), "intermediate to be a multiple of 32"),
    (lambda g: ExpertPool(EPConfig(2, 4, 2, 128, 128, 8), g, torch.bfloat16, weights="int4"), "weight format"),
    (lambda g: ExpertPool(EPConfig(2, 4, 2, 128, 128, 8), g, torch.float16, weights="fp8"), "dtype"),
    (lambda g: ExpertPool.from_weights(QuantizedTensor.quantize(torch.randn(4, 256, 128), "fp8"),
                                       QuantizedTensor.quantize(torch.randn(4, 128, 128), "mxfp4"),
                                       EPConfig(2, 4, 2, 128, 128, 8), g), "one weight format"),
    (lambda g: ExpertPool.from_weights(QuantizedTensor.quantize(torch.randn(4, 256, 128), "fp8"),
                                       QuantizedTensor.quantize(torch.randn(4, 128, 128), "fp8"),
                                       EPConfig(2, 4, 2, 128, 128, 8), g, weights="mxfp4"), "does not match"),
    (lambda g: ExpertPool.from_weights(QuantizedTensor.quantize(torch.randn(4, 128, 128), "fp8"),
                                       QuantizedTensor.quantize(torch.randn(4, 128, 128), "fp8"),
                                       EPConfig(2, 4, 2, 128, 128, 8), g), r"w13 must have shape"),
    (lambda g: QuantizedTensor("fp8", torch.randn(4, 256, 128).to(torch.float8_e4m3fn), torch.ones(4, 2, 2)), "scales must have shape"),
    (lambda g: ExpertPool(EPConfig(2, 4, 2, 128, 128, 8), g, torch.bfloat16, weights="fp8").load_home(
        QuantizedTensor.quantize(torch.randn(4, 256, 128), "mxfp4"), QuantizedTensor.quantize(torch.randn(4, 128, 128), "mxfp4")),
     "this pool holds fp8"),
])
def test_bad_input_raises(make, message):
    group = init_group("local", ranks=2, device="cpu")
    with pytest.raises(ValueError, match=message):
        make(group)


def test_layer_rejects_activations_of_another_dtype():
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 4, 1.0, seed=1)
    pool = ExpertPool.from_weights(w13.bfloat16(), w2.bfloat16(), CONFIG, group, weights="mxfp4")
    with pytest.raises(ValueError, match="pool dtype"):
        ep_moe(x.float(), ids, route_weights, config=CONFIG, group=group, pool=pool)


def test_layer_takes_packed_weights_without_a_pool():
    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 6, 2.0, seed=5)
    q13, q2 = QuantizedTensor.quantize(w13, "mxfp4"), QuantizedTensor.quantize(w2, "mxfp4")
    out = ep_moe(x, ids, route_weights, q13, q2, config=CONFIG, group=group, backend="torch")
    pool = ExpertPool.from_weights(q13, q2, CONFIG, group)
    assert torch.equal(out, ep_moe(x, ids, route_weights, config=CONFIG, group=group, pool=pool, backend="torch"))


def test_auto_charges_the_packed_bytes_of_the_weights_it_plans_for():
    """ep_moe hands auto's model the bytes one expert really has: the pool's, or packed w13/w2's."""
    from flatep import CostProfile
    from flatep.layer import _cost_of_this_step

    config = EPConfig(ranks=2, experts=4, top_k=2, hidden=128, intermediate=128, capacity=8)
    group = init_group("local", ranks=2, device="cpu")
    w13, w2 = torch.randn(4, 256, 128) / 11, torch.randn(4, 128, 128) / 11
    for weights in ("bf16", "fp8", "mxfp4"):
        pool = ExpertPool.from_weights(w13, w2, config, group, weights=weights, dtype=torch.bfloat16)
        assert _cost_of_this_step(None, pool, None, config, torch.bfloat16, None).expert_bytes == pool.expert_nbytes()
    packed = QuantizedTensor.quantize(w13, "mxfp4")
    assert _cost_of_this_step(None, None, packed, config, torch.bfloat16, None).expert_bytes == expert_weight_nbytes("mxfp4", 128, 128)
    assert _cost_of_this_step(None, None, w13, config, torch.bfloat16, None).expert_bytes is None  # bf16: from the config
    given = CostProfile.preset("h200").with_expert_bytes(123)
    assert _cost_of_this_step(given, pool, None, config, torch.bfloat16, None) is given


@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_packed_experts_of_both_parts_share_launches_and_equal_the_parts_apart(format, monkeypatch):
    """experts_step asked for both parts of a borrowing decode step runs the home experts and the
    slots in one grouped_swiglu call (shared launches), bit for bit what the parts give apart, and
    writes no row outside the groups (the NaN rows stay NaN)."""
    if DEVICE.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    from flatep import layer
    from flatep.plan.split import split_slot_rows

    group = init_group("local", ranks=CONFIG.ranks, device=DEVICE)
    x, ids, route_weights, w13, w2 = quantized_inputs(CONFIG, 12, skew=4.0, seed=17)
    pool = ExpertPool.from_weights(packed(w13, format), packed(w2, format), CONFIG, group, dtype=torch.bfloat16)
    plan = make_plan(ids, CONFIG, "exact")
    pool.push(plan.slot_experts, backend="triton")
    plan = split_slot_rows(plan)
    assert int((plan.slot_experts >= 0).sum()) >= 2 and plan.rows_per_expert(CONFIG.top_k) <= 64
    shard, shard_weights = layer.dispatch_step(x, route_weights, plan, group, backend="triton")
    calls = []
    original = layer.grouped_swiglu
    monkeypatch.setattr(layer, "grouped_swiglu", lambda *a, **k: calls.append(k.get("slots")) or original(*a, **k))
    for rank in range(CONFIG.ranks):
        together, apart = (torch.full_like(shard, float("nan")) for _ in range(2))
        calls.clear()
        layer.experts_step(shard, shard_weights, pool, plan, group, rank, out=together, backend="triton")
        assert len(calls) == 1 and calls[0] is not None, "one call, with the slots"
        for part in ("home", "slots"):
            layer.experts_step(shard, shard_weights, pool, plan, group, rank, out=apart, parts=(part,), backend="triton")
        assert torch.equal(together[rank].isnan(), apart[rank].isnan())
        assert torch.equal(together[rank].nan_to_num(), apart[rank].nan_to_num())
