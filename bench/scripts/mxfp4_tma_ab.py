"""The mxfp4 GEMMs' copies by tensor descriptor (TMA) against pointer copies, tile by tile.

One Kimi-K3 rank's experts (112; gate/up N = 6144, K = 3584; down N = 3584, K = 3072) at 16, 32,
128 and 256 rows per expert, with the tiles the layer takes there (:func:`default_config`) and a
few neighbours. Each tile runs both ways through :func:`mxfp4_grouped_mm_triton`: as it stands (on
Hopper, descriptors), and with ``_mxfp4_descriptors`` replaced by one that returns None (pointer
copies, as before descriptors). Each arm is captured in a CUDA graph of 5 calls and replayed
interleaved with the others, 8 rounds; the median per call is kept, and each arm's output is
compared bit for bit with the first arm's (``same_bits``).

    python bench/scripts/mxfp4_tma_ab.py --out mxfp4_tma_ab.json      (on a Hopper GPU)
"""
from __future__ import annotations

import argparse
import json

import torch

from flatep.bench.timing import device_name
from flatep.kernels import quant_gemm
from flatep.kernels.quant_gemm import GemmConfig, mxfp4_grouped_mm_triton

EXPERTS, HIDDEN, INTERMEDIATE = 112, 3584, 3072
ROUNDS, CALLS = 8, 5
TILES = {
    16: [GemmConfig(16, 128, 64, num_warps=2, num_stages=4, programs_per_sm=6, lane_words=True)],
    32: [GemmConfig(32, 256, 64, num_warps=4, num_stages=3), GemmConfig(32, 256, 64, num_warps=4, num_stages=3,
                                                                       lane_words=True)],
    128: [GemmConfig(64, 256, 64, num_warps=4, num_stages=3)],
    256: [GemmConfig(64, 256, 64, num_warps=4, num_stages=3), GemmConfig(64, 256, 64, num_warps=4, num_stages=4)],
}


def time_arms(rows_per_expert: int, gemm: str, columns: int, inner: int) -> list[dict]:
    values = torch.randint(0, 256, (EXPERTS, columns, inner // 2), dtype=torch.uint8, device="cuda")
    # Column-fastest scales (as pools hold them), bytes 118-128: the second pass returns at once.
    scales = torch.randint(118, 129, (EXPERTS, inner // 32, columns), dtype=torch.uint8, device="cuda").transpose(1, 2)
    rows = torch.randn(EXPERTS * rows_per_expert, inner, device="cuda").to(torch.bfloat16)
    offsets = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * rows_per_expert
    descriptors = quant_gemm._mxfp4_descriptors
    reference, arms = None, []
    try:
        for config in TILES[rows_per_expert]:
            for copies in ("pointers", "tma"):
                quant_gemm._mxfp4_descriptors = descriptors if copies == "tma" else (lambda *operands: None)
                out = torch.full((rows.shape[0], columns), float("nan"), device="cuda", dtype=torch.bfloat16)
                mxfp4_grouped_mm_triton(rows, values, scales, offsets, config, out)
                torch.cuda.synchronize()
                reference = out.clone() if reference is None else reference
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):  # the copies' kind is fixed when the graph is captured
                    for _ in range(CALLS):
                        mxfp4_grouped_mm_triton(rows, values, scales, offsets, config, out)
                arms.append((copies, config, graph, out, bool(torch.equal(out, reference))))
    finally:
        quant_gemm._mxfp4_descriptors = descriptors
    times = [[] for _ in arms]
    for _ in range(ROUNDS):
        for arm, (_, _, graph, _, _) in enumerate(arms):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[arm].append(start.elapsed_time(end) * 1000 / CALLS)
    return [{"rows_per_expert": rows_per_expert, "gemm": gemm, "copies": copies, "tiles": config.label,
             "us": round(sorted(arm_times)[len(arm_times) // 2], 1), "same_bits": same_bits}
            for (copies, config, _, _, same_bits), arm_times in zip(arms, times)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = []
    for rows_per_expert in TILES:
        for gemm, (columns, inner) in {"w13": (2 * INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}.items():
            for row in time_arms(rows_per_expert, gemm, columns, inner):
                print(json.dumps(row), flush=True)
                results.append(row)
    with open(args.out, "w") as file:
        json.dump({"device": device_name(torch.device("cuda")), "results": results}, file, indent=1)


if __name__ == "__main__":
    main()
