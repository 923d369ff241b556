"""Every rank's experts phase alone, for a sweep config's packed pool and its bf16 twin, and, with
``--against REV``, for the packed GEMMs of another git revision on the same inputs.

    python -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml --against HEAD~1 --out experts.json

The figure is the sweep's ``experts max`` (:mod:`flatep.bench.sweep`): per cell (s, maxvio) of the
config, the arm's plan is made and dispatched as there, every rank's
:func:`flatep.layer.experts_step` is timed (CUDA-graph replays on the GPU, ``graph_calls`` copies
per graph, writing into a buffer of its own so that every replay computes on the dispatched rows:
:func:`flatep.bench.timing.experts_outputs`) with the variants interleaved replay by replay
(:func:`flatep.bench.timing.time_interleaved`), and the slowest rank's median is kept. The variants
are this tree's packed GEMMs (``packed``), another revision's (``against``: its
``flatep/kernels/`` loaded beside this one, or a copy of that directory, or a copy of its
``quant_gemm.py`` alone, :func:`revision_gemms`; its ``fp8_grouped_mm_triton``,
``mxfp4_grouped_mm_triton`` and ``packed_launches`` called where this tree calls its own),
and, with ``--in-turn``, this tree's with each GEMM's launches one after another on one stream
instead of side by side (``in_turn``, :mod:`flatep.kernels.streams`), then the bf16 pool
(``bf16``), whose times divide the others' (``ratio``). The bf16 pool is made after the packed one
is freed, so a variant's ratio compares times not taken interleaved, while ``packed``,
``against`` and ``in_turn`` run interleaved. Bytes: the slowest rank's experts read each expert
with rows once, its packed values and scales (bf16: its bf16 weights), as the sweep's ``read%``
counts them; each variant's read rate is shown beside the device's read ceiling measured in the
same run (:func:`flatep.bench.timing.read_ceiling_gbps`; GPU only). The shard's rows that
dispatch does not write hold NaN (:func:`dispatch_into_nan`), as a reused buffer may.
``--profile`` adds the slowest rank's time per kernel (eager calls under :mod:`torch.profiler`: the
kernels' own times, without the launch gaps that the graph replays include).

``--dispatch fp8`` (or the config's ``dispatch: fp8``) dispatches the packed pool's rows as
``ep_moe(dispatch_dtype=torch.float8_e4m3fn)`` does: quantized per token at the source, so fp8
experts read the packed rows as they arrive and quantize nothing themselves (mxfp4 experts get
them unpacked), while the bf16 pool keeps bf16 dispatch, the baseline. The quantization then
happens in dispatch, once per token instead of once per dispatched row: each variant's dispatch
step (all ranks) is timed too (``dispatch_us``, CUDA-graph replays), so that both homes of the
work show.

Each JSON row names the code that ran twice: ``commit`` (``git rev-parse`` where the command runs,
which a copied working tree with an older history misreports) and ``source``
(:func:`source_digest` of the ``flatep`` package that ran).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import flatep.experts.grouped as grouped
from flatep.bench.sweep import Cell, Sweep, _random_weights, _set_up_arm, arm_policy, known_arms, resolve_backend
from flatep.bench.timing import device_name, experts_outputs, read_ceiling_gbps, time_interleaved
from flatep.kernels.fp8_rows import packs_rows
from flatep.kernels.streams import in_turn
from flatep.layer import dispatch_step, experts_step, packed_buffer, packed_rows, reads_packed_rows
from flatep.plan.reference import make_plan
from flatep.plan.triton import make_plan_triton, supports_triton_planner
from flatep.plan.types import Layout
from flatep.quant import pool_layout
from flatep.transport.base import Group

PACKED_GEMMS = ("fp8_grouped_mm_triton", "mxfp4_grouped_mm_triton", "packed_launches")
"""The functions that ``--against`` swaps for another revision's: the GEMMs of
:mod:`flatep.kernels.quant_gemm` and the launches' tiles of :mod:`flatep.kernels.packed_tiles` (a
revision's tiles may name options its GEMMs lack). Revisions before ``packed_tiles.py`` existed
hold all three in ``quant_gemm.py``."""


IN_TURN = {"side_by_side": in_turn}
"""The ``in_turn`` variant's swap: a GEMM's launches one after another on one stream instead of
side by side (:mod:`flatep.kernels.streams`)."""


def revision_gemms(revision: str, repository: Path = Path(".")) -> dict[str, Callable]:
    """The :data:`PACKED_GEMMS` of ``flatep/kernels/quant_gemm.py`` at git ``revision`` of ``repository``,
    with every module of that revision's ``flatep/kernels/`` beside it (its kernels, tiles and launch
    constants, not this tree's); or, where ``revision`` names a directory, of the copy of
    ``flatep/kernels/`` there; or, where it names a ``.py`` file, of that copy of ``quant_gemm.py``
    alone, which then imports this tree's other kernel modules.

    The modules are written to a temporary directory as a package of their own, their imports of
    ``flatep.kernels`` pointed at it (Triton compiles a kernel from its source file when first
    called, so the directory is removed only when the process exits); the rest of flatep
    (``flatep.quant``, ``flatep.config``, ...) comes from this tree.

    Raises:
        ValueError: if ``revision`` is neither a file, a directory holding ``quant_gemm.py``, nor a
            revision where git can show ``flatep/kernels/``.
    """
    package = f"flatep_kernels_at_{uuid.uuid4().hex[:12]}"  # a fresh name: no stale module of an earlier load
    if revision.endswith(".py") and Path(revision).is_file():
        sources = {"quant_gemm.py": Path(revision).read_text()}
    else:
        if Path(revision).is_dir():
            sources = {path.name: path.read_text() for path in Path(revision).glob("*.py")}
        else:
            sources = _kernel_sources(revision, repository)
        if "quant_gemm.py" not in sources:
            raise ValueError(f"--against {revision!r}: its kernels hold no quant_gemm.py")
        sources = {name: _into_package(text, package) for name, text in sources.items()}
    temporary = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, temporary, ignore_errors=True)
    directory = Path(temporary) / package
    directory.mkdir()
    for name, text in sources.items():
        (directory / name).write_text(text)
    init = directory / "__init__.py"
    if not init.exists():
        init.write_text("")
    spec = importlib.util.spec_from_file_location(package, init, submodule_search_locations=[str(directory)])
    sys.modules[package] = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(sys.modules[package])
        module = importlib.import_module(f"{package}.quant_gemm")
    except BaseException:
        for name in [name for name in sys.modules if name == package or name.startswith(f"{package}.")]:
            del sys.modules[name]
        raise
    # A revision's quant_gemm.py alone imports this tree's packed_tiles; a whole kernels directory its own.
    tiles = f"{package}.packed_tiles" if "packed_tiles.py" in sources else "flatep.kernels.packed_tiles"
    return {function: getattr(module, function) if hasattr(module, function)
            else getattr(importlib.import_module(tiles), function) for function in PACKED_GEMMS}


def _kernel_sources(revision: str, repository: Path) -> dict[str, str]:
    """The ``.py`` files of ``flatep/kernels/`` at git ``revision``, by file name."""
    def git(*command: str) -> str:
        shown = subprocess.run(["git", "-C", str(repository), *command], capture_output=True, text=True)
        if shown.returncode != 0:
            raise ValueError(f"--against {revision!r}: git cannot show flatep/kernels/ there: {shown.stderr.strip()}")
        return shown.stdout

    names = [Path(path).name for path in git("ls-tree", "--name-only", f"{revision}:flatep/kernels/").split()]
    return {name: git("show", f"{revision}:flatep/kernels/{name}") for name in names if name.endswith(".py")}


def _into_package(source: str, package: str) -> str:
    """``source`` with its imports from ``flatep.kernels`` (``from flatep.kernels.x import ...``, the
    only form the kernel modules use) pointed at ``package``."""
    return re.sub(r"^(\s*from\s+)flatep\.kernels\b", rf"\g<1>{package}", source, flags=re.MULTILINE)


def source_digest(root: Path = Path(__file__).resolve().parents[1]) -> str:
    """The first 12 hex digits of the SHA-256 of the ``.py`` files under ``root`` (default: the
    ``flatep`` package that runs), each file's path relative to ``root`` and its bytes, in path
    order: it names the code that made a result where the git history at hand is not that code's
    (a copied working tree). ``python -c "from flatep.bench.experts_phase import source_digest;
    print(source_digest())"`` in a checkout tells whether a result's ``"source"`` is that tree's."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root).as_posix()).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


@contextlib.contextmanager
def gemms_in_use(gemms: dict[str, Callable] | None) -> Iterator[None]:
    """Within the block, the experts call ``gemms`` (a :func:`revision_gemms` result, or
    :data:`IN_TURN`) instead of the functions of :mod:`flatep.experts.grouped` they name; None
    changes nothing."""
    saved = {function: getattr(grouped, function) for function in gemms or {}}
    try:
        for function, replacement in (gemms or {}).items():
            setattr(grouped, function, replacement)
        yield
    finally:
        for function, original in saved.items():
            setattr(grouped, function, original)


def _experts_calls(shard, shard_weights, out, pool, setup, rank: int, backend: str, gemms: dict[str, Callable] | None,
                   activations=None):
    def call() -> None:
        with gemms_in_use(gemms):
            experts_step(shard, shard_weights, pool, setup.plan, setup.group, rank, backend=backend, out=out,
                         activations=activations)
    return call


def dispatch_into_nan(
    x: torch.Tensor, weights: torch.Tensor, plan: Layout, group: Group, backend: str,
    dispatch_dtype: torch.dtype | None = None, unpack: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`flatep.layer.dispatch_step` into the step's shard buffers filled with NaN first.

    Dispatch writes only the real rows: a group's padding rows, the rows between home and slot
    rows of the split layout and the rows past the last group keep whatever a reused buffer held,
    NaN included (a freed packed pool's bytes read as bf16 hold some). The experts must not spend
    time on them, which the phase is timed to show. The first call finds the buffers (the group
    keeps them), the second writes the real rows into them after the fill. Once per cell, outside
    the timing. ``dispatch_dtype`` and ``unpack`` as :func:`flatep.layer.dispatch_step` takes them;
    with fp8 rows their packed buffer is filled with all-ones bytes first (NaN values and scales).

    Returns:
        ``(shard [n, rows, H], shard_weights [n, rows] fp32)`` as ``dispatch_step`` does.
    """
    shard, shard_weights = dispatch_step(x, weights, plan, group, backend, dispatch_dtype=dispatch_dtype, unpack=unpack)
    shard.fill_(float("nan"))
    shard_weights.fill_(float("nan"))
    if packs_rows(dispatch_dtype):
        packed_buffer(group, shard.shape[-2], shard.shape[-1]).fill_(-1)
    return dispatch_step(x, weights, plan, group, backend, dispatch_dtype=dispatch_dtype, unpack=unpack)


def kernel_times(call: Callable[[], None], device: torch.device, calls: int = 3) -> dict[str, float]:
    """GPU time per kernel name of one ``call()`` (µs; :mod:`torch.profiler` over ``calls`` eager
    calls after one untimed), slowest first; empty off CUDA. Kernels of one name add up."""
    if device.type != "cuda":
        return {}
    call()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            call()
        torch.cuda.synchronize(device)
    totals: dict[str, float] = {}
    for event in profiler.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total / calls
    return dict(sorted(totals.items(), key=lambda item: -item[1]))


def time_cells(
    sweep: Sweep, arm: str, cells: list[tuple[int, float]], device: torch.device, against: dict[str, Callable] | None,
    backend: str, profile: bool = False, launches_in_turn: bool = False,
) -> list[dict[str, Any]]:
    """Per cell ``(tokens, maxvio target)``: ``experts_us`` (per variant, every rank's median µs),
    ``experts_us_max`` (per variant, the slowest rank's), ``weight_bytes_read`` and
    ``read_fraction`` (per variant, the slowest rank's weight bytes and their rate over
    ``read_ceiling_gbps``, None off the GPU), ``ratio`` (per packed variant, its
    ``experts_us_max`` over bf16's), ``dispatch`` (the packed variants' dispatch format, see the
    module docstring) and ``dispatch_us`` (per variant, the median time of its dispatch step, all
    ranks); with ``profile``, ``kernels_us`` (per variant, the slowest rank's :func:`kernel_times`)."""
    timing = dict(device=device, warmup=sweep.warmup, iters=sweep.iters, graph=device.type == "cuda",
                  calls=sweep.graph_calls)
    ceiling = read_ceiling_gbps(device) if device.type == "cuda" else None

    config = sweep.ep_config(max(sweep.tokens))
    planner = make_plan_triton if device.type == "cuda" and supports_triton_planner(config) else make_plan
    results = {cell: {"tokens": cell[0], "maxvio_target": cell[1], "experts_us": {}} for cell in cells}
    formats = [sweep.weights] + ([] if sweep.weights == "bf16" else ["bf16"])
    for weights in formats:
        formatted = dataclasses.replace(sweep, weights=weights)
        pool, _, _ = _random_weights(config, device, [arm], weights)
        cost = formatted.cost_profile().with_expert_bytes(pool.expert_nbytes())
        variants = ({"bf16": None} if weights == "bf16" else
                    {"packed": None, **({"against": against} if against else {}),
                     **({"in_turn": IN_TURN} if launches_in_turn else {})})
        sent = None if weights == "bf16" else sweep.dispatch_dtype()  # the bf16 baseline dispatches bf16 rows
        direct = reads_packed_rows(pool, sent)
        for tokens, target in cells:
            cell = Cell(formatted, config, tokens, target, device)
            setup = _set_up_arm(config, cell, arm, planner, device, backend, cost, timing, sent, direct)
            shard, shard_weights = dispatch_into_nan(cell.x, cell.weights, setup.plan, setup.group, backend, sent,
                                                     unpack=not direct)
            activations = packed_rows(setup.group, shard) if direct else None
            [out] = experts_outputs([shard])  # every replay computes on the dispatched rows
            by_rank = [time_interleaved([_experts_calls(shard, shard_weights, out, pool, setup, rank, backend, gemms,
                                                        activations) for gemms in variants.values()], **timing)
                       for rank in range(config.ranks)]
            row = results[(tokens, target)]
            row["maxvio"] = cell.maxvio
            row["dispatch"] = sweep.dispatch
            row["read_ceiling_gbps"] = ceiling
            active_groups = setup.plan.active_groups().tolist()  # once per cell, outside the timing
            for index, variant in enumerate(variants):
                row.setdefault("dispatch_us", {})[variant] = setup.dispatch_t.median
                row["experts_us"][variant] = [times[index].median for times in by_rank]
                slowest = max(range(config.ranks), key=lambda rank: by_rank[rank][index].median)
                read = active_groups[slowest] * pool.expert_nbytes()
                row.setdefault("weight_bytes_read", {})[variant] = read
                row.setdefault("read_fraction", {})[variant] = (
                    read / by_rank[slowest][index].median / 1e3 / ceiling if ceiling else None)
                if profile:
                    row.setdefault("kernels_us", {})[variant] = kernel_times(
                        _experts_calls(shard, shard_weights, out, pool, setup, slowest, backend, variants[variant],
                                       activations), device)
            setup.group.close()
            del shard, shard_weights, out, activations, setup
        del pool
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for row in results.values():
        row["experts_us_max"] = {variant: max(times) for variant, times in row["experts_us"].items()}
        if "bf16" in row["experts_us_max"]:
            row["ratio"] = {variant: us / row["experts_us_max"]["bf16"] for variant, us in row["experts_us_max"].items()}
    return list(results.values())


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a sweep config: shipped name or YAML path (its model, ranks, weights, cells, timing)")
    parser.add_argument("--arm", default="classic", help="the arm whose plan runs (default classic)")
    parser.add_argument("--tokens", type=int, nargs="*", help="s values (default: the config's)")
    parser.add_argument("--maxvio", type=float, nargs="*", help="maxvio targets (default: the config's)")
    parser.add_argument("--against", metavar="REV",
                        help="also time the packed GEMMs of this git revision's flatep/kernels/ (or of a copy of "
                             "that directory, or of a copy of its quant_gemm.py alone)")
    parser.add_argument("--in-turn", action="store_true",
                        help="also time this tree's packed GEMMs with each GEMM's launches one after another")
    parser.add_argument("--backend", default="auto", help="kernels: auto, triton or torch")
    parser.add_argument("--dispatch", choices=["bf16", "fp8"],
                        help="the packed pool's dispatch format (default: the config's; bf16 experts keep bf16)")
    parser.add_argument("--profile", action="store_true",
                        help="also record the slowest rank's GPU time per kernel (torch.profiler, eager calls)")
    parser.add_argument("--out", type=Path, help="write the cells as JSON here")
    args = parser.parse_args(argv)
    if arm_policy(args.arm) is None:  # an unknown arm raises there, naming the known ones
        parser.error(f"--arm must be an EP arm (one of {[arm for arm in known_arms() if arm_policy(arm)]}), got {args.arm!r}")
    if any(tokens < 1 for tokens in args.tokens or []) or any(target < 0 for target in args.maxvio or []):
        parser.error(f"--tokens must be positive and --maxvio at least 0, got {args.tokens} and {args.maxvio}")
    sweep = Sweep.load(args.config)
    if args.dispatch:
        sweep = dataclasses.replace(sweep, dispatch=args.dispatch)
    if (args.against or args.in_turn) and sweep.weights == "bf16":
        parser.error(f"--against and --in-turn change the packed GEMMs: {args.config} runs bf16 experts, "
                     "which have none")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = resolve_backend(args.backend, device)
    cells = [(tokens, float(target)) for tokens in (args.tokens or sweep.tokens) for target in (args.maxvio or sweep.maxvio)]
    against = revision_gemms(args.against) if args.against else None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or None
    rows = time_cells(sweep, args.arm, cells, device, against, backend, args.profile, args.in_turn)
    identity = dict(config=args.config, model=sweep.model_name, weights=sweep.weights,
                    layout=pool_layout(sweep.weights), arm=args.arm, device=device_name(device),
                    backend=backend, commit=commit, source=source_digest(), against=args.against, timing="cuda_graph" if device.type == "cuda" else "eager")
    rows = [{**identity, **row} for row in rows]
    for row in rows:
        shown = ", ".join(f"{variant} {us:.1f}" + (f" ({row['ratio'][variant]:.3f}x)" if "ratio" in row else "")
                          + f" [{row['weight_bytes_read'][variant] / 1e9:.2f} GB"
                          + (f", {100 * row['read_fraction'][variant]:.0f}% of read" if row["read_ceiling_gbps"] else "")
                          + "]" for variant, us in row["experts_us_max"].items())
        ceiling = f"; read ceiling {row['read_ceiling_gbps']:.0f} GB/s" if row["read_ceiling_gbps"] else ""
        dispatched = ", ".join(f"{variant} {us:.1f}" for variant, us in row["dispatch_us"].items())
        layout = " (mma layout: fp8 activations)" if row["layout"] == "mma" else ""
        print(f"{sweep.model_name} {sweep.weights}{layout} s={row['tokens']} maxvio={row['maxvio_target']:g} "
              f"{args.arm}: slowest rank's experts, us [weight bytes read]: {shown}{ceiling}; "
              f"dispatch step (all ranks, {row['dispatch']} rows to the packed pool), us: {dispatched}", flush=True)
        for variant, kernels in row.get("kernels_us", {}).items():
            print(f"  {variant} kernels, us per call: " + ", ".join(f"{name[:40]} {us:.1f}" for name, us in kernels.items()))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
