"""Checks shared by the Gluon mxfp4 kernels' GPU tests (tests/kernels/test_mxfp4_wgmma.py and
test_mxfp4_swap.py)."""
from __future__ import annotations

import torch
import triton

from flatep.kernels.packed_tiles import GemmConfig
from flatep.quant import QuantizedTensor, pool_layout
from tests.helpers import relative_error


def compile_for_sm90(kernel, inner: int, block_m: int, block_n: int, constants: dict, num_warps: int, maxnreg: int):
    """``kernel`` (:mod:`flatep.kernels.mxfp4_wgmma`'s or :mod:`flatep.kernels.mxfp4_swap`'s) compiled
    for sm_90 with no GPU (``triton.compile``'s result): ``K = inner``, row tiles of ``block_m``,
    column tiles of ``block_n``, 8 tiles a group of programs, at most 128 groups; ``constants`` the
    kernel's other constexprs."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from flatep.kernels.mxfp4_wgmma import descriptors

    rows = torch.empty(256, inner, dtype=torch.bfloat16)
    values = torch.empty(2, 512, inner // 2, dtype=torch.uint8)
    scales = torch.empty(2, inner // 32, 512, dtype=torch.uint8).transpose(1, 2)
    operands = descriptors(rows, values, scales, values, scales, block_m, block_n)
    types = dict(zip(("a_desc", "w_desc", "s_desc", "slot_w_desc", "slot_s_desc"), map(mangle_type, operands)))
    types |= {"out_ptr": "*bf16", "offsets_ptr": "*i32", "redo_ptr": "*i32"}
    constants = {**constants, "K": inner, "GROUP_M": 8, "GROUPS": 128, "num_warps": num_warps}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "maxnreg": maxnreg})


def random_experts(count: int, columns: int, hidden: int, generator: torch.Generator) -> QuantizedTensor:
    """``count`` experts of ``[columns, hidden]`` random weights, mxfp4 in the pools' layout, on the GPU."""
    weights = torch.randn(count, columns, hidden, device="cuda", generator=generator) * hidden**-0.5
    return QuantizedTensor.quantize(weights, "mxfp4").in_layout(pool_layout("mxfp4"))


def check_against_a_tile_with_slots_in_a_graph(kernel: GemmConfig, triton_tile: GemmConfig, home_sizes: list[int],
                                               slot_sizes: list[int], hidden: int, columns: int,
                                               group_rows: tuple[int, int] | None, large_scale: bool,
                                               seed: int) -> None:
    """``kernel`` against the torch path and ``triton_tile`` over home groups of ``home_sizes`` rows
    and slot groups of ``slot_sizes``, 11 rows apart, each captured in a CUDA graph with host syncs
    raising; with a scale byte past 128 in home group 4 (the second pass) if ``large_scale``. Rows
    of no computed group (outside ``group_rows``, or between the groups, where the rows hold NaN that
    a tile would copy in) must stay as they were."""
    from flatep.experts.grouped import quantized_grouped_mm
    from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

    gap = 11
    generator = torch.Generator(device="cuda").manual_seed(seed)
    home = random_experts(len(home_sizes), columns, hidden, generator)
    slots = random_experts(len(slot_sizes), columns, hidden, generator)
    if large_scale:
        home.scales[4, 7, 3] = 200  # a block of group 4's column 7: 2**73 times its values
    slot_base = sum(home_sizes) + gap
    rows = slot_base + sum(slot_sizes) + 3
    x = torch.randn(rows, hidden, device="cuda", generator=generator).bfloat16()
    x[sum(home_sizes):slot_base] = float("nan")
    ends = torch.tensor(home_sizes).cumsum(0).tolist() + (slot_base + torch.tensor(slot_sizes).cumsum(0)).tolist()
    offsets = torch.tensor(ends, dtype=torch.int32, device="cuda")
    outputs = []
    for tiles in (kernel, triton_tile):
        out = torch.full((rows, columns), float("inf"), dtype=torch.bfloat16, device="cuda")
        mxfp4_grouped_mm_triton(x, home.values, home.scales, offsets, tiles, out=out, group_rows=group_rows,
                                slots=(slots.values, slots.scales), slot_base=slot_base)  # compiles
        out.fill_(float("inf"))
        graph = torch.cuda.CUDAGraph()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.cuda.graph(graph):
                mxfp4_grouped_mm_triton(x, home.values, home.scales, offsets, tiles, out=out, group_rows=group_rows,
                                        slots=(slots.values, slots.scales), slot_base=slot_base)
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        outputs.append(out)
    got, tile_out = outputs
    home_end = sum(home_sizes)
    reference = torch.cat([quantized_grouped_mm(x[:home_end], home, offsets[:len(home_sizes)], backend="torch"),
                           torch.zeros(gap, columns, device="cuda", dtype=torch.bfloat16),
                           quantized_grouped_mm(x[slot_base:], slots, offsets[len(home_sizes):] - slot_base,
                                                backend="torch")])
    starts = [0, *ends[:-1]]
    starts[len(home_sizes)] = slot_base
    for start, end in zip(starts, ends):
        group = slice(start, end)
        if group_rows is not None and not group_rows[0] < end - start <= group_rows[1]:
            assert (got[group] == float("inf")).all()
        elif end > start:
            assert relative_error(got[group], reference[group]) < 4e-3
            assert relative_error(got[group], tile_out[group]) < 4e-3
    assert (got[home_end:slot_base] == float("inf")).all() and (got[ends[-1]:] == float("inf")).all()
