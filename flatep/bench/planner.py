"""Planner benchmark: the Triton planner (CUDA-graph replays) beside the reference planner.

``python -m flatep.bench.planner [--out FILE.json]`` times, on one GPU and per rank:

* ``triton_rank``: :func:`plan_rank_triton` (one process per GPU: the gathered histogram is an
  input), every rank timed, the slowest reported;
* ``triton_group``: :func:`make_plan_triton` for all ``R`` virtual ranks, reported per rank
  (``total / R``) and in total;
* ``reference_rank`` / ``reference_group``: :func:`flatep.plan.plan_rank` / :func:`flatep.plan.make_plan`,
  eager, timed with CUDA events (they synchronise with the host, so that is wall time);

at Kimi-K2 (``R=8, E=384, K=8``) and Kimi-K3 (``R=8, E=896, K=16``) sizes, ``s`` in
``{1, 128, 1024, 8192}`` and routing skew ``sigma`` in ``{0, 1, 5}``
(:func:`flatep.routing.skewed_topk`). Graph timings are the median over replays of a graph that
holds ``--calls`` planner calls back to back, divided by that count: launch gaps inside a graph
are counted, host launch overhead is not. On one GPU the virtual-rank figures measure kernel
time, not any link.

``--smoke`` runs a tiny shape (on CPU through Triton's interpreter when there is no GPU, timed with
``time.perf_counter``, no graphs) so that tests can exercise the whole script.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence

import torch

from flatep.bench.timing import device_name, time_us
from flatep.config import EPConfig, preset

MODELS = ("kimi-k2", "kimi-k3")
STEPS = (1, 128, 1024, 8192)
SIGMAS = (0.0, 1.0, 5.0)
RANKS = 8


def bench_case(
    name: str, config: EPConfig, step: int, sigma: float, device: torch.device, args: argparse.Namespace
) -> list[dict]:
    """Rows of one (shape, s, sigma) case, one per planner, in the order of the module docstring."""
    # Imported here: the Triton kernels must be defined after main() chose the interpreter.
    from flatep.plan import make_plan, plan_rank
    from flatep.plan.triton import make_plan_triton, plan_rank_triton
    from flatep.routing import maxvio, skewed_topk

    ranks, policy = config.ranks, args.policy
    ids = skewed_topk(ranks, config.experts, config.top_k, step, sigma, seed=args.seed, device=device)
    reference = make_plan(ids, config, policy)
    hist = reference.tokens_per_expert
    graphs = device.type == "cuda"

    def timed(fn: Callable[[], object]) -> float:
        if graphs:
            return time_us(fn, device, iters=args.replays, graph=True, calls=args.calls)
        return time_us(fn, device, warmup=1, iters=args.iters)

    rank_us = [timed(lambda r=r: plan_rank_triton(r, ids[r], hist, config, policy)) for r in range(ranks)]
    group_us = timed(lambda: make_plan_triton(ids, config, policy))
    reference_rank_us = [
        time_us(lambda r=r: plan_rank(r, ids[r], hist, config, policy), device, warmup=1, iters=args.reference_iters)
        for r in range(ranks)
    ]
    reference_group_us = time_us(lambda: make_plan(ids, config, policy), device, warmup=1, iters=args.reference_iters)
    common = {
        "model": name,
        "ranks": ranks,
        "experts": config.experts,
        "top_k": config.top_k,
        "tokens": step,
        "sigma": sigma,
        "maxvio": maxvio(ids, config.experts),
        "policy": policy,
        "timing": "cuda-graph" if graphs else "perf_counter",
    }
    eager = {**common, "timing": "cuda-events, eager" if graphs else "perf_counter, eager"}
    return [
        {**common, "planner": "triton_rank", "us_per_rank": max(rank_us), "us_total": None, "us_per_rank_all": rank_us},
        {**common, "planner": "triton_group", "us_per_rank": group_us / ranks, "us_total": group_us},
        {
            **eager,
            "planner": "reference_rank",
            "us_per_rank": max(reference_rank_us),
            "us_total": None,
            "us_per_rank_all": reference_rank_us,
        },
        {**eager, "planner": "reference_group", "us_per_rank": reference_group_us / ranks, "us_total": reference_group_us},
    ]


def format_table(rows: Sequence[dict]) -> str:
    """One line per case: Triton per-rank and group-per-rank times beside the reference's."""
    cases: dict[tuple, dict[str, float]] = {}
    for row in rows:
        key = (row["model"], row["tokens"], row["sigma"], row["maxvio"])
        cases.setdefault(key, {})[row["planner"]] = row["us_per_rank"]
    lines = [
        "| model | s | sigma | maxvio | triton rank (slowest) us | triton group us/rank | "
        "reference rank us | reference group us/rank | speedup (rank) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (model, step, sigma, vio), times in cases.items():
        lines.append(
            f"| {model} | {step} | {sigma:g} | {vio:.2f} | {times['triton_rank']:.1f} | {times['triton_group']:.1f} | "
            f"{times['reference_rank']:.0f} | {times['reference_group']:.0f} | "
            f"{times['reference_rank'] / times['triton_rank']:.3g}x |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The planner benchmark's command line."""
    parser = argparse.ArgumentParser(prog="python -m flatep.bench.planner", description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the rows as a JSON list to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shape; runs on CPU through the Triton interpreter")
    parser.add_argument("--policy", default="exact", choices=("exact", "none", "bounded"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20, help="planner calls captured in one graph")
    parser.add_argument("--replays", type=int, default=50, help="graph replays; the median is reported")
    parser.add_argument("--iters", type=int, default=3, help="eager iterations without a GPU (smoke)")
    parser.add_argument("--reference-iters", type=int, default=5, help="eager iterations of the reference")
    args = parser.parse_args(argv)
    for name in ("calls", "replays", "iters", "reference_iters"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Time the planners (or, with ``--smoke``, a tiny CPU run) and print/write the table."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("the planner benchmark needs a CUDA device (use --smoke to run a tiny shape on CPU)", file=sys.stderr)
        return 2
    if not cuda:
        # The interpreter must be chosen before flatep.plan.triton defines its kernels.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        configs = {EPConfig(ranks=2, experts=8, top_k=2, hidden=8, intermediate=8, capacity=8, align=4): "tiny"}
        steps, sigmas = (1, 8), (1.0,)
        if not cuda:  # the interpreter takes about a second per call
            args.iters = args.reference_iters = 1
    else:
        configs = {preset(model, ranks=RANKS, capacity=max(STEPS)): model for model in MODELS}
        steps, sigmas = STEPS, SIGMAS
    meta = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["python -m flatep.bench.planner", *(sys.argv[1:] if argv is None else argv)]),
    }
    rows: list[dict] = []
    for config, name in configs.items():
        for step in steps:
            for sigma in sigmas:
                case_rows = bench_case(name, config, step, sigma, device, args)
                rows.extend({**row, **meta} for row in case_rows)
                triton_rank = case_rows[0]["us_per_rank"]
                print(
                    f"{name} s={step} sigma={sigma:g}: triton rank {triton_rank:.1f} us, "
                    f"group {case_rows[1]['us_per_rank']:.1f} us/rank, reference rank {case_rows[2]['us_per_rank']:.0f} us",
                    file=sys.stderr,
                    flush=True,
                )
    print(f"planner benchmark on {meta['device']} (torch {meta['torch']}, triton {meta['triton']}), policy {args.policy}")
    print(format_table(rows))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(rows, handle, indent=2)
        print(f"rows written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
