"""Result set: packed expert GEMMs at decode sizes against the bf16 decode kernels the layer uses there.

    python3 bench/scripts/quant_decode.py --out quant_decode.json      (from the repository root, on a GPU)

One rank's experts at EP8 (CUDA-graph timing, median of 20 replays): Kimi-K3 in mxfp4 (112 experts,
H = 3584, I = 3072) at 16, 32, 64 and 128 rows per expert and Kimi-K2 in fp8 (48 experts, H = 7168,
I = 2048) at 16, 21 (Kimi-K2 at s = 128) and 32 rows per expert. Per cell: the bf16 arm (the decode
kernels, gate/up fused with SwiGLU, then down; ``torch._grouped_mm`` at 128 rows, past the decode
kernels' range) over the same dequantized weights, the packed arm (gate/up then down GEMM, fp8
including its activation quantization), their ratio, and the packed arm's weight bytes (values and
scales) over its time, beside the HBM read ceiling measured in the same run
(:func:`flatep.bench.timing.read_ceiling_gbps`). Prints one line per cell and writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import json

import torch

from flatep.bench.timing import read_ceiling_gbps, time_us
from flatep.kernels.decode_gemm import DECODE_ROWS_PER_GROUP, gate_up_swiglu_triton, grouped_mm_triton
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.quant.tensor import QuantizedTensor, pool_layout

CASES = (
    ("kimi-k3", "mxfp4", 112, 3584, 3072, (16, 32, 64, 128)),
    ("kimi-k2", "fp8", 48, 7168, 2048, (16, 21, 32)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="quant_decode.json", help="JSON file to write")
    args = parser.parse_args()
    device = torch.device("cuda")

    def graph_us(fn) -> float:
        return time_us(fn, device, iters=20, graph=True)

    ceiling = read_ceiling_gbps(device)
    print(f"HBM read ceiling: {ceiling:.0f} GB/s")
    rows_out = []
    for model, fmt, groups, hidden, intermediate, per_expert in CASES:
        torch.manual_seed(0)
        w13 = (torch.randn(groups, 2 * intermediate, hidden, device=device) / hidden**0.5).to(torch.bfloat16)
        w2 = (torch.randn(groups, hidden, intermediate, device=device) / intermediate**0.5).to(torch.bfloat16)
        packed13, packed2 = (QuantizedTensor.quantize(w, fmt).in_layout(pool_layout(fmt)) for w in (w13, w2))
        # The bf16 arm computes with the very values the packed arm stores.
        w13, w2 = packed13.dequantize(torch.bfloat16), packed2.dequantize(torch.bfloat16)
        packed_bytes = sum(t.values.nbytes + t.scales.nbytes for t in (packed13, packed2))
        kernel = mxfp4_grouped_mm_triton if fmt == "mxfp4" else fp8_grouped_mm_triton
        for rows_per_expert in per_expert:
            rows = groups * rows_per_expert
            offsets = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows_per_expert
            x = torch.randn(rows, hidden, device=device).to(torch.bfloat16)
            activated = (torch.randn(rows, intermediate, device=device) / 4).to(torch.bfloat16)
            route = torch.rand(rows, device=device)
            if rows_per_expert <= DECODE_ROWS_PER_GROUP:
                baseline = "bf16 decode kernels"
                bf16_us = graph_us(lambda: gate_up_swiglu_triton(x, w13, route, offsets)) + \
                    graph_us(lambda: grouped_mm_triton(activated, w2, offsets))
            else:
                baseline = "bf16 torch._grouped_mm"
                bf16_us = graph_us(lambda: torch._grouped_mm(x, w13.mT, offs=offsets)) + \
                    graph_us(lambda: torch._grouped_mm(activated, w2.mT, offs=offsets))
            packed_us = graph_us(lambda: kernel(x, packed13.values, packed13.scales, offsets)) + \
                graph_us(lambda: kernel(activated, packed2.values, packed2.scales, offsets))
            row = {"model": model, "format": fmt, "rows_per_expert": rows_per_expert, "baseline": baseline,
                   "bf16_us": bf16_us, "packed_us": packed_us, "ratio": packed_us / bf16_us,
                   "packed_bytes": packed_bytes, "packed_read_gbps": packed_bytes / packed_us / 1e3,
                   "read_ceiling_gbps": ceiling}
            print(f"{model} {fmt} {rows_per_expert:4d} rows/expert: {packed_us:7.0f} us = {row['ratio']:.2f}x {baseline} "
                  f"({bf16_us:.0f} us); packed weights read at {row['packed_read_gbps']:.0f} GB/s of {ceiling:.0f}", flush=True)
            rows_out.append(row)
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows_out}, handle, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
