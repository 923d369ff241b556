"""``flatep calibrate``: measure a :class:`flatep.CostProfile` on the current GPU.

Measured, at the model's shapes:

* a rank's experts as the layer runs them (:func:`flatep.experts.grouped_swiglu`, bf16: the decode
  kernels at few rows per group, ``torch._grouped_mm`` beyond) over its ``G = E/R`` groups of
  ``n`` rows each, for ``n`` from 1 to 4096: per-group time ``t(n)``;
* HBM read bandwidth: a sum over 4 GiB of bf16 (reads only, as weight streaming does);
* link bandwidth: a copy from this GPU to a peer GPU when one exists (otherwise the ``base``
  profile's value is kept, and said so); with ``link="local"``, a copy within this GPU instead:
  the "link" of virtual ranks that share it (the local transport's pushes, dispatch and combine
  are copies in its memory), for a profile of the system a one-GPU sweep measures.

Fitted (:func:`fit_profile`, plain arithmetic tested with a fake timer): ``hbm_gbps`` from the read;
then ``tile_rows`` (64/128/256) and ``group_us`` together, as the pair whose model has the least
squared relative error over every measured ``n``, ``gemm_tflops`` following from the largest ``n``
given them. ``group_us`` is searched between 0.1 us and the one-row time less the weight read
(``t(1) - expert_bytes / hbm``, which alone would fit only ``n = 1``: on the H200
``torch._grouped_mm`` streams weights faster at 128 rows per group than at 1). ``push_us`` is
kept from ``base`` (it needs a multi-rank step to measure); ``base`` is the shipped profile of the
device when there is one (``h200`` on an H200), else the generic one.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flatep.config import MODEL_SHAPES, EPConfig, preset

# Rows that are not multiples of every candidate tile, so that the tile size shows in the times.
ROWS = (1, 16, 64, 128, 256, 320, 512, 1024, 1088, 2048, 2112, 4096)
TILES = (64, 128, 256)
READ_BYTES = 2**32
LINK_BYTES = 2**28
MIN_GROUP_US = 0.1
GROUP_STEPS = 200  # candidate group times searched by the fit


@dataclass(frozen=True)
class Measurement:
    """One timed operation: ``kind`` (``gemm``, ``read``, ``link``), its parameters, and ``make()``,
    which allocates its inputs and returns the function to time."""

    kind: str
    params: dict
    make: Callable[[], Callable[[], object]]


Timer = Callable[[Measurement], float]
"""Microseconds of one call of a measurement's function (a fake in tests)."""


def _event_timer(device) -> Timer:
    from flatep.bench.timing import time_us

    def timer(measurement: Measurement) -> float:
        return time_us(measurement.make(), device, warmup=3, iters=20)

    return timer


def _gemm(config: EPConfig, groups: int, rows: int, device) -> Measurement:
    import torch

    from flatep.experts.grouped import grouped_swiglu

    def make() -> Callable[[], object]:
        hidden, intermediate = config.hidden, config.intermediate
        x = torch.randn(groups * rows, hidden, device=device, dtype=torch.bfloat16)
        route_weights = torch.rand(groups * rows, device=device)
        w13 = torch.randn(groups, 2 * intermediate, hidden, device=device, dtype=torch.bfloat16) * hidden**-0.5
        w2 = torch.randn(groups, hidden, intermediate, device=device, dtype=torch.bfloat16) * intermediate**-0.5
        offs = torch.arange(1, groups + 1, device=device, dtype=torch.int32) * rows
        # The experts as the layer runs them (its kernels switch with the rows per group).
        return lambda: grouped_swiglu(x, route_weights, w13, w2, offs)

    return Measurement("gemm", {"groups": groups, "rows": rows}, make)


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


def fit_profile(
    config: EPConfig,
    gemm_us: dict[int, float],
    groups: int,
    read_gbps: float,
    link_gbps: float | None,
    base,
    name: str,
):
    """The profile that the measurements imply.

    Args:
        config: the model's shapes.
        gemm_us: rows per group ``n`` -> time of the grouped GEMMs over ``groups`` groups (us).
        groups: groups per measured GEMM.
        read_gbps: HBM read bandwidth (GB/s).
        link_gbps: measured link bandwidth, or None to keep ``base``'s.
        base: the :class:`flatep.CostProfile` whose unmeasured fields are kept.
        name: the new profile's label.
    """
    from flatep.plan.cost import CostProfile

    if 1 not in gemm_us or len(gemm_us) < 2:
        raise ValueError(f"gemm_us must hold n=1 and at least one larger n, got {sorted(gemm_us)}")
    per_group = {rows: us / groups for rows, us in gemm_us.items()}
    flops_per_row = 2 * 3 * config.hidden * config.intermediate
    weight_us = config.expert_bytes() / (read_gbps * 1e3)
    largest = max(per_group)
    one_row = max(per_group[1] - weight_us, MIN_GROUP_US)
    group_choices = sorted({one_row, *(MIN_GROUP_US + (one_row - MIN_GROUP_US) * step / GROUP_STEPS for step in range(GROUP_STEPS))})

    def fit(tile: int, group_us: float) -> tuple[float, float]:
        # Compute time per row from the largest n in whole tiles; error of the model over all n.
        padded = math.ceil(largest / tile) * tile
        row_us = max(per_group[largest] - group_us, 1e-9) / padded
        error = sum(
            (group_us + max(weight_us, math.ceil(rows / tile) * tile * row_us) - us) ** 2 / us**2
            for rows, us in per_group.items()
        )
        return error, row_us

    # Ties (equal error) go to the smaller tile, then the larger group time.
    tile, group_us = min(((size, group) for size in TILES for group in group_choices),
                         key=lambda pair: (fit(*pair)[0], pair[0], -pair[1]))
    row_us = fit(tile, group_us)[1]
    return CostProfile(
        link_gbps=base.link_gbps if link_gbps is None else link_gbps,
        hbm_gbps=read_gbps,
        gemm_tflops=flops_per_row / (row_us * 1e6),
        group_us=group_us,
        push_us=base.push_us,
        tile_rows=tile,
        name=name,
    )


LINKS = ("peer", "local")


def calibrate(
    config: EPConfig, device, timer: Timer | None = None, base=None, log: Callable[[str], None] = print,
    link: str = "peer",
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

    Raises:
        ValueError: on a CPU device with the default timer (nothing meaningful to measure there),
            or for a ``link`` not in :data:`LINKS`.
    """
    import torch

    from flatep.plan.cost import CostProfile

    if link not in LINKS:
        raise ValueError(f"link must be one of {list(LINKS)}, got {link!r}")
    device = torch.device(device)
    if timer is None:
        if device.type != "cuda":
            raise ValueError(f"calibrate measures a GPU: device must be a CUDA device, got {device} "
                             "(on CPU use CostProfile.default())")
        timer = _event_timer(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    if base is None:
        base = CostProfile.preset("h200") if "H200" in name else CostProfile.default()
    # A rank's groups: how many run side by side decides how fast their weights stream.
    groups = config.experts_per_rank
    gemm_us = {}
    for rows in ROWS:
        gemm_us[rows] = timer(_gemm(config, groups, rows, device))
        log(f"grouped GEMM, {groups} groups x {rows:5d} rows: {gemm_us[rows]:9.1f} us")
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
    return fit_profile(config, gemm_us, groups, read_gbps, link_gbps, base, name)


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
    parser.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    import json

    profile = calibrate(preset(args.model, ranks=args.ranks), args.device, link=args.link)
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
