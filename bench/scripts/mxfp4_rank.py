"""Shared by the tile scripts (``mxfp4_registers.py``, ``mxfp4_tma_ab.py``, ``mxfp4_tile_sweep.py``, and
``fp8_tile_sweep.py`` with its own rank and byte count): one Kimi-K3 rank's packed experts, arms timed
against each other, and the JSON they write: each arm's time beside the device's read ceiling
measured in the same run (:func:`flatep.bench.timing.read_ceiling_gbps`; GPU only), counting the
packed weight bytes (values and scales) the GEMM reads once."""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch

from flatep.bench.timing import device_name, read_ceiling_gbps, time_interleaved
from flatep.kernels.packed_tiles import default_config
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

EXPERTS, HIDDEN, INTERMEDIATE = 112, 3584, 3072  # a Kimi-K3 rank's experts at R = 8
GEMMS = {"w13": (2 * INTERMEDIATE, HIDDEN), "w2": (HIDDEN, INTERMEDIATE)}  # (N, K) of gate/up and down
ROUNDS, CALLS = 8, 5
DEVICE = torch.device("cuda")  # a test runs the scripts on the CPU under the interpreter


def rank_operands(rows_per_expert: int, columns: int, inner: int) -> tuple[torch.Tensor, ...]:
    """Random packed values ``[E, N, K/2]`` uint8, column-fastest scales ``[E, N, K/32]`` (as pools hold
    them; bytes 118-128, so the second pass returns at once), rows ``[E * rows_per_expert, K]`` bf16
    and their offsets ``[E]`` int32."""
    values = torch.randint(0, 256, (EXPERTS, columns, inner // 2), dtype=torch.uint8, device=DEVICE)
    scales = torch.randint(118, 129, (EXPERTS, inner // 32, columns), dtype=torch.uint8, device=DEVICE).transpose(1, 2)
    rows = torch.randn(EXPERTS * rows_per_expert, inner, device=DEVICE).to(torch.bfloat16)
    offsets = torch.arange(1, EXPERTS + 1, device=DEVICE, dtype=torch.int32) * rows_per_expert
    return values, scales, rows, offsets


def time_arms(arms: list[tuple[dict, Callable[[torch.Tensor], None]]], rows: int, columns: int) -> list[dict]:
    """Each arm ``(fields, run)``: ``run(out)`` writes an ``[rows, columns]`` bf16 output. Every arm
    runs once into a NaN-poisoned output and is compared bit for bit with the first arm's
    (``same_bits``); then each is captured in a CUDA graph of :data:`CALLS` calls and replayed
    interleaved with the others, :data:`ROUNDS` rounds. Returns ``fields`` with ``us``, the median
    per call, and ``same_bits``, per arm."""
    outputs = [torch.full((rows, columns), float("nan"), device=DEVICE, dtype=torch.bfloat16) for _ in arms]
    for (_, run), out in zip(arms, outputs):
        run(out)
    timings = time_interleaved([lambda run=run, out=out: run(out) for (_, run), out in zip(arms, outputs)], DEVICE,
                               warmup=1, iters=ROUNDS, graph=True, calls=CALLS)
    return [{**fields, "us": round(timing.median, 1), "same_bits": bool(torch.equal(out, outputs[0]))}
            for (fields, _), out, timing in zip(arms, outputs, timings)]


def time_tiles(rows_per_expert: int, gemm: str, tiles: list, run: Callable, operands: tuple[torch.Tensor, ...],
               ) -> list[dict]:
    """Each of ``tiles`` (``GemmConfig``; the first, the default, marked ``default``) as an arm
    ``run(rows, values, scales, offsets, config, out)`` over ``operands = (values [G, N, ...], scales,
    rows, offsets)``, timed by :func:`time_arms`."""
    values, scales, rows, offsets = operands
    arms = [({"rows_per_expert": rows_per_expert, "gemm": gemm, "tiles": config.label, "default": index == 0},
             lambda out, config=config: run(rows, values, scales, offsets, config, out))
            for index, config in enumerate(tiles)]
    return time_arms(arms, rows.shape[0], values.shape[1])


def default_then(rows_per_expert: int, gemm: str, columns: int, inner: int, candidates: list) -> list[dict]:
    """A tile script's cell: :func:`flatep.kernels.packed_tiles.default_config`'s mxfp4 tile, then
    ``candidates``, each through :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` over
    :func:`rank_operands`, timed by :func:`time_tiles`."""
    operands = rank_operands(rows_per_expert, columns, inner)
    tiles = [default_config(operands[2].shape[0], EXPERTS, "mxfp4"), *candidates]
    return time_tiles(rows_per_expert, gemm, tiles, mxfp4_grouped_mm_triton, operands)


def mxfp4_bytes(columns: int, inner: int) -> int:
    """Packed bytes of :data:`EXPERTS` mxfp4 weights ``[N, K]``: e2m1 values and e8m0 scales."""
    return EXPERTS * columns * (inner // 2 + inner // 32)


def main(description: str, cells: list[int], time_cell: Callable[[int, str, int, int], list[dict]],
         gemms: dict[str, tuple[int, int]] | None = None, packed_bytes: Callable[[int, int], int] = mxfp4_bytes,
         ) -> None:
    """A script's command line (``--out FILE``, the first paragraph of ``description`` as its help):
    ``time_cell(rows_per_expert, gemm, columns, inner)`` for every cell and ``gemms`` (default
    :data:`GEMMS`: name to ``(N, K)``), each row printed as it comes with its weight bytes
    (``packed_bytes(N, K)``) and their read rate as a fraction of the read ceiling, then all written
    to ``FILE`` as ``{"device", "read_ceiling_gbps", "results"}``."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--rows", type=int, nargs="+", choices=cells, default=cells,
                        help=f"rows per expert to time (default all: {' '.join(map(str, cells))})")
    args = parser.parse_args()
    path, cells = args.out, args.rows
    ceiling = read_ceiling_gbps(DEVICE) if DEVICE.type == "cuda" else None
    print(f"{device_name(DEVICE)}: read ceiling {ceiling} GB/s", flush=True)
    torch.manual_seed(0)
    results = []
    for rows_per_expert in cells:
        for gemm, (columns, inner) in (gemms or GEMMS).items():
            weight_bytes = packed_bytes(columns, inner)
            for row in time_cell(rows_per_expert, gemm, columns, inner):
                row["weight_bytes"] = weight_bytes
                row["read_fraction"] = weight_bytes / row["us"] / 1e3 / ceiling if ceiling else None
                print(json.dumps(row), flush=True)
                results.append(row)
    with open(path, "w") as file:
        json.dump({"device": device_name(DEVICE), "read_ceiling_gbps": ceiling, "results": results}, file, indent=1)
