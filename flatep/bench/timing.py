"""Timing and the ceilings every figure is compared with, measured in the same run."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Timing:
    """Median, fastest and slowest of ``iters`` timed calls, in µs."""

    median: float
    min: float
    max: float


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
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if graph and device.type == "cuda":
        return _summary(_graph_samples_us(fn, calls, iters, warmup))
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
    else:
        for _ in range(iters):
            start_time = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start_time) * 1e6)
    return _summary(samples)


def _summary(samples: list[float]) -> Timing:
    return Timing(statistics.median(samples), min(samples), max(samples))


def _graph_samples_us(fn: Callable[[], object], calls: int, replays: int, warmup: int = 1) -> list[float]:
    fn()  # compiles the kernels and allocates cached buffers outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(max(warmup, 1)):
        graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / calls)
    return samples


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
