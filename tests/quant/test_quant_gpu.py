"""On a GPU: the packed grouped GEMMs at real expert sizes against the torch reference, inside a
CUDA graph and without host synchronisation."""
from __future__ import annotations

import pytest
import torch

from flatep.experts.grouped import grouped_swiglu, quantized_grouped_mm
from flatep.quant import QuantizedTensor
from tests.helpers import relative_error

# xdist_group: these files take tens of GB of GPU memory each; they run one at a time (tests/gpu_memory.py).
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.xdist_group("gpu-memory"),
]


@pytest.mark.parametrize("format, hidden, intermediate", [("fp8", 7168, 2048), ("mxfp4", 3584, 3072), ("mxfp4", 2880, 2880)])
@pytest.mark.parametrize("sizes", [[16, 0, 3, 16], [128, 1, 200, 64], [1024, 1024, 0, 7]])
def test_packed_experts_at_real_sizes_in_a_graph(format, hidden, intermediate, sizes):
    generator = torch.Generator(device="cuda").manual_seed(len(sizes) + sum(sizes))
    groups = len(sizes)
    w13 = torch.randn(groups, 2 * intermediate, hidden, device="cuda", generator=generator) * hidden**-0.5
    w2 = torch.randn(groups, hidden, intermediate, device="cuda", generator=generator) * intermediate**-0.5
    q13, q2 = QuantizedTensor.quantize(w13, format), QuantizedTensor.quantize(w2, format)
    rows = sum(sizes) + 5
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    route_weights = torch.rand(rows, device="cuda", generator=generator)
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    end = sum(sizes)
    reference = grouped_swiglu(x, route_weights, q13, q2, offsets, backend="torch")
    hidden_reference = quantized_grouped_mm(x, q13, offsets, backend="torch")
    out = torch.full((rows, hidden), float("nan"), device="cuda", dtype=torch.bfloat16)
    grouped_swiglu(x, route_weights, q13, q2, offsets, backend="triton", out=out)  # compile outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            grouped_swiglu(x, route_weights, q13, q2, offsets, backend="triton", out=out)
            hidden_out = quantized_grouped_mm(x, q13, offsets, backend="triton")
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert relative_error(hidden_out[:end], hidden_reference[:end]) < 4e-3
    assert relative_error(out[:end], reference[:end]) < (2e-2 if format == "fp8" else 1e-2)


@pytest.mark.parametrize("sizes", [[16, 0, 3, 16], [128, 1, 200, 64]])
def test_fp8_gemm_on_packed_dispatch_rows_equals_quantizing_the_rows_itself(sizes):
    """The gate/up GEMM reading fp8 dispatch's packed rows (strided views, no copy) gives, bit for
    bit, what it gives quantizing the bf16 rows itself: the quantization is the same."""
    from flatep.kernels.fp8_rows import Fp8Rows, pack_rows_triton

    hidden, intermediate = 7168, 2048
    generator = torch.Generator(device="cuda").manual_seed(sum(sizes))
    w13 = torch.randn(len(sizes), 2 * intermediate, hidden, device="cuda", generator=generator) * hidden**-0.5
    q13 = QuantizedTensor.quantize(w13, "fp8")
    rows, end = sum(sizes) + 5, sum(sizes)
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    expected = quantized_grouped_mm(x, q13, offsets, backend="triton")
    activations = Fp8Rows.of(pack_rows_triton(x), hidden)
    poisoned = torch.full_like(x, float("nan"))  # not read
    got = quantized_grouped_mm(poisoned, q13, offsets, backend="triton", activations=activations)
    assert torch.equal(got[:end], expected[:end])


@pytest.mark.parametrize("rows_per_group", [16, 32, 128])
def test_mxfp4_scales_in_either_order_give_the_same_bits(rows_per_group):
    """Kimi-K3's gate/up shape: the kernel compiled for column-fastest scales (pools', pipelined)
    and for the checkpoint's order gives the same output bit for bit, home experts and slots."""
    from flatep.kernels.packed_tiles import default_config
    from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

    hidden, columns, groups = 3584, 6144, 4
    generator = torch.Generator(device="cuda").manual_seed(rows_per_group)
    weights = QuantizedTensor.quantize(torch.randn(groups, columns, hidden, device="cuda", generator=generator)
                                       * hidden**-0.5, "mxfp4").in_layout("words")
    assert weights.scales.stride(1) == 1
    rows = groups * rows_per_group
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * rows_per_group
    config = default_config(rows, groups, "mxfp4")
    home, slots = weights[:2], weights[2:]
    by_column = mxfp4_grouped_mm_triton(x, home.values, home.scales, offsets, config,
                                        slots=(slots.values, slots.scales), slot_base=2 * rows_per_group)
    by_block = mxfp4_grouped_mm_triton(x, home.values, home.scales.contiguous(), offsets, config,
                                       slots=(slots.values, slots.scales.contiguous()), slot_base=2 * rows_per_group)
    assert torch.equal(by_column, by_block) and by_column.isfinite().all()


@pytest.mark.parametrize("tiles", [(64, 128, 4, 4, 2), (128, 128, 8, 3, 1), (256, 128, 8, 3, 1), (128, 128, 4, 3, 2)])
def test_fp8_rescaled_tall_tiles_at_kimi_k2_size(tiles):
    """The tile sweep's rescaled fp8 candidates (GemmConfig.rescale) on the GPU at Kimi-K2's gate/up
    shape and prefill sizes, against the torch path."""
    from flatep.kernels.packed_tiles import GemmConfig
    from flatep.kernels.quant_gemm import fp8_grouped_mm_triton

    block_m, block_n, warps, stages, per_sm = tiles
    hidden, columns, sizes = 7168, 4096, [1024, 0, 700, 1500]
    generator = torch.Generator(device="cuda").manual_seed(block_m)
    weights = QuantizedTensor.quantize(torch.randn(len(sizes), columns, hidden, device="cuda", generator=generator)
                                       * hidden**-0.5, "fp8")
    rows, end = sum(sizes) + 3, sum(sizes)
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    config = GemmConfig(block_m, block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm, rescale=True)
    got = fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config)
    reference = quantized_grouped_mm(x, weights, offsets, backend="torch")
    assert relative_error(got[:end], reference[:end]) < 4e-3


PREFILL_TILES = {
    "plain": dict(block_m=64, block_n=128, num_warps=4, num_stages=4),
    "rescale": dict(block_m=128, block_n=128, num_warps=4, num_stages=3, rescale=True),
    "wgmma": dict(block_m=128, block_n=128, num_warps=8, num_stages=5, programs_per_sm=1, wgmma=True),
    "wgmma-6": dict(block_m=128, block_n=128, num_warps=8, num_stages=6, programs_per_sm=1, wgmma=True),
}


def _skip_without_wgmma(tiles: str) -> None:
    from flatep.kernels import fp8_wgmma

    if tiles.startswith("wgmma") and not fp8_wgmma.available(torch.device("cuda")):
        pytest.skip("the Gluon wgmma kernel needs a Hopper (sm_90) GPU")


@pytest.mark.parametrize("tiles", list(PREFILL_TILES))
@pytest.mark.parametrize("columns, hidden", [(4096, 7168), (7168, 2048)])
def test_fp8_prefill_tiles_with_slots_in_a_graph(tiles, columns, hidden):
    """The fp8 GEMM's prefill tiles (the default 64 x 128, 128 x 128 rescaled on 4 warps, and the
    Gluon wgmma kernel) on the GPU at Kimi-K2's gate/up and down shapes, home experts and slots in
    one call captured in a CUDA graph, against the torch path; rows of no group stay as they were
    (the padding rows, which the 128-row tiles copy into shared memory, hold NaN)."""
    from flatep.kernels.packed_tiles import GemmConfig
    from flatep.kernels.quant_gemm import fp8_grouped_mm_triton

    _skip_without_wgmma(tiles)
    home_sizes, slot_sizes, gap = [1024, 0, 700, 1500], [300, 5], 77
    generator = torch.Generator(device="cuda").manual_seed(len(tiles) + columns)

    def experts(count):
        weights = torch.randn(count, columns, hidden, device="cuda", generator=generator) * hidden**-0.5
        return QuantizedTensor.quantize(weights, "fp8")

    home, slots = experts(len(home_sizes)), experts(len(slot_sizes))
    slot_base = sum(home_sizes) + gap
    rows = slot_base + sum(slot_sizes) + 3
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    x[sum(home_sizes):slot_base] = float("nan")
    x[slot_base + sum(slot_sizes):] = float("nan")
    ends = torch.tensor(home_sizes).cumsum(0).tolist() + (slot_base + torch.tensor(slot_sizes).cumsum(0)).tolist()
    offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
    config = GemmConfig(**PREFILL_TILES[tiles])
    out = torch.full((rows, columns), float("inf"), dtype=torch.bfloat16, device="cuda")

    def call():
        fp8_grouped_mm_triton(x, home.values, home.scales, offsets, config, out=out,
                              slots=(slots.values, slots.scales), slot_base=slot_base)

    call()  # compiles outside the capture
    out.fill_(float("inf"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    torch.cuda.synchronize()
    home_end = sum(home_sizes)
    reference = quantized_grouped_mm(x[:home_end], home, offsets[:len(home_sizes)], backend="torch")
    slot_reference = quantized_grouped_mm(x[slot_base:], slots, offsets[len(home_sizes):] - slot_base, backend="torch")
    assert relative_error(out[:home_end], reference[:home_end]) < 4e-3
    assert relative_error(out[slot_base:slot_base + sum(slot_sizes)], slot_reference[:sum(slot_sizes)]) < 4e-3
    assert (out[home_end:slot_base] == float("inf")).all() and (out[slot_base + sum(slot_sizes):] == float("inf")).all()



@pytest.mark.parametrize("hidden", [640, 1664, 2048])
@pytest.mark.parametrize("group_rows", [None, (200, 2**31 - 1)])
def test_fp8_wgmma_kernel_against_the_triton_tiles(hidden, group_rows):
    """The Gluon kernel at K steps that fill its unrolled chunks or leave a partial one (5, 13 and
    16 steps of 128: as few as its stages), over groups of 0 to 1500 rows and a launch of only the
    larger groups, against the torch path and against the Triton 64 x 128 tile; rows it does not
    compute stay as they were."""
    from flatep.kernels.packed_tiles import GemmConfig
    from flatep.kernels.quant_gemm import fp8_grouped_mm_triton

    _skip_without_wgmma("wgmma")
    sizes, columns = [1500, 0, 129, 1, 300, 128], 384
    generator = torch.Generator(device="cuda").manual_seed(hidden + (group_rows is None))
    weights = QuantizedTensor.quantize(torch.randn(len(sizes), columns, hidden, device="cuda", generator=generator)
                                       * hidden**-0.5, "fp8")
    end = sum(sizes)
    x = torch.randn(end + 5, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    results = []
    for config in (GemmConfig(**PREFILL_TILES["wgmma"]), GemmConfig(64, 128, num_warps=4, num_stages=4)):
        out = torch.full((end + 5, columns), float("inf"), dtype=torch.bfloat16, device="cuda")
        results.append(fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config, out=out,
                                             group_rows=group_rows))
    got, triton_tiles = results
    reference = quantized_grouped_mm(x, weights, offsets, backend="torch")
    starts = [0, *offsets.tolist()[:-1]]
    for start, size in zip(starts, sizes):
        rows = slice(start, start + size)
        if group_rows is not None and size <= group_rows[0]:
            assert (got[rows] == float("inf")).all()
        elif size:
            assert relative_error(got[rows], reference[rows]) < 4e-3
            assert relative_error(got[rows], triton_tiles[rows]) < 4e-3
    assert (got[end:] == float("inf")).all()


def test_fp8_wgmma_default_and_its_fallback_on_unaligned_rows():
    """On a Hopper GPU the fp8 default takes the Gluon kernel from WGMMA_ROWS rows per group; given
    fp8 rows or an output whose row stride TMA cannot take (not a multiple of 16 bytes), or a K of
    fewer steps than its stages, a wgmma config runs the Triton tile instead, with the same result."""
    from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
    from flatep.kernels.packed_tiles import WGMMA_ROWS, default_config
    from flatep.kernels.quant_gemm import fp8_grouped_mm_triton

    _skip_without_wgmma("wgmma")
    device = torch.device("cuda")
    assert default_config(WGMMA_ROWS * 4, 4, "fp8", device).wgmma
    assert not default_config(WGMMA_ROWS * 4 - 4, 4, "fp8", device).wgmma
    assert not default_config(WGMMA_ROWS * 4, 4, "fp8").wgmma
    sizes, columns, hidden = [300, 0, 129], 256, 1024
    generator = torch.Generator(device="cuda").manual_seed(5)
    weights = QuantizedTensor.quantize(torch.randn(len(sizes), columns, hidden, device="cuda", generator=generator)
                                       * hidden**-0.5, "fp8")
    end = sum(sizes)
    x = torch.randn(end, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    values, scales = quantize_fp8_activations_triton(x, offsets[-1:])
    unaligned = torch.empty(end, hidden + 8, dtype=values.dtype, device="cuda")[:, :hidden]
    unaligned.copy_(values)
    config = default_config(end, len(sizes), "fp8", device)
    aligned_out = fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config, activations=(values, scales))
    unaligned_out = fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config,
                                          activations=(unaligned, scales))
    short_k = QuantizedTensor.quantize(torch.randn(len(sizes), columns, 512, device="cuda", generator=generator)
                                       * 512**-0.5, "fp8")  # 4 K steps: fewer than the config's 5 stages
    short_out = fp8_grouped_mm_triton(x[:, :512], short_k.values, short_k.scales, offsets, config)
    no_slots = fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config, activations=(values, scales),
                                     slots=(weights.values[:0], weights.scales[:0]), slot_base=end)
    assert torch.equal(no_slots, aligned_out)  # an empty slot set: the same launch
    # Whole tiles leave through TMA stores: into a view whose row stride TMA takes (16-byte
    # multiples) the kernel writes only the view's columns; a row stride it cannot take (520
    # bytes) runs the Triton tile.
    wide = torch.full((end, columns + 8), float("inf"), dtype=torch.bfloat16, device="cuda")
    fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config, out=wide[:, :columns],
                          activations=(values, scales))
    assert torch.equal(wide[:, :columns], aligned_out) and (wide[:, columns:] == float("inf")).all()
    odd = torch.full((end, columns + 4), float("nan"), dtype=torch.bfloat16, device="cuda")[:, :columns]
    fp8_grouped_mm_triton(x, weights.values, weights.scales, offsets, config, out=odd, activations=(values, scales))
    reference = quantized_grouped_mm(x, weights, offsets, backend="torch")
    assert relative_error(aligned_out, reference) < 4e-3
    assert relative_error(unaligned_out, reference) < 4e-3
    assert relative_error(odd, reference) < 4e-3
    short_reference = quantized_grouped_mm(x[:, :512].contiguous(), short_k, offsets, backend="torch")
    assert relative_error(short_out, short_reference) < 4e-3
