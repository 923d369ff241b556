"""The mxfp4 decode tiles at other register limits and programs per SM: does occupancy bound them?

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16 and
32 rows per expert. For each row count, the default tile (:func:`flatep.kernels.quant_gemm.default_config`)
and variants launched with ptxas's register limit (``maxnreg``) lowered so that more programs fit an
SM, or with more stages or warps. Each variant is captured in a CUDA graph of 5 calls (both passes
of :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` with pointer copies, as the kernel
copied before it took tensor descriptors on Hopper; the second returns at once, scale bytes 118-128) and replayed interleaved with the others, 6 rounds; the median per call is kept, and
each variant's output is compared bit for bit with the default tile's (``same_bits``).

    python bench/scripts/mxfp4_registers.py --out mx_registers.json      (on a GPU)
"""
from __future__ import annotations

import argparse
import json

import torch

from flatep.bench.timing import device_name
from flatep.kernels import quant_gemm
from flatep.kernels.grouped_tiles import persistent_grid
from flatep.kernels.quant_gemm import GemmConfig

EXPERTS, HIDDEN, INTERMEDIATE = 112, 3584, 3072
ROUNDS, CALLS = 6, 5
# (tiles, register limit or None); the first of each is the default tile. Local sm_90 compiles
# (Triton 3.6): the 16-row tile takes 168 registers (144 without spilling, 128 with 16 bytes of
# stack); the 32-row tile 234 (168: 104 bytes of stack, 160: 144 bytes); the 32 x 256 tile on
# 8 warps 180 (one program an SM), 128 with 32 bytes of stack.
VARIANTS = {
    16: [(GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True), None),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=7, lane_words=True), 144),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=8, lane_words=True), 128),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=6, programs_per_sm=7, lane_words=True), 144),
         (GemmConfig(16, 128, 64, num_warps=2, num_stages=3, programs_per_sm=8, lane_words=True), 128)],
    32: [(GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=2), None),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=3), 168),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=3, programs_per_sm=3), 160),
         (GemmConfig(32, 256, 64, num_warps=4, num_stages=4, programs_per_sm=2), None),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=3, programs_per_sm=1), None),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=3, programs_per_sm=2), 128),
         (GemmConfig(32, 256, 64, num_warps=8, num_stages=4, programs_per_sm=2), 128),
         (GemmConfig(32, 128, 64, num_warps=4, num_stages=3, programs_per_sm=4), 128)],
}


def launch(rows, values, scales, offsets, config: GemmConfig, out, max_registers: int | None, redo) -> None:
    """Both passes of the mxfp4 GEMM, as :func:`quant_gemm.mxfp4_grouped_mm_triton` launches them
    with pointer copies (no borrow slots), with ptxas's register limit ``max_registers``."""
    grid = persistent_grid(rows.shape[0], EXPERTS, values.shape[1], config, rows.device)
    limit = {"maxnreg": max_registers} if max_registers else {}
    for one_multiply in (True, False):
        quant_gemm._mxfp4_grouped_kernel[grid](
            rows, values.view(torch.int32), scales, values.view(torch.int32), scales, out, offsets, redo,
            EXPERTS, EXPERTS, 0, values.shape[1], rows.stride(0), out.stride(0), *scales.stride(), 0, 2**31 - 1,
            rows.shape[1], BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
            GROUP_M=config.group_m, GROUPS=128, SWAP_AB=False, NATURAL_K=False, LANE_WORDS=config.lane_words,
            ONE_MULTIPLY=one_multiply, TMA=False, INTERPRET=False, num_warps=config.num_warps, num_stages=config.num_stages,
            **limit)


def time_variants(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    values = torch.randint(0, 256, (EXPERTS, columns, inner // 2), dtype=torch.uint8, device="cuda")
    scales = torch.randint(118, 129, (EXPERTS, inner // 32, columns), dtype=torch.uint8, device="cuda").transpose(1, 2)
    rows = torch.randn(EXPERTS * rows_per_expert, inner, device="cuda").to(torch.bfloat16)
    offsets = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * rows_per_expert
    redo = torch.zeros(1, dtype=torch.int32, device="cuda")
    reference, arms = None, []
    for config, max_registers in VARIANTS[rows_per_expert]:
        out = torch.full((rows.shape[0], columns), float("nan"), device="cuda", dtype=torch.bfloat16)
        launch(rows, values, scales, offsets, config, out, max_registers, redo)
        torch.cuda.synchronize()
        reference = out.clone() if reference is None else reference
        same_bits = bool(torch.equal(out, reference))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                launch(rows, values, scales, offsets, config, out, max_registers, redo)
        arms.append((config, max_registers, graph, out, same_bits))
    times = [[] for _ in arms]
    for _ in range(ROUNDS):
        for arm, (_, _, graph, _, _) in enumerate(arms):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[arm].append(start.elapsed_time(end) * 1000 / CALLS)
    return [{"rows_per_expert": rows_per_expert, "gemm": gemm, "tiles": config.label, "max_registers": max_registers,
             "us": round(sorted(arm_times)[len(arm_times) // 2], 1), "same_bits": same_bits}
            for (config, max_registers, _, _, same_bits), arm_times in zip(arms, times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for rows_per_expert in VARIANTS:
        for gemm, (columns, inner) in {"w13": (2 * INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}.items():
            for row in time_variants(rows_per_expert, gemm, columns, inner):
                print(json.dumps(row), flush=True)
                results.append(row)
    with open(args.out, "w") as file:
        json.dump({"device": device_name(torch.device("cuda")), "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
