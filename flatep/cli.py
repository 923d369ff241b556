"""Command line: ``flatep plan`` (inspect one step's plan) and ``flatep bench`` (the sweep)."""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from flatep.bench.calibrate import add_calibrate_command
from flatep.kernels.fp8_rows import DISPATCH_FORMATS
from flatep.config import MODEL_SHAPES, POLICIES, preset
from flatep.plan.cost import CostProfile
from flatep.quant import WEIGHT_FORMATS


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _plan_command(args: argparse.Namespace) -> int:
    from flatep.bench.report import have_matplotlib
    from flatep.bench.sweep import maxvio_reached
    from flatep.plan import make_plan
    from flatep.plan.report import format_summary, plot_load, summarize
    from flatep.routing import ADVERSARIAL, adversarial_topk, maxvio, sigma_for_maxvio, skewed_topk

    plot_path = _png_path(args.plot) if args.plot else None
    if plot_path and not have_matplotlib():
        raise CliError("--plot needs matplotlib, which is not installed (pip install 'flatep[plots]')")
    config = preset(args.model, ranks=args.ranks, capacity=args.tokens, align=args.align).replace(tolerance=args.tolerance)
    if args.routing in ADVERSARIAL:
        sigma = reached = None
        ids = adversarial_topk(args.routing, config.ranks, config.experts, config.top_k, args.tokens)
    else:
        sigma, reached = sigma_for_maxvio(args.maxvio, config.ranks, config.experts, config.top_k, args.tokens, seed=args.seed)
        ids = skewed_topk(config.ranks, config.experts, config.top_k, args.tokens, sigma, seed=args.seed)
    if sigma is not None and not maxvio_reached(args.maxvio, reached):
        print(f"flatep plan: maxvio target {args.maxvio:g} not reached at this shape: the routing has maxvio {reached:.2f} "
              f"(the largest possible is E/K - 1 = {config.experts / config.top_k - 1:g})", file=sys.stderr)
    if args.cost is not None and args.policy != "auto":
        raise CliError(f"--cost is for --policy auto, got --policy {args.policy}")
    cost = {"cost": _cost_profile(args.cost)} if args.policy == "auto" else {}
    plan = make_plan(ids, config, args.policy, **cost)
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
    if plot_path:
        plot_load(summary, plot_path, f"{args.model}, R={config.ranks}, s={args.tokens}, maxvio {summary['maxvio']:.1f}")
        if not args.json:
            print(f"plot written to {plot_path}")
    return 0


def _png_path(name: str) -> str:
    """The file a plot is written to: ``name`` itself, with ``.png`` added when it has no suffix
    (matplotlib would add it silently, and the printed name would be wrong)."""
    from pathlib import Path

    return name if Path(name).suffix else name + ".png"


def _bench_command(args: argparse.Namespace) -> int:
    import dataclasses
    from pathlib import Path

    import torch

    from flatep.bench.report import PLOTS_SKIPPED, write_report
    from flatep.bench.sweep import Sweep, read_results, resolve_backend, run, unreached_targets
    from flatep.bench.timing import device_name

    out_dir = Path(args.out)
    if args.report:
        rows = read_results(Path(args.report))
        if not rows:
            raise CliError(f"no results in {args.report}")
        paths = write_report(rows, out_dir if args.out != "bench-out" else Path(args.report).parent)
        print(paths[0].read_text())
        if len(paths) == 1:
            print(PLOTS_SKIPPED)
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA GPU is available here (torch.cuda.is_available() is False); use --device cpu")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sweep = Sweep.load(args.config or ("default" if device.type == "cuda" else "cpu"))
    overrides = {key: value for key, value in (("weights", args.weights), ("dispatch", args.dispatch), ("cost", args.cost))
                 if value is not None}
    if overrides:
        sweep = dataclasses.replace(sweep, **overrides)
        sweep.validate()
    backend = resolve_backend(args.backend, device)
    note = "; no GPU: times are CPU times" if device.type == "cpu" else ""
    print(f"flatep bench: the '{sweep.name}' sweep on {device_name(device)}, kernels: {backend}{note}", flush=True)
    rows = run(sweep, out_dir, device, resume=args.resume, progress=not args.quiet, backend=backend)
    paths = write_report(rows, out_dir)
    print(paths[0].read_text())
    for line in unreached_targets(rows):
        print(line)
    if len(paths) == 1:
        print(PLOTS_SKIPPED)
    print("wrote " + ", ".join(str(p) for p in [out_dir / "results.jsonl", *paths]))
    return 0


def _cost_profile(name_or_path: str | None) -> CostProfile:
    """``--cost``: a preset or a profile file (None: the generic profile)."""
    if name_or_path is None:
        return CostProfile.default()
    try:
        return CostProfile.named(name_or_path)
    except ValueError as error:
        raise CliError(f"--cost: {error}") from None


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


DESCRIPTION = (
    "FlatEP command line. 'flatep plan' plans one step and shows the per-rank load before and after "
    "balancing; 'flatep bench' sweeps tokens per rank and router skew and writes results, a summary "
    "and plots. 'flatep COMMAND --help' lists a command's options."
)


def build_parser() -> argparse.ArgumentParser:
    """The ``flatep`` argument parser: sub-commands ``plan`` and ``bench``."""
    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="flatep", description=DESCRIPTION, formatter_class=formatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan", formatter_class=formatter,
        help="plan one step and show per-rank load before and after balancing",
        description="Plan one step of a skewed (or adversarial) routing on R ranks and show every rank's "
        "rows before and after balancing, the experts it borrows and the weight bytes moved.",
    )
    plan.add_argument("--model", default="kimi-k2", choices=sorted(MODEL_SHAPES), help="routed-expert shape preset")
    plan.add_argument("--ranks", type=_positive, default=8, help="EP ranks R")
    plan.add_argument("--tokens", type=_positive, default=4096, help="tokens per rank s")
    plan.add_argument("--maxvio", type=_non_negative, default=10.0,
                      help="target router imbalance max_e(T_e / mean T) - 1 (skewed routing; reported if out of reach)")
    plan.add_argument("--routing", default="skewed", choices=["skewed", "local", "next", "one", "duplicate"],
                      help="skewed (lognormal expert popularity at --maxvio) or an adversarial routing")
    plan.add_argument("--policy", default="exact", choices=POLICIES, help="balancing policy")
    plan.add_argument("--cost", default=None, metavar="PROFILE",
                      help="cost profile of --policy auto: a preset (generic, h200) or a JSON file from "
                      "'flatep calibrate --out' (None: generic)")
    plan.add_argument("--align", type=_positive, default=128, help="rows each expert group is padded to a multiple of")
    plan.add_argument("--tolerance", type=_non_negative, default=0.0,
                      help="rank imbalance exact lets pass without moving weights (EPConfig.tolerance)")
    plan.add_argument("--seed", type=int, default=1234, help="seed of the routing")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    plan.add_argument("--plot", metavar="FILE.png", default=None,
                      help="draw per-rank load before/after into FILE.png (.png added when FILE has no suffix; needs matplotlib)")
    plan.set_defaults(run=_plan_command)
    bench = commands.add_parser(
        "bench", formatter_class=formatter,
        help="sweep tokens per rank and router skew; write results, summary and plots",
        description="Sweep tokens per rank and router imbalance over the arms of a config (flat = policy exact, "
        "classic = policy none, auto = the plan the cost model predicts fastest, dense = one device without EP) "
        "on virtual ranks of one device, and write "
        "results.jsonl, summary.md and plots (plots need matplotlib). For one process per rank use "
        "'torchrun --nproc-per-node N -m flatep.bench.distributed'.",
    )
    bench.add_argument("config", nargs="?", default=None,
                       help="sweep config: a shipped name (default, kimi-k3, cpu, tiny) or a YAML path; "
                       "None means 'default' on a GPU, 'cpu' otherwise")
    bench.add_argument("--out", default="bench-out", help="output folder")
    bench.add_argument("--resume", action="store_true",
                       help="skip cells already in OUT/results.jsonl (refused if they come from another config)")
    bench.add_argument("--report", metavar="RESULTS.jsonl", default=None,
                       help="only write summary.md and plots from a results file (into --out if given, else beside it)")
    bench.add_argument("--device", default=None, choices=["cuda", "cpu"], help="None means cuda if available, else cpu")
    bench.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"],
                       help="kernels: auto = Triton on a GPU, the plain-torch paths on the CPU")
    bench.add_argument("--weights", default=None, choices=list(WEIGHT_FORMATS),
                       help="weight format of the expert pool, overriding the config's weights key (None: the config's)")
    bench.add_argument("--dispatch", default=None, choices=list(DISPATCH_FORMATS),
                       help="dtype of the rows the EP arms dispatch (fp8: e4m3 with a scale per 128 columns), "
                       "overriding the config's dispatch key (None: the config's)")
    bench.add_argument("--cost", default=None, metavar="PROFILE",
                       help="cost profile of the auto arm and of the model predictions: a preset (generic, h200) or a "
                       "JSON file from 'flatep calibrate --out', overriding the config's cost key (None: the config's)")
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
