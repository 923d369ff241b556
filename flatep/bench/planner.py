"""Planner benchmark: the Triton planner (CUDA-graph replays) beside the reference planner.

``python -m flatep.bench.planner [--out FILE.json]`` times, on one GPU and per rank:

* ``triton_rank_total``: the whole per-rank planning cost a deployment pays,
  :func:`count_rank_triton` (before the exchange: the histogram row the rank contributes and the
  ranks it keeps) plus :func:`plan_rank_triton` from the gathered histogram, in one graph; the
  exchange itself is the transport's and not timed here;
* ``triton_rank``: :func:`plan_rank_triton` alone, from counts made beforehand (the part after
  the exchange);
* ``triton_group``: :func:`make_plan_triton` for all ``R`` virtual ranks, reported per rank
  (``total / R``) and in total;
* ``reference_rank`` / ``reference_group``: :func:`flatep.plan.plan_rank` / :func:`flatep.plan.make_plan`,
  eager, timed with CUDA events (they synchronise with the host, so that is wall time);

at Kimi-K2 (``E=384, K=8``) and Kimi-K3 (``E=896, K=16``) sizes for each ``R`` of ``--ranks``
(default 8), ``s`` of ``--tokens`` (default ``1 128 1024 8192``) and routing skew ``sigma`` of
``--sigmas`` (default ``0 1 5``, :func:`flatep.routing.skewed_topk`). Where ``R`` does not divide
``E`` (both models at ``R=256``) the planner gets ``E`` padded up to a multiple of ``R`` (512 and
1024 experts), the extra experts never routed to; rows give both (``experts``, ``model_experts``).
Per-rank rows time ``--rank-sample`` ranks spread over ``[0, R)`` (all of them when ``R`` is at
most that) and report the slowest. Graph timings are the median over replays of a graph that
holds ``--calls`` calls back to back, divided by that count: launch gaps inside a graph are
counted, host launch overhead is not. On one GPU the virtual-rank figures measure kernel time,
not any link.

``--smoke`` runs tiny shapes (``R`` from ``--ranks``, default 2; ``E = 4R``; on CPU through
Triton's interpreter when there is no GPU, timed with ``time.perf_counter``, no graphs) so that
tests can exercise the whole script.
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
RANKS = (8,)
SMOKE_RANKS = (2,)
SMOKE_STEPS = (1, 8)
PLANNERS = ("triton_rank_total", "triton_rank", "triton_group", "reference_rank", "reference_group")
# The command the H200 runs for the planner's many-rank table (also shown by --help).
H200_COMMAND = (
    "python -m flatep.bench.planner --models kimi-k2 kimi-k3 --ranks 8 64 256 --tokens 128 8192 "
    "--out planner-ranks.json"
)


def model_config(model: str, ranks: int, capacity: int) -> EPConfig:
    """The model's :func:`~flatep.config.preset` at ``ranks``, experts padded up to a multiple of ``ranks``."""
    config = preset(model, ranks=1, capacity=capacity)
    return config.replace(ranks=ranks, experts=-(-config.experts // ranks) * ranks)


def sampled_ranks(ranks: int, sample: int) -> list[int]:
    """``sample`` ranks spread evenly over ``[0, ranks)``, first and last included (all if fewer)."""
    if ranks <= sample:
        return list(range(ranks))
    if sample == 1:
        return [0]
    return sorted({round(i * (ranks - 1) / (sample - 1)) for i in range(sample)})


def bench_case(
    name: str, config: EPConfig, model_experts: int, step: int, sigma: float, device: torch.device,
    args: argparse.Namespace,
) -> list[dict]:
    """Rows of one (shape, R, s, sigma) case, one per planner, in the order of :data:`PLANNERS`.

    ``model_experts``: the experts the router picks from (``config.experts`` may pad it to a
    multiple of ``R``).
    """
    # Imported here: the Triton kernels must be defined after main() chose the interpreter.
    from flatep.plan import make_plan, plan_rank
    from flatep.plan.cost import CostProfile
    from flatep.plan.triton import count_rank_triton, make_plan_triton, plan_rank_triton
    from flatep.routing import maxvio, skewed_topk

    ranks, policy = config.ranks, args.policy
    # auto's model needs a profile; any fixed one times the planner the same way.
    cost = {"cost": CostProfile.preset("h200")} if policy == "auto" else {}
    timed_ranks = sampled_ranks(ranks, args.rank_sample)
    ids = skewed_topk(ranks, model_experts, config.top_k, step, sigma, seed=args.seed, device=device)
    reference = make_plan(ids, config, policy, **cost)
    hist = reference.tokens_per_expert
    graphs = device.type == "cuda"

    def timed(fn: Callable[[], object]) -> float:
        if graphs:
            return time_us(fn, device, iters=args.replays, graph=True, calls=args.calls)
        return time_us(fn, device, warmup=1, iters=args.iters)

    def rank_total(rank: int) -> None:
        counts = count_rank_triton(ids[rank], config.experts)
        plan_rank_triton(rank, ids[rank], hist, config, policy, **cost, counts=counts)

    counted = {rank: count_rank_triton(ids[rank], config.experts) for rank in timed_ranks}
    total_us = [timed(lambda r=r: rank_total(r)) for r in timed_ranks]
    rank_us = [timed(lambda r=r: plan_rank_triton(r, ids[r], hist, config, policy, **cost, counts=counted[r]))
               for r in timed_ranks]
    group_us = timed(lambda: make_plan_triton(ids, config, policy, **cost))
    reference_rank_us = [
        time_us(lambda r=r: plan_rank(r, ids[r], hist, config, policy, **cost), device, warmup=1, iters=args.reference_iters)
        for r in timed_ranks
    ]
    reference_group_us = time_us(lambda: make_plan(ids, config, policy, **cost), device, warmup=1, iters=args.reference_iters)
    common = {
        "model": name,
        "ranks": ranks,
        "experts": config.experts,
        "model_experts": model_experts,
        "top_k": config.top_k,
        "tokens": step,
        "sigma": sigma,
        "maxvio": maxvio(ids, model_experts),  # over the routed experts, not the padding
        "policy": policy,
        "timing": "cuda-graph" if graphs else "perf_counter",
    }
    eager = {**common, "timing": "cuda-events, eager" if graphs else "perf_counter, eager"}
    per_rank = {"us_total": None, "ranks_timed": timed_ranks}
    return [
        {**common, **per_rank, "planner": "triton_rank_total", "us_per_rank": max(total_us), "us_per_rank_all": total_us},
        {**common, **per_rank, "planner": "triton_rank", "us_per_rank": max(rank_us), "us_per_rank_all": rank_us},
        {**common, "planner": "triton_group", "us_per_rank": group_us / ranks, "us_total": group_us},
        {
            **eager,
            **per_rank,
            "planner": "reference_rank",
            "us_per_rank": max(reference_rank_us),
            "us_per_rank_all": reference_rank_us,
        },
        {**eager, "planner": "reference_group", "us_per_rank": reference_group_us / ranks, "us_total": reference_group_us},
    ]


def format_table(rows: Sequence[dict]) -> str:
    """One line per case: Triton per-rank (counting and planning, and planning alone) and
    group-per-rank times beside the reference's."""
    cases: dict[tuple, dict[str, float]] = {}
    for row in rows:
        key = (row["model"], row["ranks"], row["experts"], row["tokens"], row["sigma"], row["maxvio"])
        cases.setdefault(key, {})[row["planner"]] = row["us_per_rank"]
    lines = [
        "| model | R | E | s | sigma | maxvio | triton count + plan (slowest) us | triton plan after exchange (slowest) us | "
        "triton group us/rank | reference rank us | reference group us/rank | speedup (rank) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (model, ranks, experts, step, sigma, vio), times in cases.items():
        lines.append(
            f"| {model} | {ranks} | {experts} | {step} | {sigma:g} | {vio:.2f} | {times['triton_rank_total']:.1f} | "
            f"{times['triton_rank']:.1f} | {times['triton_group']:.1f} | "
            f"{times['reference_rank']:.0f} | {times['reference_group']:.0f} | "
            f"{times['reference_rank'] / times['triton_rank']:.3g}x |"
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The planner benchmark's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m flatep.bench.planner",
        description=__doc__.split("\n")[0],
        # Raw, so that the command below stays on one line to copy.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"many-rank table (K2 and K3, s in {{128, 8192}}, R in {{8, 64, 256}}), as JSON:\n  {H200_COMMAND}",
    )
    parser.add_argument("--out", help="write the rows as a JSON list to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; run on CPU through the Triton interpreter")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="model shapes")
    parser.add_argument(
        "--ranks", nargs="+", type=int,
        help=f"EP ranks R, each in [1, 256] (default {' '.join(map(str, RANKS))}; smoke {' '.join(map(str, SMOKE_RANKS))})",
    )
    parser.add_argument(
        "--tokens", nargs="+", type=int,
        help=f"tokens per rank s (default {' '.join(map(str, STEPS))}; smoke {' '.join(map(str, SMOKE_STEPS))})",
    )
    parser.add_argument("--sigmas", nargs="+", type=float, default=list(SIGMAS), help="routing skews (smoke: 1)")
    parser.add_argument("--rank-sample", type=int, default=8, help="ranks timed per case, spread over [0, R)")
    parser.add_argument("--policy", default="exact", choices=("exact", "none", "bounded", "auto"),
                        help="planner policy (auto decides with the h200 cost profile) (default: exact)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20, help="planner calls captured in one graph")
    parser.add_argument("--replays", type=int, default=50, help="graph replays; the median is reported")
    parser.add_argument("--iters", type=int, default=3, help="eager iterations without a GPU (smoke)")
    parser.add_argument("--reference-iters", type=int, default=5, help="eager iterations of the reference")
    args = parser.parse_args(argv)
    for name in ("calls", "replays", "iters", "reference_iters", "rank_sample"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    args.ranks = list(args.ranks or (SMOKE_RANKS if args.smoke else RANKS))
    args.tokens = list(args.tokens or (SMOKE_STEPS if args.smoke else STEPS))
    if any(not 1 <= r <= 256 for r in args.ranks):
        parser.error(f"--ranks must be in [1, 256] (the Triton planner's limit), got {args.ranks}")
    if any(s < 1 for s in args.tokens):
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
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
    capacity = max(args.tokens)
    if args.smoke:
        configs = [
            ("tiny", EPConfig(ranks=r, experts=4 * r, top_k=2, hidden=8, intermediate=8, capacity=capacity, align=4), 4 * r)
            for r in args.ranks
        ]
        sigmas = [1.0]
        if not cuda:  # the interpreter takes about a second per call
            args.iters = args.reference_iters = 1
    else:
        configs = [
            (model, model_config(model, r, capacity), preset(model, ranks=1).experts) for model in args.models for r in args.ranks
        ]
        sigmas = args.sigmas
    meta = {
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(["python -m flatep.bench.planner", *(sys.argv[1:] if argv is None else argv)]),
    }
    rows: list[dict] = []
    for name, config, model_experts in configs:
        for step in args.tokens:
            for sigma in sigmas:
                case_rows = bench_case(name, config, model_experts, step, sigma, device, args)
                rows.extend({**row, **meta} for row in case_rows)
                times = {row["planner"]: row["us_per_rank"] for row in case_rows}
                print(
                    f"{name} R={config.ranks} s={step} sigma={sigma:g}: triton count + plan {times['triton_rank_total']:.1f} us, "
                    f"rank {times['triton_rank']:.1f} us, group {times['triton_group']:.1f} us/rank, "
                    f"reference rank {times['reference_rank']:.0f} us",
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
