"""Quantize / dequantize round trips against the formats' definitions (e4m3 block fp8, mxfp4)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flatep.quant import (
    E2M1_VALUES,
    WORD_PAIRS,
    QuantizedTensor,
    deinterleave_gate_up,
    dequantize_fp8_activations,
    dequantize_fp8_block,
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    fp8_experts_from_checkpoint,
    from_word_layout,
    mxfp4_experts_from_checkpoint,
    quantize_fp8_activations,
    quantize_fp8_block,
    quantize_mxfp4,
    to_e4m3,
    to_word_layout,
)


def e4m3_value(byte: int) -> float:
    """The e4m3fn definition: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits, no infinities."""
    sign = -1.0 if byte & 0x80 else 1.0
    exponent, mantissa = (byte >> 3) & 0xF, byte & 0x7
    if exponent == 0xF and mantissa == 0x7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_e4m3_bytes_follow_the_definition():
    decoded = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    expected = torch.tensor([e4m3_value(byte) for byte in range(256)])
    assert torch.equal(decoded.isnan(), expected.isnan())
    assert torch.equal(decoded[~expected.isnan()], expected[~expected.isnan()])
    assert float(expected[~expected.isnan()].abs().max()) == 448.0


def test_e4m3_cast_saturates_at_448_and_rounds_to_nearest():
    x = torch.tensor([1000.0, -1e6, 448.0, 460.0, 0.3, -17.0, 1e-9])
    assert to_e4m3(x).float().tolist() == [448.0, -448.0, 448.0, 448.0, 0.3125, -16.0, 0.0]
    assert to_e4m3(torch.tensor([float("nan")])).float().isnan().all()


def random_weight(shape, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator) * scale


@pytest.mark.parametrize("shape", [(256, 384), (2, 130, 200), (128, 1), (1, 129)])
def test_fp8_block_scales_are_block_amax_over_448(shape):
    weight = random_weight(shape, seed=sum(shape)) * torch.logspace(-3, 2, shape[-1])
    values, scales = quantize_fp8_block(weight)
    rows, columns = shape[-2:]
    assert values.dtype == torch.float8_e4m3fn and values.shape == weight.shape
    assert list(scales.shape) == [*shape[:-2], -(-rows // 128), -(-columns // 128)]
    for i in range(scales.shape[-2]):
        for j in range(scales.shape[-1]):
            block = weight[..., 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            amax = block.abs().flatten(-2).amax(-1)
            assert torch.allclose(scales[..., i, j], amax / 448, rtol=1e-6)
            # Every block reaches the top of the range (its amax element becomes +-448).
            top = values[..., 128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)].float().abs().flatten(-2).amax(-1)
            assert torch.equal(top, torch.full_like(top, 448.0))


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 300), columns=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_fp8_round_trip_is_within_half_an_e4m3_step(rows, columns, seed):
    weight = random_weight((rows, columns), seed)
    values, scales = quantize_fp8_block(weight)
    restored = dequantize_fp8_block(values, scales)
    expanded = scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :columns]
    # e4m3 has 3 mantissa bits: relative step 2**-3 of normal values, absolute 2**-9 below 2**-6.
    bound = torch.maximum(weight.abs() * 2.0**-4, torch.full_like(weight, 2.0**-10) * expanded)
    assert ((restored - weight).abs() <= bound * 1.0001).all()
    # Quantizing what dequantize returns changes nothing: the values are on the grid.
    again, again_scales = quantize_fp8_block(restored)
    assert torch.equal(dequantize_fp8_block(again, again_scales), restored)


def test_fp8_zero_block_keeps_a_finite_scale():
    weight = random_weight((256, 256), 3)
    weight[:128, 128:] = 0
    values, scales = quantize_fp8_block(weight)
    assert scales[0, 1] == 1.0 and torch.equal(dequantize_fp8_block(values, scales)[:128, 128:], weight[:128, 128:])


def test_fp8_activations_per_token_per_128_group():
    x = random_weight((5, 300), 4) * torch.logspace(-2, 2, 5).unsqueeze(1)
    x[2] = 0
    values, scales = quantize_fp8_activations(x.bfloat16())
    assert values.shape == (5, 300) and scales.shape == (5, 3)
    groups = torch.nn.functional.pad(x.bfloat16().float(), (0, 84)).view(5, 3, 128)
    assert torch.allclose(scales, groups.abs().amax(-1).clamp_min(1e-10) / 448)
    restored = dequantize_fp8_activations(values, scales)
    assert torch.equal(restored[2], torch.zeros(300))
    assert ((restored - x.bfloat16().float()).abs() <= x.abs() * 2.0**-4 + scales.repeat_interleave(128, 1)[:, :300] * 2.0**-9).all()


def test_fp8_activation_scales_and_values_are_exact_ieee_operations():
    """The scale is ``amax`` times the fp32 reciprocal of 448 (what torch computes for ``/ 448`` on a
    GPU, and the kernels compute on every device), the values ``x / scale`` correctly rounded: bit
    for bit, where a division by 448 differs in the last bit for some amax."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(4096, 128, generator=generator) * torch.exp(3 * torch.randn(4096, 1, generator=generator))
    values, scales = quantize_fp8_activations(x)
    amax = x.abs().amax(-1).clamp_min(1e-10)
    reciprocal = torch.tensor(1 / 448, dtype=torch.float32)
    assert torch.equal(scales[:, 0], amax * reciprocal)
    assert not torch.equal(amax * reciprocal, amax / 448)  # the test tells the two apart
    assert torch.equal(values.float(), (x / scales).clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_e2m1_values_and_signs():
    assert [float(v) for v in e2m1_decode(torch.arange(16, dtype=torch.uint8))] == list(E2M1_VALUES)
    assert torch.signbit(e2m1_decode(torch.tensor([8], dtype=torch.uint8))).all()  # -0
    grid = torch.tensor(E2M1_VALUES)
    assert torch.equal(e2m1_encode(grid), torch.arange(16, dtype=torch.uint8))


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.1, 7.0, 100.0, -0.75, -5.0, -9.0])
    expected = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -4.0, -6.0]
    assert e2m1_decode(e2m1_encode(x)).tolist() == expected


def test_mxfp4_layout_low_nibble_first_and_e8m0_scales():
    # Rows on the e2m1 grid (codes 0..7 repeated) scaled by 2**-3 and -2**5.
    grid = torch.tensor(E2M1_VALUES[:8] * 4)
    weight = torch.stack([grid * 2.0**-3, -grid * 2.0**5])
    values, scales = quantize_mxfp4(weight)
    assert values.shape == (2, 16) and scales.shape == (2, 1) and values.dtype == scales.dtype == torch.uint8
    assert scales.tolist() == [[127 - 3], [127 + 5]]  # amax 6 * 2**e -> shared exponent e
    codes = torch.arange(8, dtype=torch.uint8).repeat(4)
    assert torch.equal(values[0], codes[0::2] | (codes[1::2] << 4))
    assert torch.equal(values[1], (codes[0::2] | 8) | ((codes[1::2] | 8) << 4))  # negatives (and -0) carry bit 3
    assert torch.equal(dequantize_mxfp4(values, scales), weight)


@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 40), blocks=st.integers(1, 5), seed=st.integers(0, 2**16), log_scale=st.integers(-20, 20))
def test_mxfp4_round_trip_follows_the_ocp_recipe(rows, blocks, seed, log_scale):
    weight = random_weight((rows, 32 * blocks), seed, 2.0**log_scale)
    values, scales = quantize_mxfp4(weight)
    restored = dequantize_mxfp4(values, scales)
    amax = weight.view(rows, blocks, 32).abs().amax(-1)
    shared = torch.floor(torch.log2(amax)) - 2
    assert torch.equal(scales.int() - 127, shared.int())
    scale = torch.exp2(shared).repeat_interleave(32, 1)
    # The nearest grid value (saturated at 6): the error is at most half the widest gap (2) times scale,
    # and the result equals the exact nearest grid point where no tie or saturation happens.
    nearest = torch.tensor(E2M1_VALUES[:8])
    magnitude = (weight / scale).abs().clamp(max=6.0)
    closest = nearest[(magnitude.unsqueeze(-1) - nearest).abs().argmin(-1)]
    assert torch.allclose(restored.abs(), closest * scale)
    assert torch.equal(torch.signbit(restored), torch.signbit(weight))
    assert torch.equal(dequantize_mxfp4(*quantize_mxfp4(restored)), restored)


def test_mxfp4_bf16_dequantize_is_exact():
    values, scales = quantize_mxfp4(random_weight((8, 64), 5))
    assert torch.equal(dequantize_mxfp4(values, scales, torch.bfloat16).float(), dequantize_mxfp4(values, scales))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: quantize_mxfp4(torch.randn(4, 48)), "multiple of 32"),
        (lambda: quantize_mxfp4(torch.tensor([[float("nan")] * 32])), "finite"),
        (lambda: quantize_fp8_block(torch.tensor([[float("inf")]])), "finite"),
        (lambda: quantize_fp8_block(torch.randint(0, 3, (4, 4))), "floating-point"),
        (lambda: dequantize_fp8_block(torch.randn(256, 256).to(torch.float8_e4m3fn), torch.ones(2, 1)), r"\[2, 2\]"),
        (lambda: dequantize_fp8_block(torch.randn(8, 8), torch.ones(1, 1)), "float8_e4m3fn"),
        (lambda: dequantize_fp8_block(torch.randn(8, 8).to(torch.float8_e4m3fn), torch.ones(1, 1).double()), "float32"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)), r"\[4, 1\]"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.uint8)), "multiple of 16"),
        (lambda: dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, dtype=torch.uint8)), "uint8"),
        (lambda: QuantizedTensor("int4", torch.zeros(1, 1), torch.zeros(1, 1)), "format must be"),
    ],
)
def test_bad_input_raises(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_fp8_checkpoint_loader_fuses_gate_and_up():
    gate, up, down = random_weight((2, 128, 256), 1), random_weight((2, 128, 256), 2), random_weight((2, 256, 128), 3)
    w13, w2 = fp8_experts_from_checkpoint(*quantize_fp8_block(gate), *quantize_fp8_block(up), *quantize_fp8_block(down))
    assert w13.shape == (2, 256, 256) and w13.scales.shape == (2, 2, 2)
    assert torch.equal(w13.dequantize(), torch.cat([QuantizedTensor.quantize(gate, "fp8").dequantize(),
                                                    QuantizedTensor.quantize(up, "fp8").dequantize()], 1))
    assert torch.equal(w2.dequantize(), QuantizedTensor.quantize(down, "fp8").dequantize())
    odd = QuantizedTensor.quantize(random_weight((2, 64, 256), 4), "fp8")
    with pytest.raises(ValueError, match="block boundary"):
        fp8_experts_from_checkpoint(odd.values, odd.scales, odd.values, odd.scales, *quantize_fp8_block(down))


def test_gpt_oss_loader_deinterleaves_gate_and_up():
    gate, up, down = random_weight((2, 16, 64), 1), random_weight((2, 16, 64), 2), random_weight((2, 64, 32), 3)
    interleaved = torch.stack([gate, up], 2).flatten(1, 2)  # rows g0 u0 g1 u1 ...
    values, scales = quantize_mxfp4(interleaved)
    blocks = values.view(2, 32, 2, 16)  # the checkpoint's [E, 2I, H/32, 16]
    down_values, down_scales = quantize_mxfp4(down)
    w13, w2 = mxfp4_experts_from_checkpoint(blocks, scales, down_values.view(2, 64, 1, 16), down_scales)
    expected = torch.cat([dequantize_mxfp4(*quantize_mxfp4(gate)), dequantize_mxfp4(*quantize_mxfp4(up))], 1)
    assert w13.shape == (2, 32, 64) and torch.equal(w13.dequantize(), expected)
    assert w2.shape == (2, 64, 32) and torch.equal(w2.dequantize(), dequantize_mxfp4(*quantize_mxfp4(down)))
    assert torch.equal(deinterleave_gate_up(torch.arange(6).view(1, 6)), torch.tensor([[0, 2, 4, 1, 3, 5]]))


def test_word_layout_round_trips_checkpoint_bytes():
    values = torch.randint(0, 256, (3, 5, 48), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    words = to_word_layout(values)
    assert words.shape == values.shape and words.dtype == torch.uint8
    assert not torch.equal(words, values)
    assert torch.equal(from_word_layout(words), values)
    for bad in (values[..., :6], values.to(torch.int16)):
        with pytest.raises(ValueError, match=r"K/2 a multiple of 4"):
            to_word_layout(bad)
        with pytest.raises(ValueError, match=r"K/2 a multiple of 4"):
            from_word_layout(bad)


@pytest.mark.parametrize("column", range(8))
def test_word_pairs_place_every_code_of_every_column_as_a_bf16(column):
    """The layout's definition: rotating a word by each term's rotation and masking (terms ORed)
    gives pair ``column % 4`` with the code of ``column`` in half ``column // 4``, worth
    ``e2m1 * 2**-126`` as a bf16, whatever the other columns hold."""
    generator = torch.Generator().manual_seed(column)
    nibbles = torch.randint(0, 16, (16, 8), generator=generator, dtype=torch.uint8)
    nibbles[:, column] = torch.arange(16, dtype=torch.uint8)
    words = to_word_layout(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(torch.int32).long().squeeze(1) & 0xFFFFFFFF
    placed = torch.zeros_like(words)
    for rotation, mask in WORD_PAIRS[column % 4]:
        rotated = ((words << rotation) | (words >> (32 - rotation))) & 0xFFFFFFFF
        placed |= rotated & mask
    half = ((placed >> (16 * (column // 4))) & 0xFFFF).to(torch.int32) << 16
    decoded = half.view(torch.float32) * 2.0**126
    assert decoded.tolist() == list(E2M1_VALUES)
    assert torch.equal(torch.signbit(decoded), torch.arange(16) >= 8)


def test_quantized_mxfp4_values_in_either_layout_mean_the_same_weights():
    """Checkpoint order by default (as loaders and quantize_mxfp4 give them); ``words`` as pools
    hold them. Each layout dequantizes to the same weights, and rows stack in either."""
    weight = random_weight((6, 64), 9)
    values, scales = quantize_mxfp4(weight)
    packed = QuantizedTensor.quantize(weight, "mxfp4")
    assert packed.layout == "checkpoint" and torch.equal(packed.values, values) and torch.equal(packed.scales, scales)
    words = packed.in_layout("words")
    assert words.layout == "words" and torch.equal(words.values, to_word_layout(values))
    assert words.in_layout("words") is words and torch.equal(words.in_layout("checkpoint").values, values)
    assert torch.equal(words.dequantize(), dequantize_mxfp4(values, scales))
    assert torch.equal(packed.dequantize(), words.dequantize())
    stacked = words.cat(packed)  # the second converted to the first's layout
    assert stacked.layout == "words" and torch.equal(stacked.dequantize(), torch.cat([packed.dequantize()] * 2))
    # words store their scales column-fastest (the GPU kernel then pipelines their loads), same values
    assert words.scales.stride() == (1, 6) and stacked.scales.stride() == (1, 12) and torch.equal(words.scales, scales)
    assert words.in_layout("checkpoint").scales.is_contiguous()
    given = QuantizedTensor("mxfp4", words.values, scales, "words")  # words whose scales lie in checkpoint order
    restored = given.in_layout("words")
    assert restored.scales.stride() == (1, 6) and restored.values is words.values and torch.equal(restored.scales, scales)
    experts = QuantizedTensor("mxfp4", words.values[None], words.scales[None], "words")
    assert experts[0].layout == "words" and words.to("cpu").layout == "words"
    fp8 = QuantizedTensor.quantize(torch.randn(128, 128), "fp8")
    for bad in (lambda: fp8.in_layout("words"), lambda: QuantizedTensor("fp8", fp8.values, fp8.scales, "words"),
                lambda: packed.in_layout("nibbles")):
        with pytest.raises(ValueError, match="layout must be"):
            bad()
