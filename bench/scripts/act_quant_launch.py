"""Result set: launches of the fp8 activation quantization
(flatep.kernels.fp8_activations.quantize_fp8_activations_triton)
on one GPU, K = 7168 (Kimi-K2's hidden size), at 1024, 8192 and 65536 rows (a Kimi-K2 rank's decode
and prefill shards): per (rows per block, programs per SM, warps), the CUDA-graph time of one call
(flatep.bench.timing.time_us: 5 calls per graph, median of 10 replays) and whether its values and scales equal the first
launch's bit for bit. Bytes moved per call: rows x K x 3 (bf16 read, e4m3 written; the scales are
1/128 of that), shown as GB/s beside the device's copy ceiling measured in the same run
(flatep.bench.timing.copy_ceiling_gbps).
    python3 bench/scripts/act_quant_launch.py        (from the repository root, on a GPU)
"""
import torch

import flatep.kernels.fp8_activations as fp8_activations
from flatep.bench.timing import copy_ceiling_gbps, time_us

LAUNCHES = [(16, 8, 4), (16, 32, 4), (32, 16, 4), (32, 32, 4), (64, 8, 4), (64, 16, 8), (16, 64, 2), (8, 64, 2)]
device = torch.device("cuda")
ceiling = copy_ceiling_gbps(device)
print(f"copy ceiling {ceiling:.0f} GB/s", flush=True)


for rows in (1024, 8192, 65536):
    x = torch.randn(rows, 7168, device=device).to(torch.bfloat16)
    end = torch.tensor([rows], dtype=torch.int32, device=device)
    first = None
    line = []
    for block_m, per_sm, warps in LAUNCHES:
        fp8_activations.ACT_QUANT_ROWS = block_m
        fp8_activations.ACT_QUANT_PROGRAMS_PER_SM = per_sm
        fp8_activations.ACT_QUANT_WARPS = warps
        values, scales = fp8_activations.quantize_fp8_activations_triton(x, end)
        if first is None:
            first = (values.view(torch.uint8).clone(), scales.clone())
        same = torch.equal(values.view(torch.uint8), first[0]) and torch.equal(scales, first[1])
        us = time_us(lambda: fp8_activations.quantize_fp8_activations_triton(x, end), device, warmup=1, iters=10,
                     graph=True, calls=5)
        gbps = rows * 7168 * 3 / us / 1e3
        line.append(f"m{block_m} p{per_sm} w{warps}: {us:.1f} us ({gbps:.0f} GB/s){'' if same else ' MISMATCH'}")
    print(f"act quant rows={rows} ({rows * 7168 * 3 / 1e6:.0f} MB moved): " + "; ".join(line), flush=True)
