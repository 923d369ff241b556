"""mxfp4 experts decoded into bf16 (flatep.kernels.mxfp4_dequant): the decode against the format's
definition, and the GEMM through bf16 against the in-register GEMM and the fp32 reference."""
from __future__ import annotations

import pytest
import torch

from flatep.kernels.backend import use_triton
from flatep.kernels.mxfp4_dequant import dequantize_mxfp4_triton, mxfp4_grouped_mm_bf16
from flatep.kernels.packed_tiles import GemmConfig
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton
from flatep.quant import QuantizedTensor, pool_layout
from tests.helpers import DEVICE, relative_error
from tests.quant.test_grouped import grouped_inputs, per_group_reference

needs_triton = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


def packed_weights(experts: int, columns: int, inner: int, seed: int) -> QuantizedTensor:
    """Random weights over many binades (block scales from 2**-30 to 2**8), in the pools' layout."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(experts, columns, inner, generator=generator)
    weight = weight * 2.0 ** torch.randint(-30, 8, (experts, columns, inner // 32, 1), generator=generator).float() \
        .expand(-1, -1, -1, 32).reshape(experts, columns, inner)
    return QuantizedTensor.quantize(weight, "mxfp4").in_layout(pool_layout("mxfp4")).to(DEVICE)


@needs_triton
@pytest.mark.parametrize("columns, inner", [(70, 96), (64, 320), (5, 512)])
def test_decode_equals_the_format_definition_exactly(columns, inner):
    """Every weight is its e2m1 value times its block's power of two, bit for bit, for column counts
    that leave a partial tile and K steps of 32, 64 and 256; a given ``out`` is written in place."""
    packed = packed_weights(3, columns, inner, seed=columns + inner)
    expected = packed.dequantize(torch.float32)
    out = torch.full((3, columns, inner), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = dequantize_mxfp4_triton(packed.values, packed.scales, out=out)
    assert got is out
    assert torch.equal(got.float(), expected)
    # Checkpoint-ordered (row-contiguous) scales decode the same.
    assert torch.equal(dequantize_mxfp4_triton(packed.values, packed.scales.contiguous()).float(), expected)


@needs_triton
def test_experts_of_empty_groups_are_not_decoded():
    """With the groups' end rows given, an expert whose group holds no rows keeps its part of
    ``out`` (poisoned here); the others decode as without them."""
    packed = packed_weights(4, 40, 64, seed=5)
    ends = torch.tensor([3, 3, 9, 9], dtype=torch.int32, device=DEVICE)  # experts 1 and 3 hold no rows
    out = torch.full((4, 40, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    dequantize_mxfp4_triton(packed.values, packed.scales, out=out, ends=ends)
    expected = packed.dequantize(torch.float32)
    assert torch.equal(out[0].float(), expected[0]) and torch.equal(out[2].float(), expected[2])
    assert out[1].isnan().all() and out[3].isnan().all()
    with pytest.raises(ValueError, match="ends must be a \\[4\\] int32 tensor"):
        dequantize_mxfp4_triton(packed.values, packed.scales, ends=ends[:3])
    with pytest.raises(ValueError, match="ends must be a \\[4\\] int32 tensor"):
        dequantize_mxfp4_triton(packed.values, packed.scales, ends=ends.long())


@needs_triton
def test_scale_byte_zero_decodes_to_zero_as_in_the_gemms_two_multiply_pass():
    packed = packed_weights(1, 8, 64, seed=3)
    packed.scales[0, 2, 1] = 0  # 2**-127: its values (below 6 * 2**-127) decode to 0
    got = dequantize_mxfp4_triton(packed.values, packed.scales)
    assert bool((got[0, 2, 32:] == 0).all())
    expected = packed.dequantize(torch.float32)
    assert torch.equal(got[0, 2, :32].float(), expected[0, 2, :32]) and torch.equal(got[0, :2].float(), expected[0, :2])


@pytest.mark.parametrize("change, message", [
    (lambda v, s: (v.view(torch.int8), s), "values must be a contiguous"),
    (lambda v, s: (v[..., :-8], s), "values must be a contiguous"),
    (lambda v, s: (v, s[..., :-1]), "scales must be a"),
    (lambda v, s: (v, s.float()), "scales must be a"),
])
def test_bad_decode_input_is_refused_before_any_kernel(change, message):
    packed = packed_weights(2, 8, 64, seed=4)
    with pytest.raises(ValueError, match=message):
        dequantize_mxfp4_triton(*change(packed.values, packed.scales))
    with pytest.raises(ValueError, match="out must be a contiguous"):
        dequantize_mxfp4_triton(packed.values, packed.scales, out=torch.empty(2, 8, 32, dtype=torch.bfloat16))


@needs_triton
def test_gemm_through_bf16_equals_the_in_register_gemm():
    """Same product as the in-register kernel (both bf16 products of exact weights, fp32 sums) and
    within bf16 rounding of the fp32 reference; rows past the last group stay unwritten in a given
    ``out``."""
    rows, packed, offsets = grouped_inputs("mxfp4", [5, 0, 19, 7], 48, 128, seed=8)
    end = int(offsets[-1])
    reference = per_group_reference(rows, packed, offsets)[:end]
    through_bf16 = mxfp4_grouped_mm_bf16(rows, packed.values, packed.scales, offsets)
    in_registers = mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, GemmConfig(16, 32, 64))
    assert relative_error(through_bf16[:end], reference) < 4e-3
    assert relative_error(through_bf16[:end], in_registers[:end]) < 4e-3
    out = torch.full((rows.shape[0], 48), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert mxfp4_grouped_mm_bf16(rows, packed.values, packed.scales, offsets, out=out) is out
    assert torch.equal(out[:end], through_bf16[:end]) and out[end:].isnan().all()


@needs_triton
def test_gemm_through_bf16_with_slots_equals_two_calls():
    """Home experts and a second set from row ``slot_base``: each part equals a call of its own, and
    the rows between the sets and past the last slot group keep their poison."""
    rows, packed, offsets = grouped_inputs("mxfp4", [3, 6, 1, 4, 0, 2], 32, 64, seed=13, padding=12)
    home, slots, slot_base = packed[:3], packed[3:], 14  # an empty slot group among the slots (not decoded)
    ends = torch.tensor([3, 9, 10, slot_base + 4, slot_base + 4, slot_base + 6], dtype=torch.int32, device=DEVICE)
    shard = torch.full((slot_base + 6 + 2, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    shard[:10] = rows[:10]
    shard[slot_base:slot_base + 6] = rows[10:16]
    out = torch.full((shard.shape[0], 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    got = mxfp4_grouped_mm_bf16(shard, home.values, home.scales, ends, out=out,
                                slots=(slots.values, slots.scales), slot_base=slot_base)
    assert got is out
    alone_home = mxfp4_grouped_mm_bf16(shard[:10], home.values, home.scales, ends[:3])
    alone_slots = mxfp4_grouped_mm_bf16(shard[slot_base:slot_base + 6].contiguous(), slots.values, slots.scales,
                                        ends[3:] - slot_base)
    assert torch.equal(out[:10], alone_home) and torch.equal(out[slot_base:slot_base + 6], alone_slots)
    assert out[10:slot_base].isnan().all() and out[slot_base + 6:].isnan().all()


@needs_triton
def test_prefill_sized_steps_take_the_bf16_route_with_slots():
    """quantized_grouped_mm with ``rows_per_group`` at THROUGH_BF16_ROWS runs the GEMM through bf16
    (bit for bit), below it the in-register kernel; both near the fp32 reference."""
    from flatep.experts.grouped import quantized_grouped_mm
    from flatep.kernels.mxfp4_dequant import THROUGH_BF16_ROWS

    rows, packed, offsets = grouped_inputs("mxfp4", [4, 9, 3], 32, 64, seed=17)
    home, slots = packed[:2], packed[2:]
    slot_base = 16
    ends = torch.tensor([4, 13, slot_base + 3], dtype=torch.int32, device=DEVICE)
    shard = torch.full((slot_base + 5, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    shard[:13], shard[slot_base:slot_base + 3] = rows[:13], rows[13:16]
    routed = quantized_grouped_mm(shard, home, ends, rows_per_group=THROUGH_BF16_ROWS, slots=slots,
                                  slot_base=slot_base, backend="triton")
    direct = mxfp4_grouped_mm_bf16(shard, home.values, home.scales, ends, slots=(slots.values, slots.scales),
                                   slot_base=slot_base)
    tiles = quantized_grouped_mm(shard, home, ends, rows_per_group=THROUGH_BF16_ROWS - 1, slots=slots,
                                 slot_base=slot_base, backend="triton")
    real = torch.cat([torch.arange(13), torch.arange(slot_base, slot_base + 3)]).to(DEVICE)
    assert torch.equal(routed[real], direct[real])
    reference = per_group_reference(rows[:16], packed, offsets)
    assert relative_error(routed[real], reference) < 4e-3 and relative_error(tiles[real], reference) < 4e-3


@needs_triton
def test_the_bf16_route_can_be_turned_off(monkeypatch):
    """THROUGH_BF16_ROWS is read at each call: raised past any step, the in-register kernel runs."""
    from flatep.experts.grouped import quantized_grouped_mm
    from flatep.kernels import mxfp4_dequant

    rows, packed, offsets = grouped_inputs("mxfp4", [4, 9], 32, 64, seed=19)
    calls = []
    monkeypatch.setattr(mxfp4_dequant, "mxfp4_grouped_mm_bf16", lambda *args, **kwargs: calls.append(args))
    quantized_grouped_mm(rows, packed, offsets, rows_per_group=mxfp4_dequant.THROUGH_BF16_ROWS, backend="triton")
    assert len(calls) == 1
    monkeypatch.setattr(mxfp4_dequant, "THROUGH_BF16_ROWS", 2**31)
    out = quantized_grouped_mm(rows, packed, offsets, rows_per_group=4096, backend="triton")
    assert len(calls) == 1
    assert relative_error(out[:13], per_group_reference(rows, packed, offsets)[:13]) < 4e-3
