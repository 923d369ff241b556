"""Result set: the fp8 activation quantization (flatep.kernels.fp8_activations.quantize_fp8_activations_triton)
on rows of different data, K = 7168 (Kimi-K2's hidden size): the CUDA-graph time of one call
(flatep.bench.timing.time_interleaved: 5 calls per graph, median of 10 replays, the arms' replays
interleaved, so that the first arm timed does not run on a colder GPU) of the tree's kernel (for
bf16 rows, the product with each row's reciprocal and one fma correction, which rounds as the
division does for every bf16 value), beside the same loop dividing every value with div_rn (the
correctly rounded division, the kernel's arithmetic before) and with the approximate division (not
exact: a reference point). Rows: torch.randn; randn times 1e-19 (the size that rows fed back
through an experts step in place shrink to); randn with 10% zeros; zeros; randn with 3% NaN rows
(a reused buffer's stale rows). Bytes moved per call: rows x K x 3 (bf16 read, e4m3 written),
as ``gbps`` beside the device's read ceiling measured in the same run
(flatep.bench.timing.read_ceiling_gbps).
Each data's values and scales from the tree's kernel are compared with
flatep.quant.quantize_fp8_activations (``same``; NaN rows left out).
    python3 bench/scripts/act_quant_data.py --out act_quant_data.json        (from the repository root, on a GPU)
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from flatep.bench.timing import device_name, read_ceiling_gbps, time_interleaved
from flatep.kernels.backend import row_programs, row_runs, run_block, run_block_count
from flatep.kernels.fp8_activations import (
    ACT_QUANT_PROGRAMS_PER_SM,
    ACT_QUANT_ROWS,
    ACT_QUANT_WARPS,
    _E4M3_MAX,
    _E4M3_RECIPROCAL,
    quantize_fp8_activations_triton,
)
from flatep.quant import quantize_fp8_activations

HIDDEN = 7168


@triton.jit
def _quantize_dividing_all(x_ptr, q_ptr, s_ptr, end_ptr, rows, stride, K, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                           CORRECTLY_ROUNDED: tl.constexpr):
    """The kernel's loop (no skipped rows), every value divided: by div_rn, or approximately."""
    first_end, second_start, end = row_runs(end_ptr, rows, None, 0)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    block = tl.program_id(0)
    while block < blocks:
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (row < stop)[:, None] & (column < K)[None, :]
        x = tl.load(x_ptr + row[:, None] * stride + column[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * _E4M3_RECIPROCAL
        if CORRECTLY_ROUNDED:
            q = tl.math.div_rn(x, scale[:, None])
        else:
            q = x / scale[:, None]
        q = tl.minimum(tl.maximum(q, -_E4M3_MAX), _E4M3_MAX)
        tl.store(q_ptr + row[:, None] * stride + column[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * (K // GROUP) + tl.program_id(1), scale, mask=row < stop)
        block += tl.num_programs(0)


def quantize_dividing_all(rows: torch.Tensor, end: torch.Tensor, correctly_rounded: bool) -> None:
    count, columns = rows.shape
    values = torch.empty(count, columns, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(count, columns // 128, dtype=torch.float32, device=rows.device)
    groups = columns // 128
    grid = (row_programs(count, ACT_QUANT_ROWS, groups, rows.device, per_sm=ACT_QUANT_PROGRAMS_PER_SM), groups)
    _quantize_dividing_all[grid](rows, values, scales, end, count, columns, columns, BLOCK_M=ACT_QUANT_ROWS, GROUP=128,
                                 CORRECTLY_ROUNDED=correctly_rounded, num_warps=ACT_QUANT_WARPS)


def data(rows: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The row sets, each ``[rows, HIDDEN]`` bf16."""
    generator = torch.Generator(device=device).manual_seed(0)
    normal = torch.randn(rows, HIDDEN, generator=generator, device=device)
    nan_rows = normal.clone()
    nan_rows[torch.randperm(rows, generator=generator, device=device)[: max(1, rows * 3 // 100)]] = float("nan")
    zeros = torch.rand(rows, HIDDEN, generator=generator, device=device) < 0.1
    sets = {"randn": normal, "randn x 1e-19": normal * 1e-19, "randn, 10% zeros": normal.masked_fill(zeros, 0.0),
            "zeros": torch.zeros_like(normal), "randn, 3% NaN rows": nan_rows}
    return {name: values.to(torch.bfloat16) for name, values in sets.items()}


def same_as_torch(rows: torch.Tensor, end: torch.Tensor) -> bool:
    """Whether the tree's kernel gives torch's values and scales on the rows without NaN: bit for bit
    on a GPU (zeros' signs included), by value under the interpreter (whose e4m3 rounding drops the
    sign of a zero)."""
    finite = ~rows.isnan().any(dim=1)
    values, scales = quantize_fp8_activations_triton(rows, end)
    expected_values, expected_scales = quantize_fp8_activations(rows[finite])
    view = (lambda q: q.view(torch.uint8)) if rows.is_cuda else (lambda q: q.float())  # noqa: E731
    return torch.equal(scales[finite], expected_scales) and torch.equal(view(values[finite]), view(expected_values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[8192, 65536], help="row counts (default 8192 65536)")
    parser.add_argument("--out", required=True, help="JSON file to write")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    timing = dict(warmup=1, iters=10, graph=True, calls=5) if device.type == "cuda" else dict(warmup=0, iters=1)
    arms = {"kernel": quantize_fp8_activations_triton,
            "div_rn for every value": lambda rows, end: quantize_dividing_all(rows, end, True),
            "approximate division": lambda rows, end: quantize_dividing_all(rows, end, False)}
    ceiling = read_ceiling_gbps(device) if device.type == "cuda" else None
    if ceiling is not None:
        print(f"read ceiling {ceiling:.0f} GB/s (this run)", flush=True)
    results = []
    for count in args.rows:
        end = torch.tensor([count], dtype=torch.int32, device=device)
        for name, rows in data(count, device).items():
            timings = time_interleaved([lambda run=run: run(rows, end) for run in arms.values()], device, **timing)
            us = {arm: timed.median for arm, timed in zip(arms, timings)}
            row = dict(rows=count, data=name, us=us, same=same_as_torch(rows, end),
                       gbps={arm: count * HIDDEN * 3 / time / 1e3 for arm, time in us.items()})
            results.append(row)
            print(f"{count} rows, {name}: " + ", ".join(f"{arm} {time:.1f} us" for arm, time in us.items())
                  + f"; same as torch: {row['same']}", flush=True)
    with open(args.out, "w") as out:
        json.dump(dict(device=device_name(device), read_ceiling_gbps=ceiling, results=results), out, indent=1)


if __name__ == "__main__":
    main()
