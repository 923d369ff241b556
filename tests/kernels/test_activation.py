"""The experts' elementwise kernels: real rows equal the torch twin, rows past ``end`` untouched."""
from __future__ import annotations

import pytest
import torch

from flatep.experts.grouped import grouped_swiglu
from flatep.kernels.activation import copy_rows_triton, swiglu_weighted_torch, swiglu_weighted_triton
from flatep.kernels.backend import use_triton
from tests.helpers import DEVICE, relative_error

POISON = 1e4

pytestmark = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


def end_tensor(end: int) -> torch.Tensor:
    return torch.tensor([end], dtype=torch.int32, device=DEVICE)


def random_inputs(rows: int, intermediate: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, 2 * intermediate, generator=generator) * 3
    weights = torch.rand(rows, generator=generator) + 0.1
    return hidden.to(DEVICE, dtype), weights.to(DEVICE)


def check_rows(out: torch.Tensor, expected: torch.Tensor, end: int) -> None:
    """Rows before ``end`` equal the fp32 ``expected`` (exp differs slightly, so a bf16 value may round
    to its neighbour: within one ulp); the rest still poisoned."""
    assert expected.dtype == torch.float32
    rtol = 2**-7 if out.dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(out[:end].float(), expected[:end], rtol=rtol, atol=1e-6)
    assert torch.equal(out[end:], torch.full_like(out[end:], POISON))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, intermediate, end", [(13, 8, 9), (40, 24, 40), (33, 16, 0), (17, 12, 1), (40, 8, 37)])
def test_swiglu_weighted_writes_the_real_rows_only(rows, intermediate, end, dtype, out_dtype):
    hidden, weights = random_inputs(rows, intermediate, dtype, seed=rows + end)
    out = torch.full((rows, intermediate), POISON, dtype=out_dtype, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(end), out, block_m=4, block_i=8)
    check_rows(out, swiglu_weighted_torch(hidden, weights, torch.float32), end)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_weighted_default_blocks_and_column_tail(dtype):
    # I = 24 is not a power of two: one column chunk of 32 with a masked tail.
    hidden, weights = random_inputs(29, 24, dtype, seed=3)
    out = torch.full((29, 24), POISON, dtype=dtype, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(22), out)
    check_rows(out, swiglu_weighted_torch(hidden, weights, torch.float32), 22)


def test_swiglu_weighted_propagates_nan_or_inf_weights_to_their_rows_only():
    hidden, weights = random_inputs(20, 16, torch.float32, seed=4)
    bad = torch.tensor([1, 5, 6, 18], device=DEVICE)
    weights[bad] = torch.tensor([float("nan"), float("inf"), -float("inf"), float("nan")], device=DEVICE)
    out = torch.full((20, 16), POISON, dtype=torch.float32, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(19), out, block_m=2, block_i=8)
    assert not torch.isfinite(out[bad]).any()  # as a dense MoE: the bad weight reaches its row
    assert torch.isfinite(out[:19][weights[:19].isfinite()]).all()  # and no other row
    expected = swiglu_weighted_torch(hidden, weights, torch.float32)
    torch.testing.assert_close(out[:19], expected[:19], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert torch.equal(out[19:], torch.full_like(out[19:], POISON))


def test_swiglu_weighted_reads_nothing_past_end():
    hidden, weights = random_inputs(16, 8, torch.float32, seed=5)
    hidden[10:] = float("nan")
    weights[10:] = float("nan")
    out = torch.full((16, 8), POISON, dtype=torch.float32, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(10), out, block_m=4, block_i=8)
    check_rows(out, swiglu_weighted_torch(hidden, weights, torch.float32), 10)


def test_swiglu_weighted_end_as_a_view_of_offsets():
    hidden, weights = random_inputs(24, 8, torch.bfloat16, seed=6)
    offsets = torch.tensor([4, 4, 12, 17], dtype=torch.int32, device=DEVICE)
    out = torch.full((24, 8), POISON, dtype=torch.float32, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, offsets[-1:], out)
    check_rows(out, swiglu_weighted_torch(hidden, weights, torch.float32), 17)


@pytest.mark.parametrize("target_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("source_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows, columns, end", [(13, 40, 9), (40, 24, 40), (33, 16, 0), (21, 48, 1), (40, 8, 35)])
def test_copy_rows_copies_the_real_rows_only(rows, columns, end, source_dtype, target_dtype):
    generator = torch.Generator().manual_seed(rows + end)
    source = (torch.randn(rows, columns, generator=generator) * 5).to(DEVICE, source_dtype)
    target = torch.full((rows, columns), POISON, dtype=target_dtype, device=DEVICE)
    copy_rows_triton(target, source, end_tensor(end), block_m=4, block_n=16)
    check_rows(target, source.float(), end)
    if source_dtype == target_dtype or target_dtype == torch.float32:
        assert torch.equal(target[:end], source[:end].to(target_dtype))  # exact copy or widening


def test_copy_rows_into_a_row_slice_of_a_larger_buffer():
    generator = torch.Generator().manual_seed(7)
    source = torch.randn(12, 40, generator=generator).to(DEVICE)
    buffer = torch.full((30, 40), POISON, device=DEVICE)
    copy_rows_triton(buffer[10:22], source, end_tensor(7))
    assert torch.equal(buffer[10:17], source[:7])
    buffer[10:17] = POISON
    assert torch.equal(buffer, torch.full_like(buffer, POISON))


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_swiglu_triton_equals_torch_on_the_real_rows(dtype, out_dtype):
    rows, hidden_size, intermediate = 40, 32, 16
    offsets = torch.tensor([8, 8, 16, 29], dtype=torch.int32, device=DEVICE)
    generator = torch.Generator().manual_seed(8)
    shard = torch.randn(rows, hidden_size, generator=generator).to(DEVICE, dtype)
    weights = (torch.rand(rows, generator=generator) + 0.1).to(DEVICE)
    w13 = (torch.randn(4, 2 * intermediate, hidden_size, generator=generator) * hidden_size**-0.5).to(DEVICE, dtype)
    w2 = (torch.randn(4, hidden_size, intermediate, generator=generator) * intermediate**-0.5).to(DEVICE, dtype)
    outs = [grouped_swiglu(shard, weights, w13, w2, offsets, out_dtype=out_dtype, backend=backend)
            for backend in ("torch", "triton")]
    end = int(offsets[-1])
    assert outs[1].dtype == (out_dtype or dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(outs[1][:end], outs[0][:end], rtol=1e-5, atol=1e-6)
    else:  # the activated rows round to bf16 differently (by an ulp) before the down GEMM
        assert relative_error(outs[1][:end], outs[0][:end]) < 2**-7


@pytest.mark.parametrize("programs", [1, 2, 3])
@pytest.mark.parametrize("end", [0, 5, 23, 40])
def test_few_programs_stride_over_every_real_row_block(programs, end):
    # Fewer row programs than row blocks: each walks blocks first, first + programs*block, ...
    hidden, weights = random_inputs(40, 8, torch.float32, seed=8 + end)
    out = torch.full((40, 8), POISON, dtype=torch.float32, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(end), out, block_m=4, block_i=8, programs=programs)
    check_rows(out, swiglu_weighted_torch(hidden, weights, torch.float32), end)
    target = torch.full((40, 16), POISON, dtype=torch.float32, device=DEVICE)
    source = hidden.float()[:, :16].contiguous()
    copy_rows_triton(target, source, end_tensor(end), block_m=4, block_n=8, programs=programs)
    check_rows(target, source, end)


@pytest.mark.parametrize("programs", [1, 2, None])
@pytest.mark.parametrize("end, start, stop", [(40, 9, 30), (40, 8, 32), (25, 0, 20), (40, 12, 40), (20, 25, 30), (40, 5, 5)])
def test_skipped_rows_are_neither_read_nor_written(programs, end, start, stop):
    """skip=(start, stop): two runs of rows, [0, start) and [stop, end), each computed as without a
    skip (block boundaries of the second run start at stop); the skipped rows (NaN in the input)
    and the rows past the end keep their poison, whatever the number of programs."""
    hidden, weights = random_inputs(40, 8, torch.float32, seed=start + stop)
    hidden[start:stop] = float("nan")
    hidden[end:] = float("nan")
    skip = (end_tensor(start), stop)
    out = torch.full((40, 8), POISON, dtype=torch.float32, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(end), out, block_m=4, block_i=8, programs=programs, skip=skip)
    expected = swiglu_weighted_torch(hidden, weights, torch.float32)
    computed = torch.zeros(40, dtype=torch.bool, device=DEVICE)
    computed[:min(start, end)] = True
    computed[stop:end] = True
    torch.testing.assert_close(out[computed], expected[computed], rtol=1e-6, atol=1e-6)
    assert bool((out[~computed] == POISON).all())
    target = torch.full((40, 16), POISON, dtype=torch.float32, device=DEVICE)
    source = hidden.float()[:, :16].contiguous()
    copy_rows_triton(target, source, end_tensor(end), block_m=4, block_n=8, programs=programs, skip=skip)
    assert torch.equal(target[computed], source[computed]) and bool((target[~computed] == POISON).all())


@pytest.mark.parametrize("skip", [(5, 3), (torch.tensor([1.0]), 3), (torch.tensor([1], dtype=torch.int32), 99)])
def test_skip_is_checked(skip):
    hidden, weights = random_inputs(8, 8, torch.float32, seed=9)
    if isinstance(skip[0], torch.Tensor):
        skip = (skip[0].to(DEVICE), skip[1])
    with pytest.raises(ValueError, match="skip must be"):
        swiglu_weighted_triton(hidden, weights, end_tensor(8), torch.empty(8, 8, device=DEVICE), skip=skip)


def test_programs_must_be_positive():
    hidden, weights = random_inputs(8, 8, torch.float32, seed=9)
    with pytest.raises(ValueError, match="programs must be a positive integer"):
        swiglu_weighted_triton(hidden, weights, end_tensor(8), torch.empty(8, 8, device=DEVICE), programs=0)


@pytest.mark.parametrize("rows, intermediate, end, block_i", [
    (13, 256, 9, None), (40, 384, 40, 128), (33, 128, 0, None), (17, 640, 1, 256), (9, 256, 5, 128),
])
def test_swiglu_quantized_for_an_fp8_down_projection_equals_the_two_launches(rows, intermediate, end, block_i):
    """The fused pass (swiglu, bf16 rounding, per-128-column e4m3 quantization) is bit-equal to the
    swiglu kernel followed by the fp8 GEMM's own activation quantization; rows past end untouched."""
    from flatep.kernels.fp8_activations import quantize_fp8_activations_triton

    hidden, weights = random_inputs(rows, intermediate, torch.bfloat16, seed=rows + intermediate)
    hidden[end:] = float("nan")  # padding rows: never read
    activated = torch.full((rows, intermediate), POISON, dtype=torch.bfloat16, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(end), activated)
    expected_values, expected_scales = quantize_fp8_activations_triton(activated, end_tensor(end))
    values = torch.full((rows, intermediate), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scales = torch.full((rows, intermediate // 128), POISON, device=DEVICE)
    swiglu_weighted_triton(hidden, weights, end_tensor(end), values, block_i=block_i, scales=scales)
    assert torch.equal(values[:end].view(torch.uint8), expected_values[:end].view(torch.uint8))
    assert torch.equal(scales[:end], expected_scales[:end])
    assert bool((values[end:].view(torch.uint8) == 0x7F).all()) and bool((scales[end:] == POISON).all())


def test_swiglu_quantized_refuses_bad_shapes():
    hidden, weights = random_inputs(4, 192, torch.bfloat16, seed=1)
    values = torch.empty(4, 192, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match="I a multiple of 128"):
        swiglu_weighted_triton(hidden, weights, end_tensor(4), values, scales=torch.empty(4, 1, device=DEVICE))
    hidden, weights = random_inputs(4, 256, torch.bfloat16, seed=1)
    values = torch.empty(4, 256, dtype=torch.float8_e4m3fn, device=DEVICE)
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\] float32"):
        swiglu_weighted_triton(hidden, weights, end_tensor(4), values, scales=torch.empty(4, 1, device=DEVICE))
    with pytest.raises(ValueError, match="block_i must be a multiple of 128"):
        swiglu_weighted_triton(hidden, weights, end_tensor(4), values, block_i=64, scales=torch.empty(4, 2, device=DEVICE))
    with pytest.raises(ValueError, match=r"out must be bfloat16 or float32 \(float8_e4m3fn with scales\)"):
        swiglu_weighted_triton(hidden, weights, end_tensor(4), values)  # fp8 values without their scales
