"""One rank of a multi-process FlatEP check, run under torchrun or spawned by the CPU tests.

Every rank builds the same global inputs (``[R, s, ...]``, from fixed seeds), runs ``ep_moe`` on its
own slice with a per-process transport, and either saves what it got (``--out``: the CPU tests
compare in the parent, which computes the local-transport references once) or compares in
process against the local transport on the same device and the dense MoE (``--compare``: the GPU
script). Suites:

* ``equivalence``: every case of :func:`cases` (both policies, several maxvio, adversarial
  routings, bf16 and fp32, fp8 dispatch with dedup, one pool reused across steps), then ranks that disagree on ``s``, on
  the config, or pass bad ids (every rank must raise ``ValueError``), then one more good step.
* ``lazy``: a group with ``eager_check=False`` (with ``TRITON_INTERPRET=1`` on CPU, so the
  sync-free Triton planner plans): a few cases, a step whose ranks hold fewer real tokens than
  ``s``, a step without any token (which only ``group.check()`` reports), then bad ids on the last
  rank that only ``group.check()`` reports (on every rank), then a good step.
* ``static``: a collective group with ``static_splits=True`` against one without, on the same
  processes: every case of :func:`cases` with dedup off and on must give bit-identical outputs, the
  static group's dispatch and combine running under :class:`tests.helpers.HostReadGuard`.
* ``sync-free`` (CUDA, NCCL): a collective group with ``static_splits=True`` and
  ``eager_check=False`` runs classic steps (``policy="none"``, dedup on) under
  ``torch.cuda.set_sync_debug_mode("error")``, each after one warm-up step of its shape (buffers,
  kernels); outputs must equal the local transport's bit for bit.
* ``push-pools``: the collective transport's push of several pools of different dtypes (as
  values, scales and biases are) in one batch: every slot must hold its owner's expert.
* ``random``: ``--steps`` random steps (:func:`random_step`: formats bf16, fp32, mxfp4 and fp8, every
  policy, repeated ids and a hot expert, per-rank token counts, dedup, fp8 dispatch), each with a
  fresh pool; every rank's real rows must equal the local transport's bit for bit.
* ``dead-rank``: after one good step the last rank exits; the others must raise within
  ``--timeout`` seconds, naming it on the nvlink transport.

Exit status 0 when every check this rank ran passed.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass
from unittest import mock
from pathlib import Path

import torch
import torch.distributed as dist

from flatep import EPConfig, ExpertPool, dense_moe, ep_moe, init_group, make_plan
from flatep.kernels.fp8_rows import pack_rows_torch, unpack_rows_torch
from flatep.layer import plan_step
from flatep.routing import sigma_for_maxvio
from flatep.transport.collective import CollectiveGroup
from tests.helpers import HostReadGuard, borrowing_cost, make_inputs, random_expert_weights

WEIGHT_SEED = 7


@dataclass(frozen=True)
class Case:
    """One step of the equivalence suite; ``routing`` is a maxvio target (float) or an adversarial kind;
    ``dispatch_dtype`` that of ``ep_moe`` (``torch.float8_e4m3fn``: packed fp8 rows)."""

    config: EPConfig
    tokens: int
    routing: float | str
    policy: str
    dtype: torch.dtype
    seed: int
    dispatch_dtype: torch.dtype | None = None

    @property
    def name(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        sent = "" if self.dispatch_dtype is None else "-fp8-dispatch"
        return f"R{self.config.ranks}-s{self.tokens}-{self.routing}-{self.policy}-{dtype}{sent}"

    @property
    def options(self) -> dict[str, object]:
        """``ep_moe``'s step options of this case."""
        return dict(policy=self.policy, dispatch_dtype=self.dispatch_dtype)

    def seen_by_experts(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the experts compute on: ``x`` itself, or its fp8 rows dequantized (fp8 dispatch)."""
        if self.dispatch_dtype is None:
            return x
        return unpack_rows_torch(pack_rows_torch(x), x.shape[-1], x.dtype)

    def inputs(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """``x [R, s, H]``, ``topk_ids [R, s, K]``, ``topk_weights [R, s, K]``, ``w13``, ``w2`` on ``device``.

        The weights depend on the config and dtype only, so one pool serves every case of a config.
        """
        config = self.config
        routing = self.routing
        if isinstance(routing, float):
            routing, _ = sigma_for_maxvio(routing, config.ranks, config.experts, config.top_k, self.tokens, seed=self.seed)
        x, ids, weights, _, _ = make_inputs(config, self.tokens, routing, self.dtype, seed=self.seed)
        key = (config, self.dtype)
        if key not in _WEIGHTS:  # make_inputs draws the weights after x, so fix s to keep them per config
            _WEIGHTS[key] = make_inputs(config, config.capacity, 0.0, self.dtype, seed=WEIGHT_SEED)[3:]
        return tuple(tensor.to(device) for tensor in (x, ids, weights, *_WEIGHTS[key]))


_WEIGHTS: dict[tuple[EPConfig, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}


def cases(ranks: int, size: str) -> list[Case]:
    """The equivalence cases for ``ranks`` processes; ``size`` ``small`` (CPU) or ``mid`` (GPU)."""
    if size == "small":
        config = EPConfig(ranks=ranks, experts=4 * ranks, top_k=3, hidden=32, intermediate=16, capacity=16, align=4)
        steps = [(16, 0.0), (16, 2.0), (16, 8.0), (16, "one"), (5, "next")]
    else:
        config = EPConfig(ranks=ranks, experts=32, top_k=4, hidden=1024, intermediate=512, capacity=256, align=128)
        steps = [(256, 0.0), (256, 1.0), (256, 4.0), (256, 10.0), (256, "one"), (256, "next"), (97, 4.0)]
    plain = [
        Case(config, tokens, routing, policy, dtype, seed=100 + index)
        for dtype in (torch.bfloat16, torch.float32)
        for index, (tokens, routing) in enumerate(steps)
        for policy in ("exact", "none")
    ]
    # fp8 rows with dedup: the packed rows are expanded on arrival, then unpacked.
    fp8 = [
        Case(config.replace(dedup=True), steps[index][0], steps[index][1], policy, torch.bfloat16, seed=200 + index,
             dispatch_dtype=torch.float8_e4m3fn)
        for index in (1, 3)
        for policy in ("exact", "none")
    ]
    return plain + fp8


def padded_case(ranks: int, size: str) -> Case:
    """A skewed step in which ranks pass fewer real tokens than ``s`` (:func:`padded_counts`)."""
    return cases(ranks, size)[4]


def padded_counts(ranks: int, tokens: int) -> list[int]:
    """Real tokens of each rank in the padded step: rank ``r`` passes ``s - 2r`` (rank 1 none when R > 2)."""
    return [0 if rank == 1 and ranks > 2 else tokens - 2 * rank for rank in range(ranks)]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of a bf16/fp32 tensor, for exact comparison (-0.0 differs from 0.0, NaN equals itself)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def expect_value_error(step, pattern: str) -> str:
    """Run ``step``; return the ``ValueError`` message if it contains ``pattern``, else a failure note."""
    try:
        step()
    except ValueError as error:
        return str(error) if pattern in str(error) else f"FAIL: wrong message: {error}"
    return "FAIL: no error"


def equivalence(group, rank: int, world: int, size: str, compare: bool, log) -> dict[str, object]:
    results: dict[str, object] = {}
    local = init_group("local", ranks=world, device=group.device) if compare else None
    pools: dict[tuple[EPConfig, torch.dtype], ExpertPool] = {}
    for case in cases(world, size):
        x, ids, weights, w13, w2 = case.inputs(group.device)
        key = (case.config, case.dtype)
        if key not in pools:  # one pool per config: buffers, slots and barriers are reused across steps
            pools[key] = ExpertPool.from_weights(w13, w2, case.config, group)
        out = ep_moe(x[rank], ids[rank], weights[rank], config=case.config, group=group, pool=pools[key], **case.options)
        results[case.name] = out.cpu()
        if compare:
            reference = ep_moe(x, ids, weights, w13, w2, config=case.config, group=local, **case.options)[rank]
            dense = dense_moe(case.seen_by_experts(x[rank]), ids[rank], weights[rank], w13, w2)
            error = float((out.double() - dense.double()).norm() / dense.double().norm())
            same = torch.equal(bits(out), bits(reference))
            good = same and error < (1e-2 if case.dtype == torch.bfloat16 else 1e-5)
            log(f"{'ok  ' if good else 'FAIL'} {case.name}: bit-equal to local={same}, relative error vs dense {error:.2e}")
            results[f"{case.name}/ok"] = good
    case = padded_case(world, size)
    x, ids, weights, w13, w2 = case.inputs(group.device)
    real = padded_counts(world, case.tokens)
    plan = plan_step(ids[rank], case.config, group, case.policy, tokens=real[rank], dtype=case.dtype)
    out = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group, policy=case.policy, plan=plan)
    results["padded"] = out.cpu()
    if compare:
        whole = make_plan(ids, case.config, case.policy, tokens=real)
        reference = ep_moe(x, ids, weights, w13, w2, config=case.config, group=local, policy=case.policy, plan=whole)[rank]
        same = torch.equal(bits(out), bits(reference)) and not out[real[rank]:].any()
        log(f"{'ok  ' if same else 'FAIL'} padded tokens {real}: bit-equal to local={same}")
        results["padded/ok"] = same
    case = cases(world, size)[0]
    x, ids, weights, w13, w2 = case.inputs(group.device)
    config, tokens = case.config, case.tokens
    short = tokens - 1 if rank else tokens
    results["disagree-s"] = expect_value_error(
        lambda: ep_moe(x[rank, :short], ids[rank, :short], weights[rank, :short], w13, w2, config=config, group=group),
        "disagree",
    )
    other = config.replace(align=config.align * 2) if rank else config
    results["disagree-config"] = expect_value_error(
        lambda: ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=other, group=group), "disagree"
    )
    loose = config.replace(tolerance=0.5) if rank else config
    results["disagree-tolerance"] = expect_value_error(
        lambda: ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=loose, group=group), "disagree"
    )
    sent = torch.float8_e4m3fn if rank else None
    results["disagree-dispatch"] = expect_value_error(
        lambda: ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=config, group=group, dispatch_dtype=sent),
        "disagree",
    )
    broken = ids[rank].clone()
    if rank == world - 1:
        broken[0, 0] = config.experts
    results["bad-ids"] = expect_value_error(
        lambda: ep_moe(x[rank], broken, weights[rank], w13, w2, config=config, group=group), "expert id" if rank == world - 1 else "invalid inputs"
    )
    out = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=config, group=group, policy=case.policy)
    results["after-errors"] = out.cpu()
    results["after-errors/case"] = case.name
    for name in ("disagree-s", "disagree-config", "disagree-tolerance", "disagree-dispatch", "bad-ids"):
        log(f"{'FAIL' if results[name].startswith('FAIL') else 'ok  '} {name}: {results[name]}")
    if compare:
        same = torch.equal(bits(out), bits(results[case.name].to(out.device)))
        log(f"{'ok  ' if same else 'FAIL'} a good step after the errors equals the first run of {case.name}: {same}")
        results["after-errors/ok"] = same
    held = results["buffer-bytes"] = buffer_bytes_over_steps(group, rank, world)
    results["buffer-bytes/ok"] = held[0] > 0 and held == [held[0]] * len(held)
    log(f"{'ok  ' if results['buffer-bytes/ok'] else 'FAIL'} buffers over 50 steps of 20 sizes: {sorted(set(held))} bytes")
    return results


def buffer_bytes_over_steps(group, rank: int, world: int) -> list[int]:
    """The group's buffer bytes after each of 50 steps of 20 distinct sizes ``s`` (buffers come from
    the capacity, so every step should hold what the first allocated)."""
    config = EPConfig(ranks=world, experts=4 * world, top_k=3, hidden=32, intermediate=16, capacity=24, align=4)
    *_, w13, w2 = make_inputs(config, config.capacity, 0.0, torch.float32, seed=WEIGHT_SEED)
    pool = ExpertPool.from_weights(w13.to(group.device), w2.to(group.device), config, group)
    held = []
    for step in range(50):
        tokens = 1 + (step * 7) % 20
        x, ids, weights, _, _ = make_inputs(config, tokens, ("one", 2.0)[step % 2], torch.float32, seed=step)
        ep_moe(*(t[rank].to(group.device) for t in (x, ids, weights)), group=group, pool=pool)
        held.append(group.buffer_bytes())
    return held


def lazy(group, rank: int, world: int, size: str, log) -> dict[str, object]:
    """Steps that read nothing back (``eager_check=False``, Triton planner): outputs, then bad input
    on the last rank, which every rank's ``group.check()`` must report, then a good step again."""
    results: dict[str, object] = {}
    for case in cases(world, size)[:4]:
        x, ids, weights, w13, w2 = case.inputs(group.device)
        out = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group, policy=case.policy)
        results[case.name] = out.clone()
    # Ranks with fewer real tokens than s: the group's total is never read on the host.
    case = padded_case(world, size)
    x, ids, weights, w13, w2 = case.inputs(group.device)
    plan = plan_step(ids[rank], case.config, group, case.policy, tokens=padded_counts(world, case.tokens)[rank],
                     dtype=case.dtype)
    results["lazy-padded"] = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group,
                                    policy=case.policy, plan=plan).clone()
    results["lazy-padded/total"] = plan.total_tokens
    group.check()
    # No rank has tokens: only check() can tell.
    empty = plan_step(ids[rank], case.config, group, case.policy, tokens=0, dtype=case.dtype)
    ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group, policy=case.policy, plan=empty)
    try:
        group.check()
        results["lazy-no-tokens"] = "FAIL: check found nothing"
    except ValueError as error:
        results["lazy-no-tokens"] = str(error)
    case = cases(world, size)[0]
    x, ids, weights, w13, w2 = case.inputs(group.device)
    broken = ids[rank].clone()
    if rank == world - 1:
        broken[0, 0] = case.config.experts
    ep_moe(x[rank], broken, weights[rank], w13, w2, config=case.config, group=group)  # no error yet: nothing read back
    try:
        group.check()
        results["lazy-bad-ids"] = "FAIL: check found nothing"
    except ValueError as error:
        results["lazy-bad-ids"] = str(error)
    group.check()  # cleared
    results["lazy-after-errors"] = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group).clone()
    results["lazy-after-errors/case"] = case.name
    log(f"lazy bad ids: {results['lazy-bad-ids']}")
    return results


def guarded(method):
    """``method`` run under :class:`HostReadGuard`."""
    def run(*args, **kwargs):
        with HostReadGuard():
            return method(*args, **kwargs)
    return run


def static(group, rank: int, world: int, size: str, log) -> dict[str, object]:
    """``group`` exchanges with static splits: outputs bit-identical to messages sized on the host."""
    dynamic = CollectiveGroup(group.process_group, group.device)
    group.dispatch, group.combine = guarded(group.dispatch), guarded(group.combine)
    group.gather_entries = guarded(group.gather_entries)
    results: dict[str, object] = {}
    for case in cases(world, size):
        x, ids, weights, w13, w2 = case.inputs(group.device)
        for dedup in (False, True):
            config = case.config.replace(dedup=dedup)
            name = f"{case.name}/dedup={dedup}"
            try:
                outs = [ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=config, group=g, **case.options)
                        for g in (group, dynamic)]
                same = torch.equal(bits(outs[0]), bits(outs[1]))
                results[name] = True if same else "FAIL: static and host-sized exchanges differ"
            except RuntimeError as error:
                results[name] = f"FAIL: {error}"
            log(f"{'ok  ' if results[name] is True else 'FAIL'} {name}: {results[name]}")
    # Ranks with fewer real tokens than s, and the backward (its dispatch and combine are the
    # forward's, the other way round), deduplicated.
    case = padded_case(world, size)
    config = case.config.replace(dedup=True)
    x, ids, weights, w13, w2 = case.inputs(group.device)
    runs = []
    for g in (group, dynamic):
        plan = plan_step(ids[rank], config, g, case.policy, tokens=padded_counts(world, case.tokens)[rank], dtype=case.dtype)
        out = ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=config, group=g, policy=case.policy, plan=plan)
        tokens = x[rank].float().requires_grad_()
        route = weights[rank].clone().requires_grad_()  # its gradient comes back through gather_entries
        with torch.enable_grad():
            trained = ep_moe(tokens, ids[rank], route, w13.float(), w2.float(), config=config, group=g, policy=case.policy)
            trained.backward(torch.ones_like(trained))
        runs.append((out, tokens.grad, route.grad))
    for name, first, second in (("padded", runs[0][0], runs[1][0]), ("backward", runs[0][1], runs[1][1]),
                                ("backward-route", runs[0][2], runs[1][2])):
        results[f"{name}/dedup=True"] = True if torch.equal(bits(first), bits(second)) else "FAIL: differ"
        log(f"{name}: {results[f'{name}/dedup=True']}")
    # Inside CUDA-graph capture, what reads the host refuses to run, naming the way out.
    with mock.patch("torch.cuda.is_available", return_value=True), \
            mock.patch("torch.cuda.is_current_stream_capturing", return_value=True):
        for what, call, hint in (
            ("dispatch", lambda: dynamic.dispatch(x[rank], weights[rank], None, None, None, None), "static_splits=True"),
            ("gather_entries", lambda: dynamic.gather_entries(x[rank], None), "static_splits=True"),
            ("push", lambda: group.push_pools([], torch.full((world, 1), -1, dtype=torch.int32)), "policy='none'"),
        ):
            message = expect_value_error(call, "CUDA-graph capture")
            results[f"capture/{what}"] = True if hint in message else f"FAIL: {message}"
    dynamic.close()
    return results


def sync_free(group, rank: int, world: int, size: str, log) -> dict[str, object]:
    """Classic steps (bf16 and fp32) with static splits under the CUDA sync-debug mode set to error,
    each bit-equal to the local transport's."""
    results: dict[str, object] = {}
    local = init_group("local", ranks=world, device=group.device)
    for case in (case for case in cases(world, size) if case.policy == "none"):
        config = case.config.replace(dedup=True)
        x, ids, weights, w13, w2 = case.inputs(group.device)
        pool = ExpertPool.from_weights(w13, w2, config, group)

        def step():
            return ep_moe(x[rank], ids[rank], weights[rank], config=config, group=group, policy="none", pool=pool)

        step()  # warm-up: buffers, kernels
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step()
        except RuntimeError as error:
            results[case.name] = f"FAIL: {error}"
            log(f"FAIL {case.name}: {str(error).splitlines()[0]}")
            continue
        finally:
            torch.cuda.set_sync_debug_mode(0)
        reference = ep_moe(x, ids, weights, w13, w2, config=config, group=local, policy="none")[rank]
        results[case.name] = True if torch.equal(bits(out), bits(reference)) else "FAIL: differs from the local transport"
        log(f"{'ok  ' if results[case.name] is True else 'FAIL'} {case.name}: {results[case.name]}")
    group.check()
    return results


def push_pools(group, rank: int, world: int, size: str, log) -> dict[str, object]:
    """Three pools (bf16, uint8, fp32) pushed together; each rank's expert ``e`` holds values made from ``e``."""
    epn = 3

    def expert_values(expert: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return (torch.arange(expert * 100, expert * 100 + torch.Size(shape).numel()) % 251).to(dtype).view(shape)

    shapes = [((4, 3), torch.bfloat16), ((5,), torch.uint8), ((2,), torch.float32)]
    homes = [torch.stack([expert_values(rank * epn + local, shape, dtype) for local in range(epn)]) for shape, dtype in shapes]
    slots = [torch.full_like(home, 7) for home in homes]
    # Every rank borrows the next rank's first expert into slot 0 and the one after's last into slot 2.
    table = torch.full((world, epn), -1, dtype=torch.int32)
    for receiver in range(world):
        table[receiver, 0] = ((receiver + 1) % world) * epn
        if world > 2:
            table[receiver, 2] = ((receiver + 2) % world) * epn + epn - 1
    group.push_pools(list(zip(homes, slots)), table)
    good = True
    for slot, expert in enumerate(table[rank].tolist()):
        for (shape, dtype), held in zip(shapes, slots):
            want = expert_values(expert, shape, dtype) if expert >= 0 else torch.full(shape, 7, dtype=dtype)
            good = good and torch.equal(held[slot], want)
    log(f"{'ok  ' if good else 'FAIL'} push of three pools")
    return {"push-pools": good}


def dead_rank(group, rank: int, world: int, size: str, timeout: float, log) -> dict[str, object]:
    case = cases(world, size)[0]
    x, ids, weights, w13, w2 = case.inputs(group.device)
    ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group)
    if group.device.type == "cuda":
        torch.cuda.synchronize(group.device)
    if rank == world - 1:
        log(f"rank {rank}: exiting early, without telling anyone")
        os._exit(0)
    time.sleep(1.0)  # let the last rank be gone, not merely late
    start = time.monotonic()
    try:
        ep_moe(x[rank], ids[rank], weights[rank], w13, w2, config=case.config, group=group)
    except Exception as error:  # noqa: BLE001 - which exception is part of what is reported
        elapsed = time.monotonic() - start
        named = str(world - 1) in str(error)
        log(f"rank {rank}: {type(error).__name__} after {elapsed:.1f} s (timeout {timeout:g} s): {error}")
        return {"dead/type": type(error).__name__, "dead/message": str(error), "dead/elapsed": elapsed, "dead/named": named}
    log(f"FAIL rank {rank}: the step finished although rank {world - 1} is gone")
    return {"dead/type": "none", "dead/message": "", "dead/elapsed": time.monotonic() - start, "dead/named": False}


RANDOM_SIZES = {"fp32": (16, 8), "bf16": (16, 8), "mxfp4": (128, 128), "fp8": (128, 128)}  # (hidden, intermediate)


def random_step(seed: int, world: int, formats: tuple[str, ...] = tuple(RANDOM_SIZES)) -> dict[str, object]:
    """One random step for ``world`` ranks, the same on every rank for the same ``seed``: ``config``,
    ``w13``/``w2`` (packed for mxfp4 and fp8), ``x [R, s, H]``, ``ids``, ``weights``, ``tokens`` (per-rank
    real counts or None), ``policy``, ``cost`` (for ``auto``: a link so fast that it borrows, or so slow
    that it never does), ``dispatch_dtype`` and a ``name`` saying all that."""
    draw = random.Random(seed)
    experts = world * draw.choice([1, 2, 3])
    top_k = draw.randint(1, min(experts, 4))
    format = draw.choice(formats)
    hidden, intermediate = RANDOM_SIZES[format]
    capacity = draw.choice([2, 4, 6])
    step = draw.randint(1, capacity)
    config = EPConfig(ranks=world, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate,
                      capacity=capacity, align=draw.choice([1, 4, 8]), tolerance=draw.choice([0.0, 0.2]),
                      dedup=draw.random() < 0.3)
    dtype = torch.float32 if format == "fp32" else torch.bfloat16
    w13, w2 = random_expert_weights(config, format, seed, torch.device("cpu"))
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, experts, (world, step, top_k), generator=generator, dtype=torch.int32)
    if draw.random() < 0.5:  # half of the entries on one expert
        ids[ids % 2 == 0] = draw.randrange(experts)
    tokens = [draw.randint(0, step) for _ in range(world)] if draw.random() < 0.4 else None
    if tokens is not None and not any(tokens):
        tokens[0] = 1
    policy = draw.choice(["exact", "none", "bounded", "auto"])
    cost = borrowing_cost(draw.choice([1e-3, 1e6])) if policy == "auto" else None
    dispatch_dtype = torch.float8_e4m3fn if dtype == torch.bfloat16 and draw.random() < 0.3 else None
    x = torch.randn(world, step, hidden, generator=generator).to(dtype)
    weights = torch.rand(world, step, top_k, generator=generator) + 0.1
    name = (f"seed{seed}-{format}-E{experts}-K{top_k}-s{step}-{policy}-tokens{tokens}"
            f"-dedup{config.dedup}-{'fp8-dispatch' if dispatch_dtype else 'rows'}")
    return dict(config=config, w13=w13, w2=w2, x=x, ids=ids, weights=weights, tokens=tokens, policy=policy, cost=cost,
                dispatch_dtype=dispatch_dtype, name=name)


def random_steps(group, rank: int, world: int, steps: int, formats: tuple[str, ...], log) -> dict[str, object]:
    """:func:`random_step` for seeds ``0 .. steps-1``: this rank's real rows against the local transport's."""
    results: dict[str, object] = {}
    local = init_group("local", ranks=world, device=group.device)
    for seed in range(steps):
        case = random_step(seed, world, formats)
        config, policy, tokens, dispatch_dtype = case["config"], case["policy"], case["tokens"], case["dispatch_dtype"]
        x, ids, weights, w13, w2 = (case[name].to(group.device) for name in ("x", "ids", "weights", "w13", "w2"))
        outputs = []
        for where in (group, local):
            pool = ExpertPool.from_weights(w13, w2, config, where, dtype=x.dtype)
            cost = case["cost"].with_expert_bytes(pool.expert_nbytes()) if case["cost"] else None
            mine = where is group
            real = tokens[rank] if mine and tokens is not None else tokens
            step = (x[rank], ids[rank], weights[rank]) if mine else (x, ids, weights)
            plan = plan_step(step[1], config, where, policy, tokens=real, cost=cost, dispatch_dtype=dispatch_dtype,
                             dtype=x.dtype)
            out = ep_moe(*step, config=config, group=where, pool=pool, policy=policy, plan=plan, cost=cost,
                         dispatch_dtype=dispatch_dtype)
            outputs.append(out if mine else out[rank])
        count = x.shape[1] if tokens is None else tokens[rank]
        same = torch.equal(bits(outputs[0][:count]), bits(outputs[1][:count]))
        results[case["name"]] = same
        if not same:
            log(f"FAIL {case['name']}: differs from the local transport")
    log(f"{sum(value is True for value in results.values())} of {steps} random steps bit-equal to the local transport")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", choices=["auto", "nvlink", "collective"], default="auto")
    parser.add_argument("--suite", choices=["equivalence", "lazy", "static", "sync-free", "push-pools", "random",
                                            "dead-rank"], default="equivalence")
    parser.add_argument("--steps", type=int, default=40, help="steps of the random suite")
    parser.add_argument("--formats", nargs="+", choices=list(RANDOM_SIZES), default=list(RANDOM_SIZES),
                        help="weight formats the random suite draws from")
    parser.add_argument("--size", choices=["small", "mid"], default="small")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo", help="process group backend")
    parser.add_argument("--init-method", default="env://")
    parser.add_argument("--timeout", type=float, default=20.0, help="barrier timeout, seconds")
    parser.add_argument("--out", type=Path, help="save this rank's results here (rank<r>.pt)")
    parser.add_argument("--compare", action="store_true", help="compare with the local transport in process")
    args = parser.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(args.backend, init_method=args.init_method, rank=rank, world_size=world)

    def log(message: str) -> None:
        print(f"[rank {rank}/{world}] {message}", flush=True)

    group = init_group(transport=args.transport, barrier_timeout=args.timeout, eager_check=args.suite not in ("lazy", "sync-free"),
                       static_splits=args.suite in ("static", "sync-free"))
    log(f"group: {group!r}")
    torch.manual_seed(0)
    with torch.no_grad():
        if args.suite == "equivalence":
            results = equivalence(group, rank, world, args.size, args.compare, log)
        elif args.suite == "lazy":
            results = lazy(group, rank, world, args.size, log)
        elif args.suite == "static":
            results = static(group, rank, world, args.size, log)
        elif args.suite == "sync-free":
            results = sync_free(group, rank, world, args.size, log)
        elif args.suite == "push-pools":
            results = push_pools(group, rank, world, args.size, log)
        elif args.suite == "random":
            results = random_steps(group, rank, world, args.steps, tuple(args.formats), log)
        else:
            results = dead_rank(group, rank, world, args.size, args.timeout, log)
    results["group"] = repr(group)
    if args.out is not None:
        torch.save(results, args.out / f"rank{rank}.pt")
    failed = [name for name, value in results.items() if value is False or (isinstance(value, str) and value.startswith("FAIL"))]
    if args.suite == "dead-rank":
        expected = "TimeoutError" if args.transport == "nvlink" else None
        if results["dead/type"] == "none" or (expected and (results["dead/type"] != expected or not results["dead/named"])):
            failed.append("dead-rank")
        # The process group still waits for the dead rank: leave without tearing it down.
        log("FAILED: " + ", ".join(failed) if failed else "PASSED")
        sys.stdout.flush()
        os._exit(1 if failed else 0)
    log("FAILED: " + ", ".join(failed) if failed else "PASSED")
    group.close()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
