"""``flatep calibrate``: measure a :class:`flatep.CostProfile` on the current GPU.

Measured, at the model's shapes:

* every rank's experts of planned steps, as the layer runs them (:func:`flatep.layer.experts_step`
  over a rank's home groups and borrowed slots, timed as CUDA-graph replays; bf16 experts, or
  the pool's packed format with ``--weights fp8`` / ``mxfp4``, whose GEMMs also decode): steps of
  ``s`` in :data:`STEP_TOKENS` tokens per rank, routed uniformly and with skew
  (:func:`flatep.routing.skewed_topk` with ``sigma`` in :data:`STEP_SIGMAS`: maxvio about 10 and
  30 at Kimi-K2, s = 128), planned under classic EP and exact balance. A rank's groups are of
  mixed sizes, as the model sees them; the decode kernels run at few rows per expert and
  ``torch._grouped_mm`` beyond, as in the layer. The sizes are those where ``auto`` evaluates the
  model: below about s = 64 at Kimi shapes it plans classic without it
  (:func:`flatep.plan.auto.moving_never_pays`), and there a rank's few groups (2-12 experts at
  s = 1) leave the kernels short of parallel work, which the per-group model does not describe;
* HBM read bandwidth: a sum over 4 GiB of bf16 (reads only, as weight streaming does);
* link bandwidth: a copy from this GPU to a peer GPU when one exists (otherwise the ``base``
  profile's value is kept, and said so); with ``link="local"``, a copy within this GPU instead:
  the "link" of virtual ranks that share it (the local transport's pushes, dispatch and combine
  are copies in its memory), for a profile of the system a one-GPU sweep measures.

Fitted (:func:`fit_profile`, plain arithmetic tested with a fake timer): ``hbm_gbps`` from the
read; then, over the ranks of the steps with more rows per expert than the decode kernels take,
``tile_rows`` (64/128/256), ``gemm_tflops`` and ``group_us`` together, as the triple whose model
has the least squared relative error; then over the decode steps ``decode_tile_rows`` (16 to
128), ``decode_gemm_tflops`` and ``decode_group_us`` the same way; then, per step size, the
decision ``margins`` from how far the ranks of one step are off against each other, for the
steps beyond the decode regime (:func:`fit_margins`). Calibrating on uniform groups instead
(every group of a rank holding ``n`` rows, ``n`` up to 4096) misled the model on the H200 at
Kimi-K2 shapes: it fitted 128-row tiles at 635 TFLOP/s, and put the layer's experts 10-22% too
slow at s >= 4096 and up to 24% too fast at s = 1024; planned steps fitted 256-row tiles at
734-795 TFLOP/s, within 15% of every rank. ``push_us`` is kept from ``base`` (it needs a multi-rank
step to measure); ``base`` is the shipped profile of the device when there is one (``h200`` on an
H200), else the generic one.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flatep.config import MODEL_SHAPES, EPConfig, preset, rows_per_expert
from flatep.quant.tensor import WEIGHT_FORMATS, check_format, expert_weight_nbytes

# Planned steps whose experts are timed: tokens per rank (few rows per expert to many) x router
# imbalance x policy (classic: home groups only; exact: home groups and borrowed slots).
STEP_TOKENS = (128, 256, 1024, 4096)
STEP_SIGMAS = (0.0, 1.0, 2.0)
STEP_POLICIES = ("none", "exact")
TILES = (64, 128, 256)
DECODE_TILES = (16, 32, 64, 128)
READ_BYTES = 2**32
LINK_BYTES = 2**28
MIN_GROUP_US = 0.1
# Candidate compute rates searched by the fit (TFLOP/s, ~1% apart) and the largest group time.
TFLOPS_GRID = tuple(50 * 1.01**step for step in range(400))
MAX_GROUP_US = 100.0
# The largest decision margin a calibration sets (a fraction of classic's time).
MAX_MARGIN = 0.5


@dataclass(frozen=True)
class Measurement:
    """One timed operation: ``kind`` (``experts``, ``read``, ``link``), its parameters, and
    ``make()``, which allocates its inputs and returns the function to time."""

    kind: str
    params: dict
    make: Callable[[], Callable[[], object]]


Timer = Callable[[Measurement], float]
"""Microseconds of one call of a measurement's function (a fake in tests)."""


def _event_timer(device) -> Timer:
    from flatep.bench.timing import time_us

    def timer(measurement: Measurement) -> float:
        # The experts as a serving step runs them: graph replays, no host launch overhead.
        return time_us(measurement.make(), device, warmup=3, iters=20, graph=measurement.kind == "experts")

    return timer


class _Steps:
    """The planned steps whose ranks' experts are timed, and the inputs their timings share."""

    def __init__(
        self, config: EPConfig, device, tokens: Sequence[int] = STEP_TOKENS, seed: int = 1234, weights: str = "bf16",
    ) -> None:
        import torch

        from flatep.bench.sweep import SharedWeightsGroup, sized_to_step
        from flatep.plan.reference import make_plan
        from flatep.plan.split import split_slot_rows
        from flatep.routing import skewed_topk

        self.config, self.device, self.weights = config, torch.device(device), weights
        self.group = SharedWeightsGroup(config.ranks, self.device)
        self.plans = []
        for step_tokens in tokens:
            for sigma in STEP_SIGMAS:
                ids = skewed_topk(config.ranks, config.experts, config.top_k, step_tokens, sigma, seed=seed,
                                  device=self.device)
                for policy in STEP_POLICIES:
                    plan = make_plan(ids, config.replace(capacity=max(config.capacity, step_tokens)), policy)
                    if policy == "none":
                        plan = sized_to_step(plan, config.align)
                    self.plans.append((step_tokens, sigma, policy, split_slot_rows(plan)))
        self._pool = None
        self._inputs: tuple | None = None

    def pool(self):
        """One rank's home experts and slots (shared by the virtual ranks), random values in the steps' weight format."""
        import torch

        from flatep.bench.sweep import fill_random
        from flatep.experts.pool import ExpertPool

        if self._pool is None:
            self._pool = ExpertPool(self.config, self.group, torch.bfloat16, weights=self.weights)
            fill_random({name: self._pool.home(name)[0] for name in self._pool.names}, self.config, self.weights)
            fill_random({name: self._pool.slots(name)[0] for name in self._pool.names}, self.config, self.weights)
        return self._pool

    def inputs(self, index: int):
        """Random rows and route weights of step ``index``'s shards, and the experts' output buffer
        (:func:`flatep.bench.timing.experts_outputs`: every timed call computes on the random
        rows), kept while its ranks are timed."""
        import torch

        from flatep.bench.timing import experts_outputs

        if self._inputs is None or self._inputs[0] != index:
            self._inputs = None  # free the previous step's shards first
            rows = self.plans[index][3].shard_rows  # split plans: home and slot halves
            shard = torch.randn(self.config.ranks, rows, self.config.hidden, device=self.device).to(torch.bfloat16)
            weights = torch.rand(self.config.ranks, rows, device=self.device)
            self._inputs = (index, shard, weights, *experts_outputs([shard]))
        return self._inputs[1:]

    def measurements(self) -> list[Measurement]:
        """One per (step, rank): its groups' rows in ``params``, the rank's experts to time in ``make``."""
        from flatep.layer import experts_step

        measurements = []
        for index, (tokens, sigma, policy, plan) in enumerate(self.plans):
            alloc = plan.alloc.cpu()
            for rank in range(self.config.ranks):
                groups = [int(rows) for rows in alloc[:, rank].tolist() if rows > 0]

                def make(index=index, plan=plan, rank=rank) -> Callable[[], object]:
                    pool = self.pool()
                    shard, weights, out = self.inputs(index)
                    return lambda: experts_step(shard, weights, pool, plan, self.group, rank, out=out)

                params = dict(tokens=tokens, sigma=sigma, policy=policy, rank=rank, groups=groups,
                              total_tokens=plan.total_tokens)
                measurements.append(Measurement("experts", params, make))
        return measurements


def _read(device) -> Measurement:
    import torch

    def make() -> Callable[[], object]:
        data = torch.randn(READ_BYTES // 2, device=device, dtype=torch.bfloat16)
        return lambda: data.sum(dtype=torch.float32)

    return Measurement("read", {"bytes": READ_BYTES}, make)


def _link(device, peer) -> Measurement:
    import torch

    def make() -> Callable[[], object]:
        source = torch.randn(LINK_BYTES // 2, device=device).to(torch.bfloat16)
        target = torch.empty_like(source, device=peer)
        return lambda: target.copy_(source, non_blocking=True)

    return Measurement("link", {"bytes": LINK_BYTES}, make)


@dataclass(frozen=True)
class GemmFit:
    """The GEMM term's constants fitted to measured ranks, and the worst relative error over them."""

    tile_rows: int
    row_us: float
    group_us: float
    worst: float


def fit_gemm(
    samples: list[tuple[list[int], float]], weight_us: float, tiles: Sequence[int], row_us: Sequence[float],
) -> GemmFit:
    """The ``(tile, row, group)`` whose GEMM term ``sum over groups of group + max(weight,
    ceil(n/tile)*tile*row)`` has the least squared relative error over ``samples``.

    Args:
        samples: per measured rank, the rows of its non-empty groups and its measured µs.
        weight_us: one expert's weight read, µs.
        tiles: candidate tile sizes.
        row_us: candidate compute times of one row, µs. For each tile and row time the best group
            time is closed-form (least squares, clamped to ``[MIN_GROUP_US, MAX_GROUP_US]``).
    """
    if not samples:
        raise ValueError("fit_gemm needs at least one measured rank")
    measured = np.array([us for _, us in samples])
    counts = np.array([len(groups) for groups, _ in samples], dtype=np.float64)
    rows = np.concatenate([np.asarray(groups, dtype=np.float64) for groups, _ in samples])
    owner = np.repeat(np.arange(len(samples)), counts.astype(np.int64))
    best = None
    for tile in tiles:
        padded = np.ceil(rows / tile) * tile
        for row in row_us:
            per_group = np.maximum(weight_us, padded * row)
            summed = np.bincount(owner, weights=per_group, minlength=len(samples))
            # error_i = (summed_i + counts_i * group) / measured_i - 1: linear in group.
            slope, offset = counts / measured, summed / measured - 1
            group = float(np.clip(-(slope @ offset) / (slope @ slope), MIN_GROUP_US, MAX_GROUP_US))
            errors = offset + slope * group
            score = float(errors @ errors)
            if best is None or score < best[0]:
                best = (score, GemmFit(tile, row, group, float(np.abs(errors).max())))
    return best[1]


def gemm_us(groups: Sequence[int], weight_us: float, fit: GemmFit) -> float:
    """The fitted GEMM term of one rank: ``sum over its groups of group + max(weight, ceil(n/tile)*tile*row)``."""
    padded = np.ceil(np.asarray(groups, dtype=np.float64) / fit.tile_rows) * fit.tile_rows
    return float(np.sum(fit.group_us + np.maximum(weight_us, padded * fit.row_us)))


def fit_margins(
    config: EPConfig, experts_us: list[tuple[dict, float]], weight_us: float, many: GemmFit,
) -> tuple[tuple[float, float], ...]:
    """``CostProfile.margins``: per measured step size, how far two ranks' times can be off against each other.

    Within one planned step (``tokens``, ``sigma``, ``policy``), every rank's measured time over the
    fitted GEMM term, divided by the step's median of that ratio, is the rank's own error (what a
    common factor, the same for every rank, leaves out). ``auto`` compares the busiest ranks of two
    plans, so the error of that comparison is about ``sqrt(2)`` times the ranks' root-mean-square
    error: that is the margin, per ``ceil(T*K/E)`` rows per expert of the measured steps.

    Only steps of the ``torch._grouped_mm`` regime get a margin (more rows per expert than the
    decode kernels take): that is where the H200 sweeps saw the model rate a moving plan faster
    than classic when it was slower (Kimi-K3, s = 1024: rank errors of 4-6% rms). In the decode
    regime the ranks are off by 1.5-2% rms, the size of a rank's timing noise, and a margin there
    turned a call the model had right into a miss (Kimi-K2, s = 128, maxvio 20: exact predicted
    0.8% faster than classic, measured 3.7% faster; ``bench/results/2026-12-04-h200-g``).
    """
    from flatep.plan.cost import few_rows_per_expert

    steps: dict[tuple, list[float]] = {}
    for params, us in experts_us:
        if few_rows_per_expert(config, params["total_tokens"]):
            continue
        key = (params["total_tokens"], params["sigma"], params["policy"])
        steps.setdefault(key, []).append(us / gemm_us(params["groups"], weight_us, many))
    deviations: dict[int, list[float]] = {}
    for (total_tokens, _, _), ratios in steps.items():
        median = float(np.median(ratios))
        deviations.setdefault(total_tokens, []).extend(ratio / median - 1 for ratio in ratios)
    return tuple(
        (float(rows_per_expert(total_tokens, config.top_k, config.experts)),
         min(MAX_MARGIN, math.sqrt(2 * float(np.mean(np.square(values))))))
        for total_tokens, values in sorted(deviations.items())
    )


def fit_profile(
    config: EPConfig,
    experts_us: list[tuple[dict, float]],
    read_gbps: float,
    link_gbps: float | None,
    base,
    name: str,
    weight_bytes: int | None = None,
):
    """The profile that the measurements imply.

    Args:
        config: the model's shapes.
        experts_us: per timed rank, its measurement's ``params`` (``groups``: rows of its non-empty
            groups; ``total_tokens``: the step's ``T``) and its time in µs.
        read_gbps: HBM read bandwidth (GB/s).
        link_gbps: measured link bandwidth, or None to keep ``base``'s.
        base: the :class:`flatep.CostProfile` whose unmeasured fields are kept.
        name: the new profile's label.
        weight_bytes: bytes of one expert as the timed pool stored it (packed fp8 / mxfp4 values and
            scales), or None for bf16; the profile keeps it as its ``expert_bytes``. A packed
            expert's GEMM also decodes its weights: what that costs beyond reading the bytes goes
            into the fitted per-group time.

    Raises:
        ValueError: unless both regimes (few and many rows per expert) were measured.
    """
    from flatep.plan.cost import CostProfile, few_rows_per_expert

    flops_per_row = 2 * 3 * config.hidden * config.intermediate
    weight_us = (config.expert_bytes() if weight_bytes is None else weight_bytes) / (read_gbps * 1e3)
    decode = [(params["groups"], us) for params, us in experts_us if few_rows_per_expert(config, params["total_tokens"])]
    grouped = [(params["groups"], us) for params, us in experts_us if not few_rows_per_expert(config, params["total_tokens"])]
    if not decode or not grouped:
        raise ValueError("experts_us must hold steps with few rows per expert (decode kernels) and with many; "
                         f"got {len(decode)} and {len(grouped)} ranks")
    rows_us = [flops_per_row / (tflops * 1e6) for tflops in TFLOPS_GRID]
    many, few = fit_gemm(grouped, weight_us, TILES, rows_us), fit_gemm(decode, weight_us, DECODE_TILES, rows_us)
    return CostProfile(
        link_gbps=base.link_gbps if link_gbps is None else link_gbps,
        hbm_gbps=read_gbps,
        gemm_tflops=flops_per_row / (many.row_us * 1e6),
        group_us=many.group_us,
        push_us=base.push_us,
        tile_rows=many.tile_rows,
        name=name,
        decode_gemm_tflops=flops_per_row / (few.row_us * 1e6),
        decode_group_us=few.group_us,
        decode_tile_rows=few.tile_rows,
        margins=fit_margins(config, experts_us, weight_us, many),
        expert_bytes=weight_bytes,
    )


LINKS = ("peer", "local")


def calibrate(
    config: EPConfig, device, timer: Timer | None = None, base=None, log: Callable[[str], None] = print,
    link: str = "peer", tokens: Sequence[int] = STEP_TOKENS, weights: str = "bf16",
):
    """Measure a :class:`flatep.CostProfile` on ``device`` at ``config``'s shapes.

    Args:
        config: the model's sizes (``H``, ``I``, ``E/R`` groups per GEMM).
        device: a CUDA device (``torch.device`` or string).
        timer: how to time a :class:`Measurement` (default: CUDA events, median of 20).
        base: profile whose unmeasured fields are kept (default: the ``h200`` preset on an H200,
            else :meth:`flatep.CostProfile.default`).
        log: where progress lines go.
        link: ``peer`` (a copy to a peer GPU where one is visible, else the base profile's value)
            or ``local`` (a copy within ``device``: virtual ranks sharing one GPU).
        tokens: tokens per rank of the planned steps whose experts are timed; they must include
            steps of at most 64 rows per expert (``ceil(R*s*K/E)``) and steps of more.
        weights: the experts' format (``bf16``, ``fp8``, ``mxfp4``): the steps run a pool in it, and
            the profile records its bytes per expert (``expert_bytes``). A profile fitted on one
            format is for layers in that format: packed GEMMs also decode their weights.

    Raises:
        ValueError: on a CPU device with the default timer (nothing meaningful to measure there),
            or for a ``link`` not in :data:`LINKS`.
    """
    import torch

    from flatep.plan.cost import CostProfile

    if link not in LINKS:
        raise ValueError(f"link must be one of {list(LINKS)}, got {link!r}")
    check_format(weights)
    device = torch.device(device)
    if timer is None:
        if device.type != "cuda":
            raise ValueError(f"calibrate measures a GPU: device must be a CUDA device, got {device} "
                             "(on CPU use CostProfile.default())")
        timer = _event_timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    if base is None:
        base = CostProfile.preset("h200") if "H200" in name else CostProfile.default()
    experts_us = []
    for measurement in _Steps(config, device, tokens, weights=weights).measurements():
        us = timer(measurement)
        experts_us.append((measurement.params, us))
        params = measurement.params
        log(f"experts, s={params['tokens']:5d} sigma {params['sigma']:g} {params['policy']:5s} rank {params['rank']}: "
            f"{len(params['groups']):3d} groups, {sum(params['groups']):6d} rows, {us:9.1f} us")
    read_us = timer(_read(device))
    read_gbps = READ_BYTES / read_us / 1e3
    log(f"HBM read: {read_gbps:.0f} GB/s")
    link_gbps = None
    peers = torch.cuda.device_count() if device.type == "cuda" else 0
    peer = next((other for other in range(peers) if other != device.index and torch.cuda.can_device_access_peer(device.index or 0, other)), None)
    if link == "local":
        link_gbps = LINK_BYTES / timer(_link(device, device)) / 1e3
        log(f"link of virtual ranks on {device} (a copy within it): {link_gbps:.0f} GB/s")
    elif peer is not None:
        link_gbps = LINK_BYTES / timer(_link(device, torch.device("cuda", peer))) / 1e3
        log(f"link to cuda:{peer}: {link_gbps:.0f} GB/s")
    else:
        log(f"no peer GPU: link_gbps kept from the {base.name} profile ({base.link_gbps} GB/s)")
    weight_bytes = None if weights == "bf16" else expert_weight_nbytes(weights, config.hidden, config.intermediate)
    return fit_profile(config, experts_us, read_gbps, link_gbps, base, name if weights == "bf16" else f"{name} ({weights})",
                       weight_bytes)


def add_calibrate_command(commands) -> None:
    """Register ``flatep calibrate`` on the CLI's sub-command parsers."""
    parser = commands.add_parser("calibrate", help="measure a cost profile (for policy='auto') on this GPU")
    parser.add_argument("--model", default="kimi-k2", choices=sorted(MODEL_SHAPES), help="shapes to measure at")
    parser.add_argument("--ranks", type=int, default=8, help="EP ranks (sets experts per rank = groups per GEMM)")
    parser.add_argument("--device", default="cuda", help="the GPU to measure on")
    parser.add_argument("--out", help="write the profile as JSON here (default: print it)")
    parser.add_argument("--link", choices=LINKS, default="peer",
                        help="peer: time a copy to a peer GPU (kept from the preset without one); local: a copy within "
                             "this GPU, the link of virtual ranks sharing it (profiles for one-GPU sweeps)")
    parser.add_argument("--weights", choices=WEIGHT_FORMATS, default="bf16",
                        help="the experts' format: a profile for layers whose pools hold fp8 or mxfp4 is fitted on them")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(STEP_TOKENS),
                        help="tokens per rank of the planned steps timed (some with at most 64 rows per expert, some more)")
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    profile = calibrate(preset(args.model, ranks=args.ranks), args.device, link=args.link, tokens=args.tokens,
                        weights=args.weights)
    if args.out:
        profile.save(args.out)
        print(f"wrote {args.out}")
    else:
        print(json.dumps(profile.to_dict(), indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m flatep.bench.calibrate``: the same as ``flatep calibrate``."""
    from flatep.cli import main as cli_main

    return cli_main(["calibrate", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
