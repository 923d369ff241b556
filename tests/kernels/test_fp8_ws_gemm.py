"""The warp-specialized fp8 grouped GEMM (``GemmConfig(warp_specialize=True)``): its row-tile table
against the tile numbering of the other grouped GEMMs, its results against the plain kernel and the
torch path (interpreter on CPU, where the warp specialization itself does not run; the GPU tests
run it), and its checks."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from flatep.experts.grouped import quantized_grouped_mm
from flatep.kernels.grouped_tiles import ROW_TILE_FIELDS, listed_tile, row_tile_entry, row_tile_table
from flatep.kernels.quant_gemm import GemmConfig, fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.quant import QuantizedTensor, quantize_fp8_activations
from tests.helpers import DEVICE, relative_error
from tests.quant.test_grouped import expected_tile_order, grouped_inputs, needs_triton, store_tile

WS = GemmConfig(128, 64, warp_specialize=True, num_stages=3, programs_per_sm=1)


def assert_same_arithmetic(out: torch.Tensor, plain: torch.Tensor) -> None:
    """The plain kernel's result: bit for bit under the interpreter (the same fp32 sums in the same
    order); on a GPU within one bf16 rounding (the MMA instructions of the two kernels may differ)."""
    if DEVICE.type == "cuda":
        assert torch.equal(out.isinf(), plain.isinf())
        finite = ~out.isinf()
        assert relative_error(out[finite].float(), plain[finite].float()) < 1e-3
    else:
        assert torch.equal(out, plain)


@triton.jit
def _listed_order_kernel(table_ptr, out_ptr, tiles, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUP_M: tl.constexpr):
    tile = tl.program_id(0)
    while tile < tiles:
        group, start, end, base, count = row_tile_entry(table_ptr, tile, N, BLOCK_N)
        group, first, last, first_column = listed_tile(tile, group, start, end, base, count, N, BLOCK_M, BLOCK_N, GROUP_M)
        store_tile(out_ptr, tile, group, first, last, first_column)
        tile += tl.num_programs(0)


@needs_triton
@pytest.mark.parametrize("sizes, split, columns, config", [
    ([40], None, 96, GemmConfig(16, 32, group_m=2)),  # one group, a shorter last band
    ([3, 0, 50, 1, 0, 17], None, 64, GemmConfig(16, 16, group_m=3)),  # ragged, empty groups inside
    ([0, 0, 0, 5], None, 48, GemmConfig(32, 16, group_m=1)),  # leading empty groups
    ([3, 0, 20, 5, 0, 9], 3, 64, GemmConfig(16, 32, group_m=2)),  # a second run of groups (slots)
    ([int(size) for size in torch.randint(0, 70, (29,), generator=torch.Generator().manual_seed(5))], None, 80,
     GemmConfig(32, 32, group_m=4)),  # many groups
])
def test_listed_tiles_are_the_tiles_of_the_launch_in_order(sizes, split, columns, config):
    """The row-tile table, row_tile_entry and listed_tile give each tile what tile_table and locate_tile give it."""
    split_start = 48 if split is not None else 0
    ends, start = [], 0
    for group, size in enumerate(sizes):
        start = split_start if group == split else start
        start += size
        ends.append(start)
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    rows = max(ends + [0]) + 7
    expected = expected_tile_order(sizes, columns, config, split=split, split_start=split_start)
    table = row_tile_table(offsets, rows, config.block_m, len(sizes) if split is None else split, split_start, 0,
                           2**31 - 1)
    assert table.shape == ((rows + len(sizes) * (config.block_m - 1)) // config.block_m, ROW_TILE_FIELDS.value)
    tiles = torch.full((len(expected) + 1, 4), -1, dtype=torch.int32, device=DEVICE)
    _listed_order_kernel[(3,)](table, tiles, len(expected), columns, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
                               GROUP_M=config.group_m)
    assert [tuple(row) for row in tiles[:len(expected)].tolist()] == expected


@needs_triton
@pytest.mark.parametrize("sizes, out_features, in_features, config", [
    ([5, 0, 19, 2], 256, 256, WS),  # groups shorter than a tile: the tile's rows span groups
    ([130, 0, 7, 140], 160, 384, dataclasses.replace(WS, block_n=32, group_m=2)),  # several row tiles, bands, N % 32
    ([0, 0, 3], 128, 128, dataclasses.replace(WS, block_n=128)),
])
def test_warp_specialized_fp8_equals_the_plain_kernel_and_torch(sizes, out_features, in_features, config):
    rows, packed, offsets = grouped_inputs("fp8", sizes, out_features, in_features, seed=sum(sizes) + out_features)
    end = int(offsets[-1])
    out = torch.full((rows.shape[0], out_features), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config, out=out)
    plain = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, dataclasses.replace(config, warp_specialize=False))
    reference = quantized_grouped_mm(rows, packed, offsets, backend="torch")
    assert relative_error(out[:end], reference[:end]) < 4e-3
    assert_same_arithmetic(out[:end], plain[:end])
    assert (out[end:] == float("inf")).all()  # past the last offset: not written


@needs_triton
@pytest.mark.parametrize("group_rows", [None, (0, 20), (20, 2**31 - 1)])
def test_warp_specialized_fp8_runs_slots_and_row_filters(group_rows):
    """Home groups and a second weight set (a layer's borrow slots, from row slot_base) in the two
    launches over one row-tile table equal the plain kernel; a rows filter computes its groups only."""
    home_sizes, slot_sizes, slot_base, hidden, inner = [3, 0, 30], [25, 6], 40, 128, 256
    generator = torch.Generator().manual_seed(17)
    rows = torch.randn(slot_base + sum(slot_sizes) + 3, inner, generator=generator).bfloat16().to(DEVICE)
    home = QuantizedTensor.quantize(torch.randn(3, hidden, inner, generator=generator) * inner**-0.5, "fp8").to(DEVICE)
    slots = QuantizedTensor.quantize(torch.randn(2, hidden, inner, generator=generator) * inner**-0.5, "fp8").to(DEVICE)
    ends = torch.tensor(home_sizes).cumsum(0).tolist() + (slot_base + torch.tensor(slot_sizes).cumsum(0)).tolist()
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    results = []
    for config in (WS, dataclasses.replace(WS, warp_specialize=False)):
        out = torch.full((rows.shape[0], hidden), float("inf"), dtype=torch.bfloat16, device=DEVICE)
        fp8_grouped_mm_triton(rows, home.values, home.scales, offsets, config, out=out, group_rows=group_rows,
                              slots=(slots.values, slots.scales), slot_base=slot_base)
        results.append(out)
    assert_same_arithmetic(results[0], results[1])
    written = ~results[0].isinf().all(-1)
    sizes = home_sizes + slot_sizes
    low, high = group_rows or (0, 2**31 - 1)
    starts = [0, 3, 3, slot_base, slot_base + 25]
    expected = torch.zeros_like(written)
    for start, size in zip(starts, sizes):
        expected[start:start + size] = low < size <= high
    assert torch.equal(written, expected)


@needs_triton
def test_warp_specialized_fp8_takes_rows_given_quantized():
    rows, packed, offsets = grouped_inputs("fp8", [9, 70], 128, 256, seed=3)
    end = int(offsets[-1])
    activations = quantize_fp8_activations(rows)
    out = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, WS, activations=activations)
    plain = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, dataclasses.replace(WS, warp_specialize=False),
                                  activations=activations)
    assert_same_arithmetic(out[:end], plain[:end])


@pytest.mark.parametrize("config, message", [
    (dataclasses.replace(WS, swap_ab=True), "warp_specialize takes unswapped"),
    (dataclasses.replace(WS, rescale=True), "warp_specialize takes unswapped"),
    (dataclasses.replace(WS, block_m=64), "128-row tiles"),
    (dataclasses.replace(WS, num_warps=8), "on 4 warps"),
    (dataclasses.replace(WS, programs_per_sm=2), "one program per SM"),
])
def test_warp_specialize_takes_the_tiles_it_was_built_for(config, message):
    rows, packed, offsets = grouped_inputs("fp8", [3, 4], 128, 256, seed=2)
    with pytest.raises(ValueError, match=message):
        fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)


def test_warp_specialize_refuses_activations_tma_cannot_read():
    rows, packed, offsets = grouped_inputs("fp8", [3, 4], 128, 256, seed=2)
    values, scales = quantize_fp8_activations(rows)
    wide = torch.zeros(rows.shape[0], 256 + 8, dtype=values.dtype, device=values.device)
    wide[:, :256] = values  # rows 264 bytes apart: not a multiple of 16
    with pytest.raises(ValueError, match="activations must start at a multiple of 16 bytes"):
        fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, WS, activations=(wide[:, :256], scales))


def test_warp_specialize_is_an_fp8_option():
    rows, packed, offsets = grouped_inputs("mxfp4", [2, 3], 32, 64, seed=2)
    with pytest.raises(ValueError, match="rescale and warp_specialize are fp8 tile options"):
        mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, GemmConfig(128, 32, 32, warp_specialize=True))
