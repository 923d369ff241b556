"""Command line: ``flatep plan`` (inspect one step's plan) and ``flatep bench`` (the sweep)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from flatep.bench.calibrate import add_calibrate_command
from flatep.config import MODEL_SHAPES, POLICIES, preset


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _plan_command(args: argparse.Namespace) -> int:
    from flatep.plan import make_plan
    from flatep.plan.report import format_summary, plot_load, summarize
    from flatep.routing import ADVERSARIAL, adversarial_topk, maxvio, sigma_for_maxvio, skewed_topk

    config = preset(args.model, ranks=args.ranks, capacity=args.tokens, align=args.align).replace(tolerance=args.tolerance)
    if args.routing in ADVERSARIAL:
        sigma = None
        ids = adversarial_topk(args.routing, config.ranks, config.experts, config.top_k, args.tokens)
    else:
        sigma, _ = sigma_for_maxvio(args.maxvio, config.ranks, config.experts, config.top_k, args.tokens, seed=args.seed)
        ids = skewed_topk(config.ranks, config.experts, config.top_k, args.tokens, sigma, seed=args.seed)
    plan = make_plan(ids, config, args.policy)
    summary = summarize(plan, config)
    summary.update(
        model=args.model,
        tokens=args.tokens,
        routing=args.routing,
        maxvio_target=args.maxvio if sigma is not None else None,
        maxvio=maxvio(ids, config.experts),
        sigma=sigma,
    )
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        reached = f"maxvio {summary['maxvio']:.2f}" + (f" (target {args.maxvio}, sigma {sigma:.4f})" if sigma is not None else f" ({args.routing} routing)")
        print(
            f"{args.model}: R={config.ranks} E={config.experts} K={config.top_k} H={config.hidden} "
            f"s={args.tokens} policy={args.policy}; {reached}"
        )
        print(format_summary(summary))
    if args.plot:
        plot_load(summary, args.plot, f"{args.model}, R={config.ranks}, s={args.tokens}, maxvio {summary['maxvio']:.1f}")
        if not args.json:
            print(f"plot written to {args.plot}")
    return 0


def _bench_command(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from flatep.bench.report import write_report
    from flatep.bench.sweep import Sweep, read_results, run

    out_dir = Path(args.out)
    if args.report:
        rows = read_results(Path(args.report))
        if not rows:
            raise CliError(f"no results in {args.report}")
        paths = write_report(rows, out_dir if args.out != "bench-out" else Path(args.report).parent)
        print(paths[0].read_text())
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sweep = Sweep.load(args.config or ("default" if device.type == "cuda" else "cpu"))
    if device.type == "cpu":
        print(f"flatep bench: no GPU, running the '{sweep.name}' sweep on the CPU (torch paths; times are CPU times)")
    rows = run(sweep, out_dir, device, resume=args.resume, progress=not args.quiet, backend=args.backend)
    paths = write_report(rows, out_dir)
    print(paths[0].read_text())
    print("wrote " + ", ".join(str(p) for p in [out_dir / "results.jsonl", *paths]))
    return 0


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``flatep`` argument parser: sub-commands ``plan`` and ``bench``."""
    parser = argparse.ArgumentParser(prog="flatep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan one step and show per-rank load before and after balancing")
    plan.add_argument("--model", default="kimi-k2", choices=sorted(MODEL_SHAPES))
    plan.add_argument("--ranks", type=_positive, default=8)
    plan.add_argument("--tokens", type=_positive, default=4096, help="tokens per rank s")
    plan.add_argument("--maxvio", type=_non_negative, default=10.0, help="target router imbalance")
    plan.add_argument("--routing", default="skewed", choices=["skewed", "local", "next", "one", "duplicate"])
    plan.add_argument("--policy", default="exact", choices=POLICIES)
    plan.add_argument("--align", type=_positive, default=128)
    plan.add_argument("--tolerance", type=_non_negative, default=0.0,
                      help="rank imbalance exact lets pass without moving weights (EPConfig.tolerance)")
    plan.add_argument("--seed", type=int, default=1234)
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--plot", metavar="FILE.png", help="draw per-rank load before/after")
    plan.set_defaults(run=_plan_command)
    bench = commands.add_parser("bench", help="sweep tokens per rank and router skew; write results, summary and plots")
    bench.add_argument("config", nargs="?", help="sweep config: a shipped name (default, kimi-k3, cpu, tiny) or a YAML path; "
                       "default: 'default' on a GPU, 'cpu' otherwise")
    bench.add_argument("--out", default="bench-out", help="output folder (default bench-out/)")
    bench.add_argument("--resume", action="store_true", help="skip cells already in OUT/results.jsonl")
    bench.add_argument("--report", metavar="RESULTS.jsonl", help="only write summary.md and plots from a results file")
    bench.add_argument("--device", help="cuda or cpu (default: cuda if available)")
    bench.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    bench.add_argument("--quiet", action="store_true", help="no progress bar")
    bench.set_defaults(run=_bench_command)
    add_calibrate_command(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``flatep``: returns the exit status (2 with a one-line message on a user error)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, CliError, OSError) as error:
        print(f"flatep {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
