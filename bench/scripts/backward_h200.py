"""The EP MoE backward at Kimi-K2 shapes on one H200: gradients against a dense layer, and layer time.

What it measures (R = 8 virtual ranks on one GPU, local transport; H=7168, E=384, K=8, I=2048, bf16):

(a) Gradients of ``x``, ``topk_weights``, ``w13`` and ``w2`` of one ``ep_moe`` step (policy
    ``exact``, s = 512 tokens per rank, a routing with maxvio about 10) against a dense (non-EP)
    layer's: every expert computed on its own tokens in fp32 from the same bf16 inputs, gradients
    by autograd. Printed and written: the relative Frobenius error ``||g - g_dense|| / ||g_dense||``
    of each gradient; it passes below ``TOLERANCE`` (1e-2: the gradients are returned in bf16, whose
    rounding alone is about 2e-3). Memory: the weight gradients are accumulated in fp32 (``[E, 2I, H]``
    is 45 GB, ``[E, H, I]`` 22.5 GB) beside the 33.8 GB of bf16 weights, so ``w13``'s and ``w2``'s
    gradients are taken in two backward passes (the first also gives ``x``'s and ``topk_weights``').
(b) Forward + backward time of the layer under policy ``exact`` (flat) and ``none`` (classic), at
    s in {1024, 4096, 8192} tokens per rank x maxvio in {0, 10, 20} (routings of
    :func:`flatep.routing.skewed_topk` at the sigma that :func:`flatep.routing.sigma_for_maxvio`
    finds; the maxvio reached is written). Eager steps (planning included), timed with CUDA events
    around ``ep_moe(...)`` and ``out.backward(grad)``; the median of ``--iters`` (default 3) after
    one warm-up step. Classic's shards are sized to the step's hottest rank, as the sweeps size them
    (:func:`flatep.bench.sweep.sized_to_step`: planned with ``plan_step``, inside the timed region,
    which then reads the plan's offsets on the host): sized for the worst case, ``R*s*K`` rows per
    virtual rank, eight virtual classic ranks do not fit on one GPU from s = 4096. This favours
    classic (a real classic rank sizes for the worst case or synchronises to learn its counts). Gradients are taken for ``x``, ``topk_weights`` and ``w2``; ``w13`` is frozen,
    because its fp32 gradient (45 GB, plus 22.5 GB in bf16) does not fit beside the weights and the
    activations of s = 8192 on one GPU: the timed backward therefore leaves out the ``dW13`` grouped
    GEMM (one of the six backward GEMMs, the size of the ``dx`` one). A cell that runs out of memory is
    recorded as such; cells left when the time budget (``--budget``, 380 s) is spent are recorded as skipped.

Writes ``backward_h200.json`` and ``backward_h200.md`` (a table) to ``$OUT`` (default ``./bench-out``).

    python bench/scripts/backward_h200.py            # on one H200: about 3-5 minutes
    python bench/scripts/backward_h200.py --tiny     # tiny shapes, on a CPU in seconds (plain-torch kernels)
"""
from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flatep import EPConfig, ep_moe, init_group, plan_step, preset  # noqa: E402
from flatep.bench.sweep import SIZED_TO_STEP, sized_to_step  # noqa: E402
from flatep.routing import maxvio, sigma_for_maxvio, skewed_topk  # noqa: E402

TOLERANCE = 1e-2
MAXVIO = [0.0, 10.0, 20.0]


def setup(tiny: bool) -> dict:
    """Sizes, device, dtype and backend of the run."""
    if tiny:
        config = EPConfig(ranks=4, experts=16, top_k=4, hidden=64, intermediate=32, capacity=64, align=8)
        return dict(config=config, check_tokens=32, tokens=[16, 64], device=torch.device("cpu"),
                    dtype=torch.float32, backend="torch")
    config = preset("kimi-k2", ranks=8, capacity=8192)
    return dict(config=config, check_tokens=512, tokens=[1024, 4096, 8192], device=torch.device("cuda"),
                dtype=torch.bfloat16, backend="auto")


@functools.lru_cache(maxsize=1)
def routing(config: EPConfig, tokens: int, target: float, device: torch.device) -> tuple[torch.Tensor, float]:
    """``([R, s, K] int32 ids, maxvio reached)`` for a maxvio ``target`` (the last one kept: both policies of a
    cell run on it)."""
    sigma, _ = sigma_for_maxvio(target, config.ranks, config.experts, config.top_k, tokens, device=device)
    ids = skewed_topk(config.ranks, config.experts, config.top_k, tokens, sigma, device=device).to(torch.int32)
    return ids, maxvio(ids, config.experts)


def weights(config: EPConfig, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]`` in ``dtype``, drawn in chunks (no fp32 copy of the whole tensor)."""
    generator = torch.Generator(device=device).manual_seed(0)
    w13 = torch.empty(config.experts, 2 * config.intermediate, config.hidden, device=device, dtype=dtype)
    w2 = torch.empty(config.experts, config.hidden, config.intermediate, device=device, dtype=dtype)
    for start in range(0, config.experts, 32):
        chunk = slice(start, start + 32)
        w13[chunk] = torch.randn(w13[chunk].shape, device=device, generator=generator) * config.hidden**-0.5
        w2[chunk] = torch.randn(w2[chunk].shape, device=device, generator=generator) * config.intermediate**-0.5
    return w13, w2


def dense_gradients(ids, x, topk_weights, w13, w2, grad_out, names):
    """Yield ``(name, expert or None, dense gradient)``: every expert on its own tokens, in fp32, by autograd.

    ``x`` and ``topk_weights`` gradients are yielded once at the end (expert ``None``), the weight
    gradients expert by expert (so that no ``[E, ...]`` fp32 tensor is held).
    """
    ranks, tokens, hidden = x.shape
    top_k = ids.shape[-1]
    intermediate = w2.shape[-1]
    flat_ids = ids.reshape(-1).long()
    grad_x = torch.zeros(ranks * tokens, hidden, dtype=torch.float32, device=x.device)
    grad_weights = torch.zeros(ranks * tokens * top_k, dtype=torch.float32, device=x.device)
    rows_x = x.reshape(-1, hidden).float()
    rows_grad = grad_out.reshape(-1, hidden).float()
    route = topk_weights.reshape(-1).float()
    for expert in range(w13.shape[0]):
        entries = (flat_ids == expert).nonzero().squeeze(1)
        token = entries // top_k
        inputs = rows_x[token].requires_grad_()
        weight = route[entries].requires_grad_()
        up = w13[expert].float().requires_grad_()
        down = w2[expert].float().requires_grad_()
        projected = inputs @ up.T
        activated = F.silu(projected[:, :intermediate]) * projected[:, intermediate:]
        out = weight.unsqueeze(1) * (activated @ down.T)
        dx, dw, dup, ddown = torch.autograd.grad(out, (inputs, weight, up, down), rows_grad[token])
        grad_x.index_add_(0, token, dx)
        grad_weights[entries] = dw
        if "w13" in names:
            yield "w13", expert, dup
        if "w2" in names:
            yield "w2", expert, ddown
    if "x" in names:
        yield "x", None, grad_x.view(ranks, tokens, hidden)
    if "topk_weights" in names:
        yield "topk_weights", None, grad_weights.view(ranks, tokens, top_k)


def check_gradients(run: dict, w13: torch.Tensor, w2: torch.Tensor) -> dict:
    """(a): relative Frobenius errors of the EP gradients against the dense layer's."""
    config, device, dtype = run["config"], run["device"], run["dtype"]
    tokens = run["check_tokens"]
    group = init_group("local", ranks=config.ranks, device=device)
    ids, reached = routing(config, tokens, 10.0, device)
    generator = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(config.ranks, tokens, config.hidden, device=device, generator=generator).to(dtype)
    topk_weights = torch.rand(config.ranks, tokens, config.top_k, device=device, generator=generator) + 0.1
    grad_out = torch.randn(config.ranks, tokens, config.hidden, device=device, generator=generator).to(dtype)
    errors = {}
    for names in (("x", "topk_weights", "w13"), ("w2",)):  # two passes: one fp32 weight gradient at a time
        leaves = {"x": x, "topk_weights": topk_weights, "w13": w13, "w2": w2}
        leaves = {name: t.detach().requires_grad_(name in names) for name, t in leaves.items()}
        out = ep_moe(leaves["x"], ids, leaves["topk_weights"], leaves["w13"], leaves["w2"], config=config, group=group,
                     policy="exact", backend=run["backend"])
        got = dict(zip(names, torch.autograd.grad(out, [leaves[n] for n in names], grad_out)))
        del out
        squares = {name: [0.0, 0.0] for name in names}
        for name, expert, expected in dense_gradients(ids, x, topk_weights, w13, w2, grad_out, names):
            mine = got[name].float() if expert is None else got[name][expert].float()
            squares[name][0] += float((mine - expected).square().sum())
            squares[name][1] += float(expected.square().sum())
        errors.update({name: (diff / max(norm, 1e-30)) ** 0.5 for name, (diff, norm) in squares.items()})
        del got
    return dict(tokens=tokens, maxvio=reached, policy="exact", tolerance=TOLERANCE, relative_error=errors,
                passed=all(error < TOLERANCE for error in errors.values()))


def time_cell(run: dict, w13: torch.Tensor, w2: torch.Tensor, group, tokens: int, target: float, policy: str,
              iters: int) -> dict:
    """(b): median forward + backward milliseconds of one (s, maxvio, policy) cell."""
    config, device, dtype = run["config"], run["device"], run["dtype"]
    ids, reached = routing(config, tokens, target, device)
    generator = torch.Generator(device=device).manual_seed(2)
    x = torch.randn(config.ranks, tokens, config.hidden, device=device, generator=generator).to(dtype).requires_grad_()
    topk_weights = (torch.rand(config.ranks, tokens, config.top_k, device=device, generator=generator) + 0.1).requires_grad_()
    grad_out = torch.randn(config.ranks, tokens, config.hidden, device=device, generator=generator).to(dtype)
    w2 = w2.detach().requires_grad_()
    times = []
    for iteration in range(iters + 1):  # the first is the warm-up
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        plan = None
        if policy in SIZED_TO_STEP:
            plan = sized_to_step(plan_step(ids, config, group, policy), config.align)
        out = ep_moe(x, ids, topk_weights, w13, w2, config=config, group=group, policy=policy, plan=plan,
                     backend=run["backend"])
        out.backward(grad_out)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            elapsed = (time.perf_counter() - began) * 1e3
        if iteration:
            times.append(elapsed)
        x.grad = topk_weights.grad = w2.grad = None
        del out
    return dict(tokens=tokens, maxvio_target=target, maxvio=reached, policy=policy, status="ok",
                median_ms=statistics.median(times), times_ms=times)


def markdown(result: dict) -> str:
    """The JSON's content as a markdown report."""
    check = result["check"]
    lines = [f"# EP MoE backward, {result['shape']}", "",
             f"(a) gradients against a dense fp32 layer (s={check['tokens']}, maxvio {check['maxvio']:.2f}, policy "
             f"exact), relative Frobenius error (tolerance {check['tolerance']:g}): "
             + ", ".join(f"{name} {error:.2e}" for name, error in check["relative_error"].items())
             + (" - passed" if check["passed"] else " - FAILED"), "",
             "(b) forward + backward, median ms (" + result["timing_note"] + ")", "",
             "| s | maxvio target | maxvio | flat (exact) ms | classic (none) ms | classic / flat |",
             "| --- | --- | --- | --- | --- | --- |"]
    cells = {(c["tokens"], c["maxvio_target"], c["policy"]): c for c in result["timing"]}
    for tokens in result["tokens"]:
        for target in MAXVIO:
            flat, classic = cells.get((tokens, target, "exact")), cells.get((tokens, target, "none"))

            def shown(cell):
                return f"{cell['median_ms']:.1f}" if cell and cell["status"] == "ok" else (cell or {}).get("status", "-")

            ratio = (f"{classic['median_ms'] / flat['median_ms']:.2f}" if flat and classic and flat["status"] == "ok"
                     and classic["status"] == "ok" else "-")
            reached = next((c["maxvio"] for c in (flat, classic) if c and "maxvio" in c), None)
            lines.append(f"| {tokens} | {target:g} | {'-' if reached is None else f'{reached:.2f}'} | {shown(flat)} | "
                         f"{shown(classic)} | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per cell, after one warm-up")
    parser.add_argument("--budget", type=float, default=380.0, help="seconds after which remaining cells are skipped")
    parser.add_argument("--out", default=os.environ.get("OUT", "./bench-out"), help="output folder (default $OUT)")
    args = parser.parse_args(argv)
    began = time.perf_counter()
    run = setup(args.tiny)
    if run["device"].type == "cuda" and not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (or --tiny)")
    config = run["config"]
    w13, w2 = weights(config, run["device"], run["dtype"])
    check = check_gradients(run, w13, w2)
    print(f"(a) relative Frobenius errors: {check['relative_error']} -> {'passed' if check['passed'] else 'FAILED'}",
          flush=True)
    group = init_group("local", ranks=config.ranks, device=run["device"])
    timing = []
    for tokens in run["tokens"]:
        for target in MAXVIO:
            for policy in ("exact", "none"):
                if time.perf_counter() - began > args.budget:
                    timing.append(dict(tokens=tokens, maxvio_target=target, policy=policy, status="skipped (time budget)"))
                    continue
                if run["device"].type == "cuda":
                    # The previous cell's activations and gradients go back to the device first (on
                    # the H200 two of the three flat cells at s = 8192 ran out of memory without it,
                    # the third, same size, fit).
                    gc.collect()
                    torch.cuda.empty_cache()
                try:
                    cell = time_cell(run, w13, w2, group, tokens, target, policy, args.iters)
                except torch.cuda.OutOfMemoryError:
                    cell = dict(tokens=tokens, maxvio_target=target, policy=policy, status="out of memory")
                    torch.cuda.empty_cache()
                timing.append(cell)
                print(f"(b) s={tokens} maxvio {target:g} {policy}: "
                      + (f"{cell['median_ms']:.1f} ms" if cell["status"] == "ok" else cell["status"]), flush=True)
    result = dict(
        shape=f"H={config.hidden} E={config.experts} K={config.top_k} I={config.intermediate} R={config.ranks} "
              f"{str(run['dtype']).removeprefix('torch.')} on {run['device'].type}",
        tokens=run["tokens"], check=check, timing=timing, seconds=time.perf_counter() - began,
        timing_note=f"eager, CUDA events, median of {args.iters} after 1 warm-up; gradients of x, topk_weights, w2 "
                    "(w13 frozen: its fp32 gradient does not fit beside s=8192 on one GPU); classic's shards sized to the "
                    "step's hottest rank (planned in the timed region)",
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "backward_h200.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "backward_h200.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'backward_h200.json'} and {out / 'backward_h200.md'} in {result['seconds']:.0f} s")
    return 0 if check["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
