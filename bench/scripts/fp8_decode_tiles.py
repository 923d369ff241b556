"""Result set: one Kimi-K2 rank's fp8 experts at decode sizes, fused gate/up against two launches, over tile candidates.

    python3 bench/scripts/fp8_decode_tiles.py --out fp8_decode_tiles.json      (from the repository root, on a GPU)

One rank's experts at EP8 (48 experts, H = 7168, I = 2048; every expert holding the same rows) at
16, 21 (Kimi-K2 at s = 128) and 32 rows per expert, CUDA-graph timing (median of 20 replays):

- ``bf16``: the bf16 decode kernels (gate/up fused with SwiGLU, then down) over the dequantized
  fp8 weights: the baseline;
- ``two launches``: the fp8 path before the fused epilogue: activation quantization, the fp8
  gate/up GEMM into bf16, the SwiGLU pass quantizing for the down projection, the fp8 down GEMM
  (each in :func:`flatep.kernels.quant_gemm.packed_launches`' launches);
- ``fused``: :func:`flatep.experts.grouped_swiglu` on the fp8 weights as the library runs it
  (activation quantization, :func:`flatep.kernels.quant_gemm.fp8_gate_up_swiglu_triton`, down GEMM);
- the fused gate/up launch alone and the down GEMM alone over tile candidates (pipeline depth,
  programs per SM, 64- or 128-column tiles, swapped 32-row tiles), beside the launch the library
  picks, to choose :func:`flatep.kernels.quant_gemm.gated_config` and the fp8 decode tiles.

Each time is printed beside the HBM read ceiling measured in the same run
(:func:`flatep.bench.timing.read_ceiling_gbps`) as the packed weights' bytes (values and scales)
over the time. A candidate that does not compile (shared memory) is recorded as such.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from flatep.bench.timing import read_ceiling_gbps, time_us
from flatep.experts.grouped import grouped_swiglu
from flatep.kernels.activation import swiglu_weighted_triton
from flatep.kernels.decode_gemm import gate_up_swiglu_triton, grouped_mm_triton
from flatep.kernels.quant_gemm import (
    GemmConfig,
    default_config,
    fp8_gate_up_swiglu_triton,
    fp8_grouped_mm_triton,
    gated_config,
    packed_launches,
    quantize_fp8_activations_triton,
)
from flatep.quant.tensor import QuantizedTensor

GROUPS, HIDDEN, INTERMEDIATE = 48, 7168, 2048
ROWS_PER_EXPERT = (16, 21, 32)
DEPTHS = ((2, 2), (3, 2), (4, 1), (5, 1), (6, 1), (3, 3), (2, 3))  # (stages, programs per SM) of the fused launch
DOWN_DEPTHS = ((4, 2), (5, 2), (6, 2), (3, 3), (4, 3), (3, 4), (6, 1), (8, 1))


def bases(rows_per_expert: int) -> list[GemmConfig]:
    """The library's tiles at this size and the alternatives worth timing around them."""
    plain = default_config(rows_per_expert * GROUPS, GROUPS, "fp8")
    found = [plain]
    if rows_per_expert > 16:
        found.append(GemmConfig(32, 128, 128, num_warps=4, num_stages=5, swap_ab=True))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="fp8_decode_tiles.json", help="JSON file to write")
    args = parser.parse_args()
    device = torch.device("cuda")
    ceiling = read_ceiling_gbps(device)
    print(f"HBM read ceiling: {ceiling:.0f} GB/s")
    torch.manual_seed(0)
    w13 = QuantizedTensor.quantize((torch.randn(GROUPS, 2 * INTERMEDIATE, HIDDEN, device=device) / HIDDEN**0.5), "fp8")
    w2 = QuantizedTensor.quantize((torch.randn(GROUPS, HIDDEN, INTERMEDIATE, device=device) / INTERMEDIATE**0.5), "fp8")
    bf13, bf2 = w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16)
    bytes13 = w13.values.nbytes + w13.scales.nbytes
    bytes2 = w2.values.nbytes + w2.scales.nbytes
    results = []

    def record(cell: dict, name: str, fn, weight_bytes: int) -> float | None:
        try:
            fn()
            torch.cuda.synchronize()
            us = time_us(fn, device, iters=20, graph=True)
        except Exception as error:  # a candidate whose tiles do not fit (shared memory, registers)
            torch.cuda.synchronize()
            results.append({**cell, "arm": name, "error": f"{type(error).__name__}: {str(error)[:200]}"})
            print(f"  {name}: did not run ({type(error).__name__})", flush=True)
            return None
        gbps = weight_bytes / us / 1e3
        results.append({**cell, "arm": name, "us": us, "packed_read_gbps": gbps, "read_ceiling_gbps": ceiling})
        print(f"  {name}: {us:7.1f} us, weights read at {gbps:.0f} GB/s of {ceiling:.0f}", flush=True)
        return us

    for rows_per_expert in ROWS_PER_EXPERT:
        cell = {"rows_per_expert": rows_per_expert, "groups": GROUPS, "hidden": HIDDEN, "intermediate": INTERMEDIATE}
        print(f"{rows_per_expert} rows per expert", flush=True)
        rows = GROUPS * rows_per_expert
        offsets = torch.arange(1, GROUPS + 1, device=device, dtype=torch.int32) * rows_per_expert
        x = torch.randn(rows, HIDDEN, device=device).to(torch.bfloat16)
        route = torch.rand(rows, device=device)
        bf_activated = torch.empty(rows, INTERMEDIATE, dtype=torch.bfloat16, device=device)
        values = torch.empty(rows, INTERMEDIATE, dtype=torch.float8_e4m3fn, device=device)
        scales = torch.empty(rows, INTERMEDIATE // 128, device=device)
        gate_up = torch.empty(rows, 2 * INTERMEDIATE, dtype=torch.bfloat16, device=device)
        launches = packed_launches(rows, GROUPS, "fp8")

        def bf16_step():
            gate_up_swiglu_triton(x, bf13, route, offsets, out=bf_activated)
            grouped_mm_triton(bf_activated, bf2, offsets)

        def two_launches():
            given = quantize_fp8_activations_triton(x, offsets[-1:])
            for config, group_rows in launches:
                fp8_grouped_mm_triton(x, w13.values, w13.scales, offsets, config, out=gate_up, activations=given,
                                      group_rows=group_rows)
            swiglu_weighted_triton(gate_up, route, offsets[-1:], values, scales=scales)
            down(None)

        def down(config):
            for tiles, group_rows in launches:
                fp8_grouped_mm_triton(bf_activated, w2.values, w2.scales, offsets, config or tiles,
                                      activations=(values, scales), group_rows=group_rows)

        bf16_us = record(cell, "bf16 decode kernels", bf16_step, bf13.nbytes + bf2.nbytes)
        two_us = record(cell, "fp8 two launches", two_launches, bytes13 + bytes2)
        fused_us = record(cell, "fp8 fused (grouped_swiglu)",
                          lambda: grouped_swiglu(x, route, w13, w2, offsets, rows_per_group=rows_per_expert),
                          bytes13 + bytes2)
        if bf16_us and two_us and fused_us:
            print(f"  ratio to bf16: two launches {two_us / bf16_us:.3f}, fused {fused_us / bf16_us:.3f}", flush=True)
        given = quantize_fp8_activations_triton(x, offsets[-1:])
        for base in bases(rows_per_expert):
            chosen = gated_config(base)
            for stages, programs in ((chosen.num_stages, chosen.programs_per_sm),) + DEPTHS:
                config = dataclasses.replace(base, num_stages=stages, programs_per_sm=programs)
                record({**cell, "config": dataclasses.asdict(config)}, f"gate/up fused {_name(config)}",
                       lambda c=config: fp8_gate_up_swiglu_triton(x, w13.values, w13.scales, route, offsets, values,
                                                                  scales, c, activations=given), bytes13)
            for block_n in (128, 64):
                for stages, programs in ((base.num_stages, base.programs_per_sm),) + DOWN_DEPTHS:
                    config = dataclasses.replace(base, block_n=block_n, num_stages=stages, programs_per_sm=programs)
                    record({**cell, "config": dataclasses.asdict(config)}, f"down {_name(config)}",
                           lambda c=config: down(c), bytes2)
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": results}, handle,
                  indent=1)
    print(f"wrote {args.out}")


def _name(config: GemmConfig) -> str:
    swap = " swap" if config.swap_ab else ""
    return (f"{config.block_m}x{config.block_n}x{config.block_k}{swap} {config.num_warps}w {config.num_stages}s "
            f"{config.programs_per_sm}/SM")


if __name__ == "__main__":
    main()
