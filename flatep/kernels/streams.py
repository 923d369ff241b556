"""Running a packed GEMM's launches side by side on CUDA streams.

At decode sizes a skewed step's packed grouped GEMM runs as several launches over disjoint groups
(:func:`flatep.kernels.packed_tiles.packed_launches`: short groups in short row tiles, hot groups in
tall ones). Each launch is a persistent grid whose programs take several tiles each, so its last
round of tiles leaves SMs idle; one after another on one stream, every launch pays that tail.
Forked onto streams of their own, the launches' programs take the SMs the others' tails leave free.

Measured on an H100 (bench/results/2026-12-06-h100-j, ``bench/scripts/launches_side_by_side.sh``,
interleaved with the launches in turn): a Kimi-K3 rank's mxfp4 experts took 13.3% less at s = 32
and 6.6% less at s = 128 under skew (maxvio 10), and on uniform routing the same within 1.5% (one
run); a Kimi-K2 rank's fp8 experts (two launches, the second small) the same time. In development runs (same
machine, not interleaved) the order mattered: with the first launch enqueued first on the current
stream, a uniform step (whose groups all sit in the second launch) took 2.5% longer than in turn,
so the other launches are enqueued first. The bf16 decode kernels' two launches
(:func:`flatep.kernels.decode_gemm.decode_launches`) stay one after another: side by side they took
2% longer at Kimi-K3, maxvio 10, in those runs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}


def _streams(device: torch.device, count: int) -> list[torch.cuda.Stream]:
    """``count`` streams of ``device``, made once and reused (a CUDA graph captures work on them
    through the fork and join of :func:`side_by_side`). Not the weight push's side stream
    (``flatep.layer``): a prefetched push may still run on that one while the experts compute."""
    made = _STREAMS.setdefault(device, [])
    while len(made) < count:
        made.append(torch.cuda.Stream(device=device))
    return made[:count]


def in_turn(launches: Sequence[Callable[[], object]], device: torch.device) -> None:
    """Call ``launches`` one after another on the current stream (``device`` unused: the signature
    of :func:`side_by_side`, which benchmarks swap it for)."""
    for launch in launches:
        launch()


def side_by_side(launches: Sequence[Callable[[], object]], device: torch.device) -> None:
    """Enqueue ``launches`` (callables that each enqueue kernels on the current stream) so that
    they may run at the same time, and make the current stream wait for all of them.

    On CUDA with two or more, each launch after the first is called on a stream of its own, forked
    from the current stream (so it starts after everything already queued there), then the first
    on the current stream; the current stream then waits for the others. No host
    synchronisation, and capturable in a CUDA graph. Elsewhere they run one after another.

    The launches must not write memory another one reads or writes. Memory they allocate stays
    on the stream that allocated it and is reused only after the join (the caching allocator
    keeps a block to its stream).
    """
    if device.type != "cuda" or len(launches) < 2:
        in_turn(launches, device)
        return
    current = torch.cuda.current_stream(device)
    sides = _streams(device, len(launches) - 1)
    for side in sides:
        side.wait_stream(current)
    for side, launch in zip(sides, launches[1:]):
        with torch.cuda.stream(side):
            launch()
    launches[0]()
    for side in sides:
        current.wait_stream(side)
