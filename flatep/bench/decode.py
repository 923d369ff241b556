"""GPU benchmark of one rank's experts at decode sizes: the decode kernels against ``torch._grouped_mm``.

``python -m flatep.bench.decode [--models kimi-k2 kimi-k3] [--out decode.json]`` times, on one GPU
with CUDA-graph timing (median of replays), one EP8 rank's experts (``E/8`` bf16 experts) at
``rows`` rows per active expert:

- ``torch``: gate/up ``torch._grouped_mm``, the weighted SwiGLU kernel, down ``torch._grouped_mm``
  (the path :func:`flatep.experts.grouped_swiglu` takes above the crossover);
- ``decode``: :func:`flatep.kernels.decode_gemm.gate_up_swiglu_triton` then
  :func:`~flatep.kernels.decode_gemm.grouped_mm_triton`, in the layer's launches
  (:func:`~flatep.kernels.decode_gemm.decode_launches`: the groups of at most ``HOT_ROWS`` rows
  with :func:`~flatep.kernels.decode_gemm.decode_config`'s tiles, the others in a second launch
  with ``HOT_TILES``), one launch over every group with each of :data:`CANDIDATES`, and the
  layer's split with each of :data:`HOT_CANDIDATES` for the hot groups.

Bytes counted: the weights of the active experts (``3 * H * I * 2`` bytes each), read once; the
rows (a few MB at most) are left out. Each time is printed beside the time those bytes take at the
read ceiling measured in the same run (an fp32 sum over 4 GiB of bf16), and as a fraction of it.
Each decode arm is checked against the torch arm first (relative error recorded). The result names
the crossover: the largest rows per expert up to which the default decode tiles beat ``torch``.

``--maxvio 0 2 10`` adds routed cells: the groups of the busiest rank of a step of ``--step-tokens``
tokens per rank (R = 8) under classic EP, routed as the sweeps route it (a few hot experts hold
several times the mean rows, so some groups take several row tiles). Their ``decode`` arm takes
the tiles the layer takes, from the step's average rows per expert.
"""
from __future__ import annotations

import argparse
import dataclasses
import json

import torch
from triton.runtime.errors import OutOfResources

from flatep.bench.timing import device_name, read_ceiling_gbps, time_us
from flatep.config import preset, rows_per_expert
from flatep.kernels.activation import swiglu_weighted_triton
from flatep.kernels.decode_gemm import decode_launches, decode_swiglu
from flatep.kernels.packed_tiles import GemmConfig
from flatep.routing import expert_histogram, sigma_for_maxvio, skewed_topk

ROWS_PER_EXPERT = (1, 2, 4, 8, 16, 32, 64, 128)
SPARSE_ACTIVE = 12  # experts active on the slowest rank at s=1 (Kimi-K2, EP8): a cell of its own
CANDIDATES = (
    GemmConfig(16, 128, 128, num_warps=4, num_stages=3, swap_ab=True),
    GemmConfig(16, 32, 128, num_warps=4, num_stages=4, swap_ab=True),
    GemmConfig(16, 64, 64, num_warps=4, num_stages=6, swap_ab=True),
    GemmConfig(16, 64, 256, num_warps=4, num_stages=3, swap_ab=True),
    GemmConfig(16, 64, 128, num_warps=8, num_stages=4, swap_ab=True),
    GemmConfig(32, 64, 128, num_warps=4, num_stages=4, swap_ab=True),
    GemmConfig(64, 64, 128, num_warps=4, num_stages=3, swap_ab=False),
    GemmConfig(32, 64, 128, num_warps=4, num_stages=4, group_m=1, swap_ab=True),
    GemmConfig(32, 64, 128, num_warps=8, num_stages=4, swap_ab=True),
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4, swap_ab=True),
    GemmConfig(64, 64, 128, num_warps=8, num_stages=3, swap_ab=True),
)
# Tiles of the second launch, the groups above HOT_ROWS rows (flatep.kernels.decode_gemm.decode_launches).
HOT_CANDIDATES = (
    GemmConfig(64, 64, 128, num_warps=4, num_stages=4, swap_ab=False),
    GemmConfig(128, 64, 64, num_warps=8, num_stages=4, swap_ab=False),
    GemmConfig(64, 128, 64, num_warps=4, num_stages=4, swap_ab=False),
)


def uniform_rows(model: str, rows: int, active: int) -> list[int]:
    """Rows of each of a rank's ``E/8`` groups: ``active`` groups, picked at random, of ``rows`` rows."""
    counts = torch.zeros(preset(model).experts_per_rank, dtype=torch.int32)
    counts[torch.randperm(counts.numel())[:active]] = rows
    return counts.tolist()


def busiest_rank_rows(model: str, tokens: int, target: float, ranks: int = 8) -> tuple[list[int], float]:
    """The groups of the busiest rank under classic EP, as the sweeps route a step: ``tokens`` per
    rank over ``ranks`` ranks, :func:`flatep.routing.skewed_topk` at the sigma that reaches maxvio
    ``target`` (:func:`flatep.routing.sigma_for_maxvio`, the sweeps' seed). Returns the rows of each
    of its ``E/R`` experts and the maxvio reached."""
    config = preset(model, ranks=ranks)
    sigma, reached = sigma_for_maxvio(target, ranks, config.experts, config.top_k, tokens)
    ids = skewed_topk(ranks, config.experts, config.top_k, tokens, sigma)
    per_rank = expert_histogram(ids, config.experts).view(ranks, config.experts_per_rank)
    return per_rank[int(per_rank.sum(1).argmax())].tolist(), reached


def _cell(
    model: str, group_rows: list[int], device: torch.device, ceiling_gbps: float, iters: int,
    rows_per_group: int | None = None,
) -> dict:
    """Time one rank's experts holding ``group_rows`` rows per group; the ``decode`` arm takes the
    tiles the layer would: from ``rows_per_group`` (the step's average, ``ceil(T*K/E)``; default
    this rank's own average)."""
    config = preset(model)
    hidden, inter, groups = config.hidden, config.intermediate, config.experts_per_rank
    w13 = (torch.randn(groups, 2 * inter, hidden, device=device) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(groups, hidden, inter, device=device) * inter**-0.5).bfloat16()
    counts = torch.tensor(group_rows, dtype=torch.int32, device=device)
    offsets = counts.cumsum(0, dtype=torch.int32)
    total = int(sum(group_rows))
    active = sum(1 for rows in group_rows if rows > 0)
    x = torch.randn(total, hidden, device=device).bfloat16()
    route_weights = torch.rand(total, device=device)
    activated = torch.empty(total, inter, dtype=torch.bfloat16, device=device)
    out = torch.empty(total, hidden, dtype=torch.bfloat16, device=device)

    def torch_arm() -> torch.Tensor:
        hidden_states = torch._grouped_mm(x, w13.mT, offs=offsets)
        swiglu_weighted_triton(hidden_states, route_weights, offsets[-1:], activated)
        return torch._grouped_mm(activated, w2.mT, offs=offsets)

    def decode_arm(launches: list[tuple[GemmConfig, tuple[int, int] | None]]):
        return lambda: decode_swiglu(x, w13, w2, route_weights, offsets, launches, activated, out)

    weight_bytes = active * 3 * hidden * inter * 2
    per_group = -(-total // groups) if rows_per_group is None else rows_per_group
    launches = decode_launches(per_group * groups, groups)
    default_tiles = launches[0][0]
    floor_us = weight_bytes / ceiling_gbps / 1e3
    reference = torch_arm().float()
    arms = {"torch": torch_arm, "decode": decode_arm(launches)}
    arms.update({f"decode {tiles.label}": decode_arm([(tiles, None)]) for tiles in CANDIDATES})
    arms.update({f"decode split hot {hot.label}": decode_arm(decode_launches(per_group * groups, groups, hot))
                 for hot in HOT_CANDIDATES})
    results = {}
    for name, run in arms.items():
        try:
            error = 0.0 if name == "torch" else ((run().float() - reference).norm() / reference.norm()).item()
        except OutOfResources as exc:  # a candidate's pipeline does not fit this GPU's shared memory
            results[name] = {"skipped": str(exc)}
            continue
        elapsed = time_us(run, device, warmup=1, iters=iters, graph=True)
        results[name] = {"us": elapsed, "of_read_ceiling": floor_us / elapsed, "rel_error": error}
    timed = [name for name in results if name.startswith("decode") and "us" in results[name]]
    best = min(timed, key=lambda name: results[name]["us"])
    return {
        "model": model, "rows_per_expert": max(group_rows), "active_experts": active, "rows": total,
        "weight_bytes": weight_bytes, "read_floor_us": floor_us, "default_tiles": dataclasses.asdict(default_tiles),
        "arms": results, "best_decode": best,
    }


def _print(cell: dict, label: str) -> None:
    arms = cell["arms"]
    best = cell["best_decode"]
    print(f"{cell['model']} {label}: floor {cell['read_floor_us']:8.1f} us | torch {arms['torch']['us']:8.1f} "
          f"({arms['torch']['of_read_ceiling']:.0%}) | decode {arms['decode']['us']:8.1f} ({arms['decode']['of_read_ceiling']:.0%})"
          f" | best {best} {arms[best]['us']:.1f} ({arms[best]['of_read_ceiling']:.0%})", flush=True)


def _crossover(cells: list[dict]) -> int:
    """Largest rows per expert up to which the default decode tiles beat ``torch`` in every cell."""
    crossover = 0
    for rows in sorted({cell["rows_per_expert"] for cell in cells}):
        if all(cell["arms"]["decode"]["us"] < cell["arms"]["torch"]["us"] for cell in cells if cell["rows_per_expert"] == rows):
            crossover = rows
        else:
            break
    return crossover


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["kimi-k2", "kimi-k3"], help="model shapes (flatep.config presets)")
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS_PER_EXPERT), help="rows per active expert")
    parser.add_argument("--maxvio", nargs="*", type=float, default=[],
                        help="also time the busiest rank's groups of a routed step at these maxvio targets")
    parser.add_argument("--step-tokens", type=int, default=128, help="tokens per rank of the routed steps (--maxvio)")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays per arm (CPU: eager calls)")
    parser.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ceiling = read_ceiling_gbps(device, 4096 if device.type == "cuda" else 64)
    print(f"{device_name(device)}: read ceiling {ceiling:.0f} GB/s (fp32 sum over bf16)")
    cells, routed = [], []
    for model in args.models:
        groups = preset(model).experts_per_rank
        shapes = [(1, min(SPARSE_ACTIVE, groups))] + [(rows, groups) for rows in args.rows]
        for rows, active in shapes:
            cell = _cell(model, uniform_rows(model, rows, active), device, ceiling, args.iters)
            cells.append(cell)
            _print(cell, f"{active:4d} experts x {rows:4d} rows")
        for target in args.maxvio:
            group_rows, reached = busiest_rank_rows(model, args.step_tokens, target)
            step_average = rows_per_expert(8 * args.step_tokens, preset(model).top_k, preset(model).experts)
            cell = _cell(model, group_rows, device, ceiling, args.iters, rows_per_group=step_average)
            cell.update(step_tokens=args.step_tokens, maxvio_target=target, maxvio=reached, group_rows=group_rows)
            routed.append(cell)
            _print(cell, f"s={args.step_tokens} maxvio {reached:.2f}, busiest rank ({cell['rows']} rows, "
                         f"largest group {cell['rows_per_expert']})")
    result = {"device": device_name(device), "read_ceiling_gbps": ceiling, "crossover_rows_per_expert": _crossover(cells),
              "cells": cells, "routed_cells": routed}
    print(f"crossover: the decode kernels beat torch._grouped_mm up to {result['crossover_rows_per_expert']} rows per expert")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
