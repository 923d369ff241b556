"""One rank of the NVLink CUDA-graph check (spawned by test_nvlink_gpu.py; 2 processes may share one GPU).

Each rank runs a two-layer MoE step over an ``nvlink`` group made with ``eager_check=False``:
layer 2 routes on layer 1's output, so the whole step (routing, planning, dispatch, push,
experts, combine, both layers) is on the device. Suites:

* ``graph``: after one warm-up step, eager steps (several ``s`` and routings, one with fewer real
  tokens than ``s`` on some ranks) run under
  ``torch.cuda.set_sync_debug_mode("error")`` (any host synchronisation raises) and equal the
  dense MoE layer by layer; then the step is captured in one CUDA graph and every replay, over
  several new inputs (hence new routings), is bit-identical to the eager step on the same
  inputs; ``group.check()`` finds nothing.
* ``graph-fp8``: the ``graph`` suite with fp8 dispatch (``dispatch_dtype=torch.float8_e4m3fn``),
  against the dense MoE of the tokens as the ranks receive them (quantized, then dequantized).
* ``dead-rank``: after capture and one replay the last rank exits; the others replay again and
  ``group.check()`` must raise ``TimeoutError`` naming it.
* ``prefetch``: two layers with two slot sets, their plans made ahead; layer 2's experts are
  pushed (:func:`flatep.layer.prefetch_experts`) before layer 1 runs, with capped communication
  grids. Eager and replayed in a CUDA graph, it is bit-identical to the plain two-layer step.

Prints ``PASSED`` (exit 0) when every check of this rank passed.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from flatep import EPConfig, ExpertPool, dense_moe, ep_moe, init_group, plan_step, route
from flatep.kernels.fp8_rows import pack_rows_torch, unpack_rows_torch
from flatep.layer import prefetch_experts

CONFIG = EPConfig(ranks=2, experts=8, top_k=2, hidden=256, intermediate=128, capacity=64, align=16)


def make_layers(group):
    generator = torch.Generator(device="cuda").manual_seed(5)  # the same weights on every rank
    layers = []
    for _ in range(2):
        router = torch.randn(CONFIG.experts, CONFIG.hidden, device="cuda", generator=generator)
        w13 = (torch.randn(CONFIG.experts, 2 * CONFIG.intermediate, CONFIG.hidden, device="cuda", generator=generator) / 16).bfloat16()
        w2 = (torch.randn(CONFIG.experts, CONFIG.hidden, CONFIG.intermediate, device="cuda", generator=generator) / 11).bfloat16()
        layers.append((router, w13, w2, ExpertPool.from_weights(w13, w2, CONFIG, group)))
    return layers


def step(x, layers, group, routing_bias, real=None, dispatch_dtype=None):
    """Two layers; each routes on its own input (layer 2 on layer 1's output). Returns every layer's
    (input, ids, weights, output). ``real``: this rank's real tokens, when fewer than ``x``'s rows."""
    trace = []
    hidden = x
    for index, (router, _, _, pool) in enumerate(layers):
        ids, weights = route(hidden.float() @ router.T + routing_bias[index], CONFIG.top_k)
        plan = None if real is None else plan_step(ids, CONFIG, group, tokens=real, dtype=hidden.dtype,
                                                   dispatch_dtype=dispatch_dtype)
        out = ep_moe(hidden, ids, weights, group=group, pool=pool, plan=plan, dispatch_dtype=dispatch_dtype)
        trace.append((hidden, ids, weights, out))
        hidden = out
    return trace


def prefetch_suite(group, rank: int) -> list[str]:
    """The ``prefetch`` suite; returns its failures."""
    failures = []
    generator = torch.Generator(device="cuda").manual_seed(200 + rank)
    layers = []
    for layer, (_, w13, w2, _) in enumerate(make_layers(group)):
        first = torch.randint(0, 3, (CONFIG.capacity, 1), device="cuda", generator=generator, dtype=torch.int32)
        ids = torch.cat([first, (first + 1) % 3], dim=1)
        pool = ExpertPool.from_weights(w13, w2, CONFIG, group, layer=layer, slot_sets=2)
        layers.append((ids, pool, plan_step(ids, CONFIG, group), w13, w2))  # experts 0-2: rank 0 lends
    x = torch.randn(CONFIG.capacity, CONFIG.hidden, device="cuda", generator=generator).bfloat16()
    weights = torch.rand(CONFIG.capacity, CONFIG.top_k, device="cuda", generator=generator)

    def two_layers(prefetch):
        (ids0, pool0, plan0, _, _), (ids1, pool1, plan1, _, _) = layers
        ahead = prefetch_experts(pool1, plan1, comm_programs=3) if prefetch else None
        hidden = ep_moe(x, ids0, weights, group=group, pool=pool0, plan=plan0, comm_programs=3)
        return hidden, ep_moe(hidden, ids1, weights, group=group, pool=pool1, plan=plan1, comm_programs=3, pushed=ahead)

    plain = two_layers(False)[1]
    dense = dense_moe(dense_moe(x, layers[0][0], weights, layers[0][3], layers[0][4]).bfloat16(), layers[1][0], weights,
                      layers[1][3], layers[1][4])
    error = float((plain.double() - dense.double()).norm() / dense.double().norm())
    if not error < 3e-2:
        failures.append(f"prefetch suite: relative error {error:.2e} against the dense MoE")
    if not torch.equal(two_layers(True)[1], plain):
        failures.append("eager step with a prefetch differs from the plain one")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        two_layers(True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = two_layers(True)[1]
    for replay in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if not torch.equal(captured, plain):
            failures.append(f"prefetch replay {replay} differs from the plain step")
    group.check()
    return failures


def main() -> int:
    rank, world, suite = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), sys.argv[2]
    sent = torch.float8_e4m3fn if suite == "graph-fp8" else None
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=rank, world_size=world)
    group = init_group(transport="nvlink", barrier_timeout=5.0, eager_check=False)
    failures = []

    def log(message):
        print(f"[rank {rank}] {message}", flush=True)

    if suite == "prefetch":
        with torch.inference_mode():
            failures = prefetch_suite(group, rank)
        log("FAILED: " + "; ".join(failures) if failures else "PASSED")
        group.close()
        dist.destroy_process_group()
        return 1 if failures else 0
    with torch.inference_mode():
        layers = make_layers(group)
        generator = torch.Generator(device="cuda").manual_seed(100 + rank)
        bias = torch.zeros(2, CONFIG.experts, device="cuda")
        step(torch.randn(CONFIG.capacity, CONFIG.hidden, device="cuda", generator=generator).bfloat16(), layers, group, bias,
             dispatch_dtype=sent)
        torch.cuda.synchronize()
        # Eager steps without a single host synchronisation, at several s and skews; the last one
        # with fewer real tokens than s on every rank but the first, by rank.
        for tokens, skew, real in [(64, 0.0, None), (17, 4.0, None), (64, 8.0, None), (1, 2.0, None), (40, 4.0, 40 - 13 * rank)]:
            x = torch.randn(tokens, CONFIG.hidden, device="cuda", generator=generator).bfloat16()
            bias.copy_(torch.linspace(skew, 0, CONFIG.experts, device="cuda").expand(2, -1))
            torch.cuda.set_sync_debug_mode("error")
            try:
                trace = step(x, layers, group, bias, real, sent)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            for layer, (hidden, ids, weights, out) in enumerate(trace):
                if real is not None:
                    hidden, ids, weights, out = hidden[:real], ids[:real], weights[:real], out[:real]
                if sent is not None:  # the experts compute on the tokens as fp8 dispatch delivers them
                    hidden = unpack_rows_torch(pack_rows_torch(hidden), CONFIG.hidden, hidden.dtype)
                dense = dense_moe(hidden, ids, weights, layers[layer][1], layers[layer][2])
                error = float((out.double() - dense.double()).norm() / dense.double().norm())
                if not error < 2e-2:
                    failures.append(f"eager s={tokens} skew={skew} layer {layer}: relative error {error:.2e}")
        group.check()
        log(f"eager steps without host sync: {'ok' if not failures else failures}")
        # One CUDA graph holds both layers; replays over new inputs equal eager steps bit for bit.
        x = torch.randn(CONFIG.capacity, CONFIG.hidden, device="cuda", generator=generator).bfloat16()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(x, layers, group, bias, dispatch_dtype=sent)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step(x, layers, group, bias, dispatch_dtype=sent)[-1][-1]
        previous = None  # the last replay's output
        for replay in range(4):
            x.copy_(torch.randn(x.shape, device="cuda", generator=generator))
            bias.copy_(torch.randn(bias.shape, device="cuda", generator=generator) * 3)
            captured.fill_(float("nan"))
            graph.replay()
            if suite == "dead-rank" and replay == 1:
                torch.cuda.synchronize()
                if rank == world - 1:
                    log("exiting early, without telling anyone")
                    os._exit(0)
                time.sleep(1.0)  # let the last rank be gone, not merely late
                graph.replay()
                try:
                    group.check()
                except TimeoutError as error:
                    named = str(world - 1) in str(error)
                    log(f"TimeoutError after replay: {error}")
                    print("PASSED" if named else "FAILED: rank not named", flush=True)
                    os._exit(0 if named else 1)
                print("FAILED: no TimeoutError after a replay with a dead rank", flush=True)
                os._exit(1)
            eager = step(x, layers, group, bias, dispatch_dtype=sent)[-1][-1]
            if not torch.equal(captured, eager):
                failures.append(f"replay {replay} differs from eager")
            if previous is not None and torch.equal(captured, previous):
                failures.append(f"replay {replay} equals the previous one: the routing did not change")
            previous = captured.clone()
        group.check()
    log("FAILED: " + "; ".join(failures) if failures else "PASSED")
    group.close()
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
