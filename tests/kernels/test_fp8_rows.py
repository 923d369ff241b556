"""Packed fp8 rows (flatep.kernels.fp8_rows): the layout, the Triton kernels against the torch twins."""
from __future__ import annotations

import pytest
import torch

from flatep import EPConfig, make_plan
from flatep.kernels.backend import use_triton
from flatep.kernels.dispatch import real_rows_torch
from flatep.kernels.fp8_rows import (
    pack_rows_torch, pack_rows_triton, packed_row_bytes, packed_words, unpack_real_rows_torch, unpack_real_rows_triton,
    unpack_rows_torch,
)
from flatep.plan.split import split_slot_rows
from flatep.quant import quantize_fp8_activations
from tests.helpers import DEVICE, make_inputs

needs_triton = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


def tokens(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (one all zero, one far past e4m3's range), fresh per seed."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp(4 * torch.randn(*shape[:-1], 1, generator=generator))
    x.view(-1, shape[-1])[0] = 0.0
    x.view(-1, shape[-1])[1] *= 1e6
    return x.to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("hidden", [256, 200, 36])
def test_packed_row_holds_the_activation_quantization_values_then_scales(hidden):
    x = tokens((3, 5, hidden), torch.bfloat16, seed=hidden)
    packed = pack_rows_torch(x)
    groups = -(-hidden // 128)
    assert packed.shape == (3, 5, hidden // 4 + groups) and packed.dtype == torch.int32
    assert packed_row_bytes(hidden) == hidden + 4 * groups == 4 * packed.shape[-1]
    values, scales = quantize_fp8_activations(x.view(-1, hidden))
    row_bytes = packed.view(-1, packed.shape[-1]).view(torch.uint8)
    assert torch.equal(row_bytes[:, :hidden], values.view(torch.uint8))
    assert torch.equal(row_bytes[:, hidden:].contiguous().view(torch.float32), scales)
    # Dequantized: value times its group's scale, rounded once to the row's dtype.
    expected = (values.float() * scales.repeat_interleave(128, dim=1)[:, :hidden]).to(x.dtype)
    assert torch.equal(unpack_rows_torch(packed, hidden, x.dtype).view(-1, hidden), expected)


def test_round_trip_error_is_e4m3s_and_an_all_zero_row_stays_zero():
    x = tokens((64, 512), torch.float32, seed=1)
    back = unpack_rows_torch(pack_rows_torch(x), 512, torch.float32)
    assert torch.equal(back[0], torch.zeros(512, device=DEVICE))
    groups = x.view(64, 4, 128)
    scale = groups.abs().amax(-1, keepdim=True) / 448
    # Half an e4m3 step: 2**-4 of the value for normals (3 mantissa bits), 2**-10 of the scale below 2**-6.
    bound = torch.maximum(groups.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    error = (back.view(64, 4, 128) - groups).abs()
    assert bool((error <= bound).all())
    assert float(error.max()) > 0  # quantized, not copied


def test_odd_hidden_sizes_are_refused():
    with pytest.raises(ValueError, match="multiple of 4, got H=30"):
        packed_words(30)


@needs_triton
@pytest.mark.parametrize("hidden", [256, 200, 36])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_packing_is_bit_equal_to_torch(hidden, dtype):
    x = tokens((2, 7, hidden), dtype, seed=hidden + 3)
    assert torch.equal(pack_rows_triton(x), pack_rows_torch(x))


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a GPU (the interpreter divides exactly)")
def test_triton_packing_is_bit_equal_to_torch_over_millions_of_values():
    """The GPU's default fp32 division is approximate: with it, a few values in a million landed on
    the next e4m3 code (seen at 32768 x 7168). The kernel divides correctly rounded, as torch does."""
    x = tokens((32768, 7168), torch.bfloat16, seed=11)
    assert torch.equal(pack_rows_triton(x), pack_rows_torch(x))


@needs_triton
@pytest.mark.parametrize("dedup", [True, False])
@pytest.mark.parametrize("policy", ["exact", "none"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_unpacking_writes_exactly_the_real_rows(dedup, policy, dtype):
    config = EPConfig(ranks=4, experts=16, top_k=3, hidden=200, intermediate=8, capacity=9, align=4, dedup=dedup)
    _, ids, _, _, _ = make_inputs(config, 9, 2.0, torch.float32, seed=4)
    plan = split_slot_rows(make_plan(ids, config, policy, tokens=[9, 3, 0, 9]))
    rows = plan.shard_rows + 5  # the buffers are larger than a step's rows
    packed = pack_rows_torch(tokens((4, rows, 200), torch.float32, seed=9))
    real = real_rows_torch(plan.offsets, plan.padding, plan.slot_base, rows)
    expected = torch.full((4, rows, 200), float("nan"), dtype=dtype, device=DEVICE)
    unpack_real_rows_torch(packed, expected, real)
    for programs in (None, 3):
        out = torch.full_like(expected, float("nan"))
        unpack_real_rows_triton(packed, out, plan.offsets, plan.padding, plan.slot_base, 0, programs=programs)
        assert torch.equal(out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    assert bool(out[real].isfinite().all()) and bool(out[~real].isnan().all()) and bool(real.any())
    # One rank of a per-process group: its own shard, its rank's rows of the tables.
    mine = torch.full((rows, 200), float("nan"), dtype=dtype, device=DEVICE)
    unpack_real_rows_triton(packed[3], mine, plan.offsets, plan.padding, plan.slot_base, 3)
    assert torch.equal(mine.isnan(), expected[3].isnan()) and torch.equal(mine[real[3]], expected[3][real[3]])
