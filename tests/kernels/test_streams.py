"""side_by_side: a GEMM's launches forked onto streams of their own and joined back (CUDA), one
after another elsewhere."""
from __future__ import annotations

import pytest
import torch

from flatep.experts.grouped import quantized_grouped_mm
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.packed_tiles import packed_launches
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.kernels.streams import side_by_side
from flatep.quant import QuantizedTensor
from flatep.quant.tensor import pool_layout

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA streams")


def test_off_cuda_the_launches_run_once_each_in_order():
    ran = []
    side_by_side([lambda index=index: ran.append(index) for index in range(3)], torch.device("cpu"))
    assert ran == [0, 1, 2]


def _slow_copies(sources, targets, streams):
    """One launch per target: record the stream it runs on, spin the GPU for ~20 ms, then copy."""
    def launch(source, target):
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(40_000_000)  # a late writer: a missing join lets the reader see the old values
        target.copy_(source)
    return [lambda source=source, target=target: launch(source, target) for source, target in zip(sources, targets)]


@needs_cuda
@pytest.mark.parametrize("graphed", [False, True])
def test_every_launch_gets_a_stream_and_the_current_stream_waits_for_all(graphed):
    device = torch.device("cuda")
    sources = [torch.empty(1 << 16, device=device) for _ in range(3)]
    targets = [torch.full_like(source, float("nan")) for source in sources]
    streams = []
    launches = _slow_copies(sources, targets, streams)
    graph = torch.cuda.CUDAGraph() if graphed else None
    if graphed:
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            side_by_side(launches, device)
            total = torch.stack([target.sum() for target in targets])
    for _ in range(2):  # fresh values each time: a replay must copy them again
        for source in sources:
            source.normal_()
        for target in targets:
            target.fill_(float("nan"))
        if graphed:
            graph.replay()
        else:
            side_by_side(launches, device)
            total = torch.stack([target.sum() for target in targets])
        expected = torch.stack([source.sum() for source in sources])
        torch.testing.assert_close(total, expected)
    assert len({stream.stream_id for stream in streams[:3]}) == 3


@needs_cuda
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_a_skewed_steps_launches_side_by_side_equal_them_one_after_another(format):
    """Groups of 1-16, 17-32 and more rows (mxfp4: three launches; fp8: two) at a short average:
    the side-by-side launches, captured in a graph, give the bits of the same launches run in turn."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    sizes = [3, 0, 150, 20, 16, 70, 1, 31]
    groups, hidden, columns = len(sizes), 512, 384
    weights = QuantizedTensor.quantize(
        torch.randn(groups, columns, hidden, device="cuda", generator=generator) * hidden**-0.5, format,
    ).in_layout(pool_layout(format))  # the pools' layout, which the kernels read
    rows = sum(sizes) + 5
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    per_group = 12  # a decode step's average: the short tiles, with the hot groups split off
    launches = packed_launches(per_group * groups, groups, format, x.device)
    assert len(launches) > 1
    gemm = fp8_grouped_mm_triton if format == "fp8" else mxfp4_grouped_mm_triton
    kwargs = {"activations": quantize_fp8_activations_triton(x, offsets[-1:])} if format == "fp8" else {}
    in_turn = torch.full((rows, columns), float("nan"), device="cuda", dtype=torch.bfloat16)
    for config, group_rows in launches:
        gemm(x, weights.values, weights.scales, offsets, config=config, out=in_turn, group_rows=group_rows, **kwargs)
    out = torch.full_like(in_turn, float("nan"))
    quantized_grouped_mm(x, weights, offsets, "triton", per_group, out=out)  # compiled outside the capture
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quantized_grouped_mm(x, weights, offsets, "triton", per_group, out=out)
    graph.replay()
    end = sum(sizes)
    assert torch.equal(out[:end], in_turn[:end])
    assert not out[:end].isnan().any()
