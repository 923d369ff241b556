"""Timing and the ceilings every figure is compared with, measured in the same run."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median, fastest and slowest of ``iters`` timed calls, in µs."""

    median: float
    min: float
    max: float


def experts_outputs(shards: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Output buffers for timing :func:`flatep.layer.experts_step` over each of ``shards``
    (``[n, rows, H]`` or ``[rows, H]``; the rows may differ) again and again, so that every replay
    computes on the dispatched rows: views of one buffer shaped like the tallest shard, which the
    timed calls share (they run one at a time, and nothing reads what they write).

    In place, as the layer runs (each step dispatches fresh rows), a replay would take the previous
    one's outputs as its rows, which shrink replay by replay (to 1e-19 and below after 20 replays
    of a small random pool on the CPU), and on which the fp8 activation quantization's correctly
    rounded division took its slow path (for zero dividends: bench/results/2026-12-06-h100-h): in
    a Kimi-K2 rank's profile at s = 8192 on an H100 it took 1009 us in place
    (bench/results/2026-12-06-h100-c), and 733 us on the dispatched rows (2026-12-06-h100-g)."""
    tallest = max(shards, key=lambda shard: shard.shape[-2])
    buffer = torch.empty_like(tallest)
    return [buffer[..., :shard.shape[-2], :] for shard in shards]


def time_us(
    fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10, graph: bool = False, calls: int = 1
) -> float:
    """Median time of one ``fn()`` call in microseconds (see :func:`time_stats`)."""
    return time_stats(fn, device, warmup, iters, graph, calls).median


def time_stats(
    fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 10, graph: bool = False, calls: int = 1
) -> Timing:
    """Median and spread (min, max) over ``iters`` timed ``fn()`` calls, in microseconds.

    With ``graph=True`` on CUDA, ``fn`` (which must be capturable: no host syncs) runs once eagerly
    to compile its kernels, is captured ``calls`` times back to back into one CUDA graph, replayed
    ``max(warmup, 1)`` times untimed (clocks and caches settle), and each
    of ``iters`` replays is bracketed by CUDA events and divided by ``calls``: GPU time with the
    launch gaps inside the graph, without host launch overhead (what a CUDA-graph serving step
    sees). Otherwise each eager call is bracketed by CUDA events (GPU time, which includes waiting
    for the host when launches are slower than the kernels), or by ``time.perf_counter`` on CPU.
    """
    return time_interleaved([fn], device, warmup, iters, graph, calls)[0]


def time_interleaved(
    fns: Sequence[Callable[[], object]], device: torch.device, warmup: int = 3, iters: int = 10, graph: bool = False,
    calls: int = 1,
) -> list[Timing]:
    """:func:`time_stats` of several functions at once, their timed calls interleaved.

    Each of ``iters`` rounds times every function once, the round's order rotated by one each
    round (round ``i`` starts with function ``i % n``). A GPU's clocks drift over tens of
    milliseconds (power and temperature); timed one after another, two functions doing the same
    work were seen 15% apart on the H200, while interleaved every function sees the same drift.
    With ``graph=True`` on CUDA every function's graph is captured (and kept) before the first
    round, so their memory is held together.

    Returns:
        one :class:`Timing` per function, in the order of ``fns``.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if not fns:
        raise ValueError("fns must hold at least one function")
    on_gpu = device.type == "cuda"
    runs, per_run = list(fns), 1
    if graph and on_gpu:
        runs, per_run = [_captured(fn, calls).replay for fn in fns], calls
    for _ in range(max(warmup, 1) if graph and on_gpu else warmup):
        for run in runs:
            run()
    if on_gpu:
        torch.cuda.synchronize(device)
    samples: list[list[float]] = [[] for _ in runs]
    for round_index in range(iters):
        for step in range(len(runs)):
            index = (round_index + step) % len(runs)
            samples[index].append(_timed_us(runs[index], on_gpu) / per_run)
    return [_summary(values) for values in samples]


def _timed_us(run: Callable[[], object], on_gpu: bool) -> float:
    """One call's time in µs: CUDA events around it on a GPU (GPU time), the host clock otherwise."""
    if not on_gpu:
        start_time = time.perf_counter()
        run()
        return (time.perf_counter() - start_time) * 1e6
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def _summary(samples: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples))


def _captured(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """``fn`` run once eagerly (compiles its kernels, allocates cached buffers outside the
    capture), then captured ``calls`` times back to back into one CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def copy_ceiling_gbps(device: torch.device, megabytes: int = 1024) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    elements = megabytes * 2**20 // 2
    source = torch.randn(elements, device=device).to(torch.bfloat16)
    target = torch.empty_like(source)
    elapsed = time_us(lambda: target.copy_(source), device, warmup=3, iters=10)
    return 2 * source.numel() * source.element_size() / elapsed / 1e3


def gemm_ceiling_tflops(device: torch.device, size: int = 8192, dtype: torch.dtype = torch.bfloat16) -> float:
    """Dense ``size^3`` matrix product rate on random data, TFLOP/s."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    elapsed = time_us(lambda: a @ b, device, warmup=2, iters=5)
    return 2 * size**3 / elapsed / 1e6


def device_name(device: torch.device) -> str:
    """A short hardware name for labels: the GPU's name, or the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)"


def read_ceiling_gbps(device: torch.device, megabytes: int = 4096) -> float:
    """Device-memory read bandwidth in GB/s: an fp32-accumulated sum over ``megabytes`` of bf16
    (reads only, as streaming expert weights does; large enough that no cache holds it)."""
    data = torch.randn(megabytes * 2**20 // 2, device=device, dtype=torch.bfloat16)
    elapsed = time_us(lambda: data.sum(dtype=torch.float32), device, warmup=2, iters=10, graph=True)
    return data.numel() * data.element_size() / elapsed / 1e3
