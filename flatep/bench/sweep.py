"""The ``flatep bench`` sweep: per-rank cost of an EP MoE layer as router skew grows.

Arms: ``flat`` (policy ``exact``), ``classic`` (policy ``none``: the hottest rank carries the
surplus), ``dense`` (one device, no EP: permute by expert, grouped GEMM over all experts), and
any planner policy by its own name (``auto``: per step the candidate the cost model predicts
fastest, :mod:`flatep.plan.auto`). In every (tokens, maxvio) cell the arms run on the same inputs,
and the EP arms' phases are timed interleaved, replay by replay (dispatch alone arm by arm), so
that the machine's drift hits every arm alike.

All ranks are virtual ranks of one device, so link time is not measured; per rank and phase the
bytes that would cross the link are counted from the plan (:mod:`flatep.bench.accounting`) and a
link time is *modelled* from them, always labelled as a model.

Every EP row also carries what the cost model (:mod:`flatep.plan.cost`, the sweep's ``cost``
profile) predicts for the plan that ran and the measured time of the same terms
(:func:`model_terms_us`), so the model's error is read from the same cells it decides.
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import yaml

from flatep.bench.accounting import carried, link_model_us, plan_link_bytes, push_tables
from flatep.kernels.fp8_rows import DISPATCH_FORMATS, check_dispatch_dtype, dispatch_row_bytes, entry_link_bytes, packs_rows
from flatep.bench.timing import (
    Timing, copy_ceiling_gbps, device_name, experts_outputs, gemm_ceiling_tflops, read_ceiling_gbps, time_interleaved,
    time_stats,
)
from flatep.config import MODEL_SHAPES, POLICIES, EPConfig, align_up, preset
from flatep.experts.grouped import grouped_swiglu
from flatep.experts.pool import ExpertPool
from flatep.layer import (
    combine_step, dispatch_step, ep_moe, experts_step, packed_rows, planned_policy, reads_packed_rows,
)
from flatep.plan.auto import Candidate
from flatep.plan.cost import CostProfile, predict
from flatep.plan.reference import make_plan
from flatep.plan.split import split_slot_rows
from flatep.plan.triton import make_plan_triton, supports_triton_planner
from flatep.plan.types import Plan
from flatep.quant import WEIGHT_FORMATS, QuantizedTensor, check_pool_dims, expert_weight_nbytes, packed_layout, pool_layout
from flatep.routing import sigma_for_maxvio, skewed_topk
from flatep.transport.local import LocalGroup

ARMS = {"flat": "exact", "classic": "none", "dense": None}
"""Arms with their own names and the policy each plans with (``None``: the dense arm, no plan).
Any other arm name must be a planner policy (:data:`flatep.config.POLICIES`) and plans with it."""
CELL_KEY = ("model", "ranks", "tokens", "maxvio_target", "arm")
IDENTITY = ("sweep", "model", "ranks", "hidden", "experts", "top_k", "intermediate", "align", "tolerance",
            "dedup", "link_gbps_model", "warmup", "iters", "graph_calls", "device", "backend", "weights", "layout",
            "dispatch", "cost_profile")
"""Fields every row of one results file shares: ``--resume`` refuses a file whose rows differ. ``layout``
is the pools' byte layout (:func:`flatep.quant.pool_layout`: ``mma`` where mxfp4 runs on fp8
activations, ``FLATEP_MXFP4_FP8_ACTIVATIONS=1``)."""


def arm_policy(arm: str) -> str | None:
    """The planner policy of an arm (``None`` for ``dense``)."""
    if arm in ARMS:
        return ARMS[arm]
    if arm in POLICIES:
        return arm
    raise ValueError(f"arm must be one of {known_arms()}, got {arm!r}")


def known_arms() -> list[str]:
    """Every arm a sweep may name: the named arms, then every planner policy by its own name."""
    return list(ARMS) + [policy for policy in POLICIES if policy not in ARMS]


@dataclass
class Sweep:
    """One sweep configuration (a YAML file under ``flatep/bench/configs`` or any path).

    Attributes:
        name: label of the sweep.
        model: a preset name (``kimi-k2``, ...) or a dict ``{hidden, experts, top_k, intermediate}``.
        ranks: virtual EP ranks.
        tokens: ladder of tokens per rank ``s``.
        maxvio: ladder of target router imbalance.
        arms: the arms, in the order each cell runs them: ``flat``, ``classic``, ``dense``, or a
            planner policy by name (see :func:`arm_policy`).
        warmup, iters: timing repetitions (median and min-max spread of ``iters``).
        graph_calls: on a GPU, copies of each phase captured back to back in one CUDA graph, its
            replay time divided by their number (default 1: one phase per graph). A replay has a
            fixed cost (about 10 us on the H200 for a phase of one tiny kernel) that a serving
            step, one graph for the whole model, pays once; more calls per graph leave the
            phases' own time. Planning and the push, the phases of at most a few hundred µs that
            only some arms run (the push) or run longer (auto's planning), take at least
            :data:`SHORT_PHASE_CALLS` copies, so that the replay's cost is not charged to them.
        link_gbps: link bandwidth per direction used by the modelled link time.
        align: group padding of the shards (:attr:`flatep.EPConfig.align`).
        tolerance: imbalance the flat arm lets pass without moving weights
            (:attr:`flatep.EPConfig.tolerance`).
        dedup: send each token once per destination rank (:attr:`flatep.EPConfig.dedup`, default
            off); ``False`` runs the per-entry path.
        weights: format of the expert pool, one of :data:`flatep.quant.WEIGHT_FORMATS`
            (``bf16``; ``fp8``: e4m3 with 128x128 block scales, needs ``H`` and ``I`` multiples
            of 128; ``mxfp4``: e2m1 with a scale per 32, needs multiples of 32), random values.
        dispatch: dtype of the rows the EP arms dispatch, one of :data:`DISPATCH_FORMATS`
            (``bf16``; ``fp8``: e4m3 with a scale per 128 columns, packed: ``ep_moe``'s
            ``dispatch_dtype=torch.float8_e4m3fn``); ``dispatch_bytes`` and the link model count
            the bytes that format sends. The dense arm has no dispatch.
        cost: the :class:`flatep.CostProfile` of the ``auto`` arm and of every row's model
            prediction: a preset name (``generic``, ``h200``) or the path of a JSON profile
            written by ``flatep calibrate --out``; ``None`` is :meth:`CostProfile.default`.
    """

    name: str
    model: str | dict[str, int]
    ranks: int
    tokens: list[int]
    maxvio: list[float]
    arms: list[str] = field(default_factory=lambda: list(ARMS))
    warmup: int = 3
    iters: int = 10
    graph_calls: int = 1
    link_gbps: float = 370.0
    align: int = 128
    tolerance: float = 0.0
    dedup: bool = False
    weights: str = "bf16"
    dispatch: str = "bf16"
    cost: str | None = None

    @classmethod
    def load(cls, name_or_path: str) -> "Sweep":
        """Read a shipped config by name (``default``, ``kimi-k3``, ``cpu``, ``tiny``) or a YAML path."""
        path = Path(name_or_path)
        if path.suffix in (".yaml", ".yml") or path.exists():
            if not path.exists():
                raise ValueError(f"sweep config file {name_or_path!r} does not exist")
            text = path.read_text()
        else:
            shipped = resources.files("flatep.bench") / "configs" / f"{name_or_path}.yaml"
            if not shipped.is_file():
                raise ValueError(f"sweep config must be a YAML path or one of {shipped_configs()}, got {name_or_path!r}")
            text = shipped.read_text()
        data = yaml.safe_load(text)
        if not isinstance(data, dict):
            raise ValueError(f"sweep config {name_or_path!r} must be a YAML mapping")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"sweep config {name_or_path!r} has unknown keys {sorted(unknown)}; allowed: {sorted(known)}")
        sweep = cls(**data)
        sweep.validate()
        return sweep

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field on a bad value."""
        if not self.arms or set(self.arms) - set(known_arms()) or len(set(self.arms)) != len(self.arms):
            raise ValueError(f"arms must be distinct names from {known_arms()}, got {self.arms}")
        if not isinstance(self.iters, int) or self.iters < 1 or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"iters must be >= 1 and warmup >= 0 (integers), got iters={self.iters}, warmup={self.warmup}")
        if isinstance(self.graph_calls, bool) or not isinstance(self.graph_calls, int) or self.graph_calls < 1:
            raise ValueError(f"graph_calls must be an integer >= 1, got {self.graph_calls!r}")
        if self.link_gbps <= 0:
            raise ValueError(f"link_gbps must be > 0, got {self.link_gbps}")
        if not self.tokens or any(not isinstance(t, int) or t < 1 for t in self.tokens):
            raise ValueError(f"tokens must be a list of positive integers, got {self.tokens}")
        if not self.maxvio or any(v < 0 for v in self.maxvio):
            raise ValueError(f"maxvio must be a list of numbers >= 0, got {self.maxvio}")
        config = self.ep_config(max(self.tokens))
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {list(WEIGHT_FORMATS)}, got {self.weights!r}")
        try:
            check_pool_dims(self.weights, config.hidden, config.intermediate)
        except ValueError as error:
            raise ValueError(f"weights: {self.weights} does not fit model {self.model_name}: {error}") from None
        if self.dispatch not in DISPATCH_FORMATS:
            raise ValueError(f"dispatch must be one of {list(DISPATCH_FORMATS)}, got {self.dispatch!r}")
        try:
            check_dispatch_dtype(self.dispatch_dtype(), torch.bfloat16, config.hidden)
        except ValueError as error:
            raise ValueError(f"dispatch: {self.dispatch} does not fit model {self.model_name}: {error}") from None
        self.cost_profile()

    def dispatch_dtype(self) -> torch.dtype | None:
        """``ep_moe``'s ``dispatch_dtype`` of :attr:`dispatch`."""
        return DISPATCH_FORMATS[self.dispatch]

    def cost_profile(self) -> CostProfile:
        """The profile named by :attr:`cost`; ``ValueError`` naming the key ``cost`` if it cannot be read."""
        if self.cost is None:
            return CostProfile.default()
        try:
            return CostProfile.named(self.cost)
        except ValueError as error:
            raise ValueError(f"cost: {error}") from None

    @property
    def model_name(self) -> str:
        """The preset name, or ``custom-h..-e..-k..-i..`` for a shape dict."""
        if isinstance(self.model, str):
            return self.model
        return "custom-h{hidden}-e{experts}-k{top_k}-i{intermediate}".format(**self.model)

    def ep_config(self, capacity: int) -> EPConfig:
        """The group's :class:`EPConfig` at a token capacity."""
        if isinstance(self.model, str):
            if self.model not in MODEL_SHAPES:
                raise ValueError(f"model must be one of {sorted(MODEL_SHAPES)} or a shape dict, got {self.model!r}")
            return preset(self.model, ranks=self.ranks, capacity=capacity, align=self.align).replace(
                tolerance=self.tolerance, dedup=self.dedup
            )
        needed = {"hidden", "experts", "top_k", "intermediate"}
        if set(self.model) != needed:
            raise ValueError(f"model dict must have exactly the keys {sorted(needed)}, got {sorted(self.model)}")
        return EPConfig(ranks=self.ranks, capacity=capacity, align=self.align, tolerance=self.tolerance, dedup=self.dedup,
                        **self.model)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The kernels a run uses: ``auto`` is Triton on a GPU and the plain-torch paths on the CPU.

    Triton on the CPU works only under its interpreter (``TRITON_INTERPRET=1``, slow)."""
    import os

    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("backend triton on the CPU needs TRITON_INTERPRET=1 (the Triton interpreter); use --backend torch")
    return backend


def maxvio_reached(target: float, reached: float) -> bool:
    """Whether a routing's maxvio is close enough to its target to be reported under it
    (within 10% of the target, or 0.1 absolute)."""
    return abs(reached - target) <= max(0.1 * target, 0.1)


def unreached_targets(rows: list[dict[str, Any]]) -> list[str]:
    """One line per (model, tokens, target) whose routing missed its maxvio target."""
    missed = sorted({(r["model"], r["tokens"], r["maxvio_target"], r["maxvio"]) for r in rows if not maxvio_reached(r["maxvio_target"], r["maxvio"])})
    return [
        f"note: {model}, s={tokens}: maxvio target {target:g} not reached (the routing has maxvio {value:.2f}); "
        "its rows are listed under the maxvio reached"
        for model, tokens, target, value in missed
    ]


def shipped_configs() -> list[str]:
    """Names of the sweep configs shipped with the package."""
    folder = resources.files("flatep.bench") / "configs"
    return sorted(p.name[: -len(".yaml")] for p in folder.iterdir() if p.name.endswith(".yaml"))


def dense_step(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor | QuantizedTensor,
    w2: torch.Tensor | QuantizedTensor,
    backend: str = "auto",
) -> torch.Tensor:
    """One device, no EP: sort entries by expert, grouped GEMM over all E experts, weighted sum.

    Args:
        x: ``[T, H]`` bf16; ids: ``[T, K]`` int; weights: ``[T, K]`` fp32 route weights;
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]``: bf16, or packed fp8/mxfp4
            (:class:`flatep.quant.QuantizedTensor`, the EP arms' grouped GEMMs on packed weights);
        backend: the grouped GEMMs' kernels (:func:`flatep.kernels.backend.use_triton`).

    Returns:
        ``[T, H]`` in ``x``'s dtype.
    """
    experts, top_k = w13.shape[0], ids.shape[1]
    flat_ids = ids.reshape(-1).long()
    order = torch.argsort(flat_ids, stable=True)
    token = order // top_k
    # scatter_add, not bincount: no host sync, so the dense step can be captured in a CUDA graph.
    counts = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    offsets = counts.cumsum(0).to(torch.int32)
    rows = grouped_swiglu(x[token], weights.reshape(-1)[order], w13, w2, offsets, backend=backend)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    out.index_add_(0, token, rows.float())
    return out.to(x.dtype)


SHORT_PHASE_CALLS = 10
"""Copies of planning and of a push captured per CUDA graph at least (see :class:`Sweep`)."""

SIZED_TO_STEP = ("none", "auto")
"""Policies whose shards the bench sizes to the step (:func:`sized_to_step`)."""


def sized_to_step(plan: Plan, align: int) -> Plan:
    """Classic EP and ``auto`` on one GPU: size the shards' home rows to this step's hottest rank,
    so that R virtual shards fit (Kimi-K3 at s=8192: ~74 GB of worst-case shards otherwise).

    Real classic EP must size for the worst case (``R*S*K`` rows) or sync to learn the counts, and
    ``auto``'s home half is classic's (``EPConfig.step_rows(T, "auto")``); this favours those arms,
    never the flat one. Takes the planner's layout (before :func:`split_slot_rows`), whose home
    groups end at ``offsets[:, epn-1]``; ``auto`` keeps its slot half (``plan.slot_rows``).
    """
    epn = plan.slot_experts.shape[1]
    rows = align_up(int(plan.offsets[:, epn - 1].max()), align)
    return dataclasses.replace(plan, shard_rows=max(rows, align))


class Cell:
    """Inputs of one (tokens, maxvio) point: routing, tokens and route weights on the device."""

    def __init__(self, sweep: Sweep, config: EPConfig, tokens: int, target: float, device: torch.device, seed: int = 1234):
        self.tokens, self.target = tokens, target
        ranks, experts, top_k = config.ranks, config.experts, config.top_k
        self.sigma, self.maxvio = sigma_for_maxvio(target, ranks, experts, top_k, tokens, seed=seed, device=device)
        self.ids = skewed_topk(ranks, experts, top_k, tokens, self.sigma, seed=seed, device=device)
        generator = torch.Generator(device=device).manual_seed(seed)
        dtype = torch.bfloat16
        self.x = torch.randn(ranks, tokens, config.hidden, generator=generator, device=device).to(dtype)
        self.weights = torch.rand(ranks, tokens, top_k, generator=generator, device=device) / top_k


def _spread(name: str, timing: Timing) -> dict[str, Any]:
    return {name: timing.median, f"{name}_spread": [timing.min, timing.max]}


def rank_groups(alloc: torch.Tensor) -> list[list[list[int]]]:
    """Every rank's non-empty expert groups, as ``[expert, rows]`` pairs in expert order (its home
    experts are the ``expert // (E/R) == rank`` ones), from a plan's ``alloc [E, R]``."""
    alloc = alloc.cpu()
    return [
        [[expert, int(alloc[expert, rank])] for expert in alloc[:, rank].nonzero().flatten().tolist()]
        for rank in range(alloc.shape[1])
    ]


def model_terms_us(experts_us: list[float], push_us: list[float], rows_link_us: list[float]) -> tuple[float, int]:
    """The measured counterpart of the cost model's layer time, and its busiest rank.

    The model (``docs/cost-model.md``) charges rank ``d`` its grouped GEMMs, its push (the slower
    of what it sends and what it receives, plus a fixed cost when any expert moves) and its row
    link terms. Their counterparts: ``experts_us[d]`` and ``push_us[d]`` (rank ``d``'s experts and
    its push, measured) and ``rows_link_us[d]`` (its dispatch and combine bytes over the
    *profile's* link bandwidth: the model's own row terms, from the plan's bytes; on one GPU those
    rows never cross a link). Planning and the on-device dispatch/combine copies are not in the
    model and not in this figure (they are in ``layer_us``).

    Args:
        experts_us: ``[R]`` measured experts time per rank, µs.
        push_us: ``[R]`` measured push time per rank (:func:`push_tables`; 0 where the arm pushes nothing), µs.
        rows_link_us: ``[R]`` modelled dispatch + combine link time per rank at the profile's bandwidth, µs.

    Returns:
        ``(µs of the busiest rank, that rank)``.
    """
    times = [experts + push + link for experts, push, link in zip(experts_us, push_us, rows_link_us)]
    busiest = max(range(len(times)), key=times.__getitem__)
    return times[busiest], busiest


def _model_fields(plan: Plan, config: EPConfig, cost: CostProfile, measured_us: float) -> dict[str, Any]:
    """What the cost model says of the plan that ran: the choice, the prediction and its error.

    Called after every timing of the cell: reading ``plan.auto`` (or evaluating the model for
    another arm's plan) synchronises with the device.
    """
    if plan.auto is not None:
        auto = plan.auto
        report = auto.report()
        layer_us = (auto.prediction.layer_fs.double() / 1e9).tolist()
        moved = auto.prediction.experts_moved.tolist()
        fields = dict(
            plan_choice=report["choice"],
            predicted_us=report["predicted_us"],
            predicted_rank_us=report["predicted_rank_us"],
            model_experts_moved=report["experts_moved"],
            auto_margin=report["margin"],
            auto_candidates=[
                dict(choice=candidate.label(), predicted_us=us, experts_moved=count)
                for candidate, us, count in zip(auto.candidates, layer_us, moved)
            ],
        )
    else:
        # The same model auto uses (same constants: bf16 expert bytes), on this arm's allocation.
        prediction = predict(plan.tokens_per_expert, plan.alloc.unsqueeze(0), cost.constants(config, total_tokens=plan.total_tokens))
        fields = dict(
            plan_choice=Candidate(plan.policy, config.tolerance if plan.policy == "bounded" else 0.0).label(),
            predicted_us=int(prediction.layer_fs[0]) / 1e9,
            predicted_rank_us=(prediction.rank_fs[0].double() / 1e9).tolist(),
            model_experts_moved=int(prediction.experts_moved[0]),
        )
    fields.update(
        measured_for_model_us=measured_us,
        model_error=fields["predicted_us"] / measured_us - 1 if measured_us > 0 else None,
    )
    return fields


@dataclass
class _ArmSetup:
    """One EP arm of a cell: the policy it planned with, its plan and group, its dispatch's timing,
    and the shards its dispatch fills (``None`` before, and after the phases that use them)."""

    arm: str
    policy: str
    planner_cost: dict[str, Any]
    group: LocalGroup
    plan: Plan
    dispatch_t: Timing
    shard: Any = None
    shard_weights: Any = None
    activations: Any = None
    experts_out: Any = None


def _ep_cells(
    sweep: Sweep, config: EPConfig, cell: Cell, arms: list[str], pool: ExpertPool, device: torch.device, backend: str,
    cost: CostProfile,
) -> dict[str, dict[str, Any]]:
    """The rows of the EP ``arms`` of one cell, by arm.

    Planning, the push, every rank's experts and combine are timed with the arms interleaved
    replay by replay (:func:`flatep.bench.timing.time_interleaved`), so that the GPU's drift
    hits every arm alike; only dispatch is timed arm by arm, because a captured dispatch holds a
    copy of the arm's shards (R of them) in its graph's memory. The whole step (``ep_moe``) is
    timed last, arm by arm, after the shards are freed.
    """
    # On the GPU every phase is timed as CUDA-graph replays (as a serving step runs it): GPU time
    # without host launch overhead, which would otherwise dominate at small s.
    timing = dict(device=device, warmup=sweep.warmup, iters=sweep.iters, graph=device.type == "cuda",
                  calls=sweep.graph_calls)
    # The planner ep_moe uses: sync-free Triton on the GPU, the reference on the CPU.
    triton_planner = device.type == "cuda" and supports_triton_planner(config)
    planner = make_plan_triton if triton_planner else make_plan
    sent = sweep.dispatch_dtype()
    # As ep_moe runs them: fp8 experts read fp8 dispatch's packed rows as they arrive.
    direct = reads_packed_rows(pool, sent)
    setups = [_set_up_arm(config, cell, arm, planner, device, backend, cost, timing, sent, direct) for arm in arms]
    # The shards are filled after every dispatch is timed: at most one captured dispatch's copy of
    # them is held at a time.
    for setup in setups:
        setup.shard, setup.shard_weights = dispatch_step(cell.x, cell.weights, setup.plan, setup.group, backend,
                                                         dispatch_dtype=sent, unpack=not direct)
        setup.activations = packed_rows(setup.group, setup.shard) if direct else None
    # Every replay of the experts computes on the dispatched rows (see experts_outputs).
    for setup, out in zip(setups, experts_outputs([setup.shard for setup in setups])):
        setup.experts_out = out
    short = {**timing, "calls": max(sweep.graph_calls, SHORT_PHASE_CALLS)}
    plan_t = time_interleaved(
        [lambda s=s: split_slot_rows(planner(cell.ids, config, s.policy, **s.planner_cost)) for s in setups],
        **{**short, "graph": triton_planner},
    )
    push_by_rank = _time_pushes(setups, pool, config.ranks, backend, short)
    # experts_by_rank[rank][arm index]
    experts_by_rank = [
        time_interleaved(
            [lambda s=s, rank=rank: experts_step(s.shard, s.shard_weights, pool, s.plan, s.group, rank, backend=backend,
                                                 out=s.experts_out, activations=s.activations)
             for s in setups],
            **timing,
        )
        for rank in range(config.ranks)
    ]
    combine_t = time_interleaved(
        [lambda s=s: combine_step(s.shard, s.plan, s.group, cell.tokens, config.top_k, cell.x.dtype, backend) for s in setups],
        **timing,
    )
    for setup in setups:
        setup.shard = setup.shard_weights = setup.activations = setup.experts_out = None
    step_t = [_time_whole_step(config, cell, setup, pool, backend, timing, sent) for setup in setups]
    return {
        setup.arm: _ep_row(sweep, config, cell, setup, pool, cost, plan_t[index], [by_rank[index] for by_rank in push_by_rank],
                           [by_rank[index] for by_rank in experts_by_rank], combine_t[index], step_t[index])
        for index, setup in enumerate(setups)
    }


def _time_pushes(
    setups: list[_ArmSetup], pool: ExpertPool, ranks: int, backend: str, timing: dict[str, Any]
) -> list[list[Timing]]:
    """``[rank][arm index]``: each rank's own push, as it would run over a link of its own: the
    slower of the part it receives and the part it lends (:func:`push_tables`), each timed alone,
    the arms interleaved. Zero for arms whose plan is classic: ``ep_moe`` launches no push there."""
    pushing = [index for index, setup in enumerate(setups) if setup.plan.policy != "none"]
    by_rank = []
    for rank in range(ranks):
        tables = [push_tables(setups[index].plan.slot_experts, rank) for index in pushing]
        fns = [lambda table=table: pool.push(table, backend) for pair in tables for table in pair]
        times = time_interleaved(fns, **timing) if fns else []
        row = [Timing(0.0, 0.0, 0.0)] * len(setups)
        for position, index in enumerate(pushing):
            received, lent = times[2 * position], times[2 * position + 1]
            row[index] = Timing(max(received.median, lent.median), max(received.min, lent.min), max(received.max, lent.max))
        by_rank.append(row)
    return by_rank


def _set_up_arm(
    config: EPConfig, cell: Cell, arm: str, planner, device: torch.device, backend: str,
    cost: CostProfile, timing: dict[str, Any], dispatch_dtype: torch.dtype | None, direct: bool,
) -> _ArmSetup:
    """Plan one arm's step and time its dispatch."""
    group = LocalGroup(config.ranks, device)
    # As ep_moe plans: auto at step sizes where moving weights never pays is planned as classic,
    # and a profile goes to the planners with auto only (they refuse it otherwise).
    policy, planner_cost = planned_policy(arm_policy(arm), cost, config, config.ranks * cell.tokens)
    plan = planner(cell.ids, config, policy, **planner_cost)
    if policy in SIZED_TO_STEP:
        plan = sized_to_step(plan, config.align)
    plan = split_slot_rows(plan)
    dispatch_t = time_stats(
        lambda: dispatch_step(cell.x, cell.weights, plan, group, backend, dispatch_dtype=dispatch_dtype, unpack=not direct),
        **timing,
    )
    return _ArmSetup(arm, policy, planner_cost, group, plan, dispatch_t)


def _time_whole_step(
    config: EPConfig, cell: Cell, setup: _ArmSetup, pool: ExpertPool, backend: str, timing: dict[str, Any],
    dispatch_dtype: torch.dtype | None,
) -> Timing | None:
    """The whole layer (``ep_moe`` with the arm's plan) timed, or ``None`` where its buffers do not fit."""
    # The layer's receive buffers sized for this cell's s, not the sweep's largest: classic's and
    # auto's home halves hold R*s*K rows per virtual rank, which at Kimi-K2 with s = 8192 beside the
    # pool's experts exceed one GPU (a real rank holds one R-th of both).
    step_config = config.replace(capacity=cell.tokens)
    try:
        step_t = time_stats(
            lambda: ep_moe(cell.x, cell.ids, cell.weights, config=step_config, group=setup.group, policy=setup.policy,
                           pool=pool, plan=setup.plan, backend=backend, dispatch_dtype=dispatch_dtype,
                           **setup.planner_cost),
            **timing,
        )
    except torch.cuda.OutOfMemoryError:
        # Those buffers hold the worst case of this s (classic's and auto's home halves: R*s*K rows
        # per virtual rank, 68 GB for auto at Kimi-K2, s = 8192): where they do not fit beside the
        # pool, the phases, on shards sized to the step, are still measured.
        step_t = None
    setup.group.close()
    if step_t is None:
        torch.cuda.empty_cache()
    return step_t


def _ep_row(
    sweep: Sweep, config: EPConfig, cell: Cell, setup: _ArmSetup, pool: ExpertPool, cost: CostProfile, plan_t: Timing,
    push_t: list[Timing], experts_t: list[Timing], combine_t: Timing, step_t: Timing | None,
) -> dict[str, Any]:
    """One EP arm's row from its timings (``push_t`` and ``experts_t`` per rank); reads the device (run
    after every timing of the cell)."""
    plan, dispatch_t = setup.plan, setup.dispatch_t
    ranks, hidden, element = config.ranks, config.hidden, cell.x.element_size()
    expert_bytes = expert_weight_nbytes(pool.weights, hidden, config.intermediate)
    entries = cell.tokens * config.top_k
    padded_rows = plan.padded_rows().double().cpu()
    flops_per_row = 2 * 3 * hidden * config.intermediate
    experts_us, push_us = [t.median for t in experts_t], [t.median for t in push_t]
    slowest = int(torch.tensor(experts_us).argmax())
    slots_per_rank = (plan.slot_experts >= 0).sum(1).cpu()
    borrowed = int(slots_per_rank.sum())
    # Dispatch sends rows in the sweep's dispatch format; combine returns rows of x's dtype.
    sent_row_bytes = dispatch_row_bytes(hidden, element, sweep.dispatch_dtype())
    link_bytes = plan_link_bytes(plan, sent_row_bytes, expert_bytes, combine_row_bytes=hidden * element)
    # Rows each rank's dispatch sends (one per token and destination rank with dedup), and those that leave it.
    sent = carried(plan).reshape(ranks, -1)
    remote = sent & (plan.dest_rank.reshape(ranks, -1) != torch.arange(ranks, device=sent.device).view(-1, 1))
    sent_rows_max, remote_rows_max = int(sent.sum(1).max()), int(remote.sum(1).max())
    link_us = link_model_us(link_bytes, sweep.link_gbps)
    profile_link_us = link_model_us(link_bytes, cost.link_gbps)
    rows_link_us = [a + b for a, b in zip(profile_link_us["dispatch"], profile_link_us["combine"])]
    measured_for_model, measured_rank = model_terms_us(experts_us, push_us, rows_link_us)
    # Bytes the dispatch and combine kernels read plus write, all virtual ranks together.
    dispatch_kernel_bytes = ranks * (cell.tokens + entries) * sent_row_bytes
    combine_kernel_bytes = ranks * (cell.tokens + entries) * hidden * element
    received = plan.received.double().cpu()

    # Dispatch and combine are one launch for all virtual ranks (each rank pays 1/R of it); every
    # rank's push and experts are timed on their own.
    def shared(pick) -> float:
        return pick(plan_t) + (pick(dispatch_t) + pick(combine_t)) / ranks

    def layer(pick) -> float:
        """Slowest-rank layer time from one statistic (median, min or max) of every phase."""
        return shared(pick) + max(pick(push) + pick(experts) for push, experts in zip(push_t, experts_t))

    def layer_with_link(rank: int) -> float:
        """Rank ``rank``'s layer time over a link of ``sweep.link_gbps`` (medians): its push as the
        slower of the copy measured and the link model's, plus the modelled dispatch and combine."""
        link = link_us["dispatch"][rank] + link_us["combine"][rank] + max(push_us[rank], link_us["push"][rank])
        return shared(lambda t: t.median) + experts_us[rank] + link

    layer_us = layer(lambda t: t.median)
    busiest = max(range(ranks), key=layer_with_link)
    push_rank = max(range(ranks), key=push_us.__getitem__)
    return dict(
        **_spread("plan_us", plan_t),
        **_spread("dispatch_us", dispatch_t),
        **_spread("push_us", push_t[push_rank]),
        push_us_by_rank=push_us,
        experts_us_max=max(experts_us),
        experts_us_mean=sum(experts_us) / ranks,
        experts_us=experts_us,
        experts_us_spread=[[t.min, t.max] for t in experts_t],
        **_spread("combine_us", combine_t),
        **(_spread("step_us", step_t) if step_t else {"step_us": None, "step_note": "out of memory (whole-step buffers)"}),
        layer_us=layer_us,
        layer_us_spread=[layer(lambda t: t.min), layer(lambda t: t.max)],
        dispatch_bytes=sent_rows_max * sent_row_bytes,
        combine_bytes=sent_rows_max * hidden * element,
        expert_bytes=expert_bytes,
        push_bytes=borrowed * expert_bytes,
        borrowed_experts=borrowed,
        experts_moved=borrowed,
        weight_bytes_moved=borrowed * expert_bytes,
        plan_policy=plan.policy,
        shard_rows=plan.shard_rows,
        shard_sized_to_step=setup.policy in SIZED_TO_STEP,
        dispatch_copy_fraction=dispatch_kernel_bytes / dispatch_t.median / 1e3,
        combine_copy_fraction=combine_kernel_bytes / combine_t.median / 1e3,
        experts_tflops_slowest=float(padded_rows[slowest]) * flops_per_row / experts_us[slowest] / 1e6,
        # Weights the slowest rank's GEMMs read: every expert with rows, once (decode is read bound).
        weight_bytes_read_slowest=int(plan.active_groups()[slowest]) * expert_bytes,
        experts_read_gbps_slowest=int(plan.active_groups()[slowest]) * expert_bytes / experts_us[slowest] / 1e3,
        rows_max=int(received.max()),
        # Each rank's expert groups as (expert, rows) pairs, home experts first (the cost model's
        # input; with experts_us, what its GEMM term is checked and fitted against).
        rank_groups=rank_groups(plan.alloc),
        rows_mean=float(received.mean()),
        padded_rows_max=int(padded_rows.max()),
        step_align=config.step_align(config.ranks * cell.tokens),
        remote_rows_max=remote_rows_max,
        link_bytes=link_bytes,
        link_model_us_per_rank=link_us,
        link_model_us=max(link_us["total"]),
        layer_with_link_model_us=layer_with_link(busiest),
        layer_with_link_model_rank=busiest,
        model_expert_bytes=cost.constants(config).weight_bytes,
        measured_for_model_rank=measured_rank,
        **_model_fields(plan, config, cost, measured_for_model),
    )


def _dense_cell(sweep: Sweep, config: EPConfig, cell: Cell, weights: "DenseWeights", device: torch.device, backend: str) -> dict[str, Any]:
    w13, w2 = weights
    x = cell.x.reshape(-1, config.hidden)
    ids = cell.ids.reshape(-1, config.top_k)
    route = cell.weights.reshape(-1, config.top_k)
    dense = time_stats(lambda: dense_step(x, ids, route, w13, w2, backend), device, sweep.warmup, sweep.iters,
                       graph=device.type == "cuda", calls=sweep.graph_calls)
    share = [dense.min / config.ranks, dense.max / config.ranks]
    return dict(
        plan_us=0.0, dispatch_us=0.0, push_us=0.0, combine_us=0.0,
        experts_us_max=dense.median / config.ranks, experts_us_mean=dense.median / config.ranks,
        dense_us=dense.median, dense_us_spread=[dense.min, dense.max],
        layer_us=dense.median / config.ranks, layer_us_spread=share,
        step_us=dense.median, step_us_spread=[dense.min, dense.max],
        dispatch_bytes=0, combine_bytes=0, push_bytes=0,
        experts_tflops_slowest=x.shape[0] * config.top_k * 2 * 3 * config.hidden * config.intermediate / dense.median / 1e6,
    )


class SharedWeightsGroup(LocalGroup):
    """Virtual ranks whose symmetric buffers share one rank's memory (stride 0 over ranks).

    Used only for expert pools too large for R copies on one device (Kimi-K3: 2*E experts of 66 MB
    is 118 GB): every rank computes with, and every push still moves, a full set of weight bytes;
    only their values are shared.
    """

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((1, *shape), dtype=dtype, device=self.device).expand(self.world, *shape)

    def peer_offsets(self, buffer: torch.Tensor) -> torch.Tensor:
        return torch.zeros(self.world, dtype=torch.int64, device=buffer.device)


DenseWeights = tuple[torch.Tensor | QuantizedTensor, torch.Tensor | QuantizedTensor]
"""The dense arm's ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``: bf16 tensors, or packed in the pool's format."""


def _matrices(config: EPConfig) -> dict[str, tuple[int, int]]:
    """``[rows, columns]`` of one expert's matrix per projection: ``w13 [2I, H]``, ``w2 [H, I]``."""
    return {"w13": (2 * config.intermediate, config.hidden), "w2": (config.hidden, config.intermediate)}


def fill_random(tensors: dict[str, torch.Tensor], config: EPConfig, weights: str) -> None:
    """Fill experts ``[n, ...]`` of ``w13`` and ``w2`` (and of ``w13_scale``, ``w2_scale`` when
    ``weights`` is quantized) with N(0, 1/fan_in) values in format ``weights``, one expert at a time
    (fp32 scratch of one expert's matrix)."""
    for name, (rows, columns) in _matrices(config).items():
        target = tensors[name]
        for index in range(target.shape[0]):
            weight = torch.randn(rows, columns, device=target.device) * columns**-0.5
            if weights == "bf16":
                target[index].copy_(weight)
                continue
            packed = QuantizedTensor.quantize(weight, weights).in_layout(pool_layout(weights))
            target[index].copy_(packed.values)
            tensors[f"{name}_scale"][index].copy_(packed.scales)


def _as_weights(tensors: dict[str, torch.Tensor], weights: str) -> DenseWeights:
    """``(w13, w2)`` from the named tensors: plain, or :class:`QuantizedTensor` with their scales."""
    if weights == "bf16":
        return tensors["w13"], tensors["w2"]
    return tuple(QuantizedTensor(weights, tensors[name], tensors[f"{name}_scale"], pool_layout(weights))
                 for name in ("w13", "w2"))


def _pool_fits(config: EPConfig, device: torch.device, weights: str) -> bool:
    """Whether R copies of the pool (home experts and slots, packed) fit; the dense arm computes with a view of them."""
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return 2 * config.experts * expert_weight_nbytes(weights, config.hidden, config.intermediate) < 0.6 * free


def _random_weights(
    config: EPConfig, device: torch.device, arms: list[str], weights: str
) -> tuple[ExpertPool | None, DenseWeights | None, bool]:
    """A pool in format ``weights`` with random values for the EP arms, the dense arm's weights
    (:data:`DenseWeights`, same format), and ``True`` if the pool's weights are shared across
    virtual ranks.

    Both live for the whole sweep, so that every cell runs its arms back to back. Unshared, the
    dense weights are a view of the pool's home experts (no second copy), so the dense arm runs
    the same packed weights through the same grouped GEMMs.
    """
    ep_arms = [arm for arm in arms if arm_policy(arm) is not None]
    wants_dense = "dense" in arms
    shared = not _pool_fits(config, device, weights)
    pool, home = None, {}
    if ep_arms or (wants_dense and not shared):
        group = (SharedWeightsGroup if shared else LocalGroup)(config.ranks, device)
        pool = ExpertPool(config, group, torch.bfloat16, weights=weights)
        # Shared: the R ranks' home experts are one rank's memory, filled once. Unshared: a view of all E.
        home = {name: pool.home(name)[0] if shared else pool.home(name).view(config.experts, *pool.expert_shape(name)[1:])
                for name in pool.names}
        fill_random(home, config, weights)
    dense = None
    if wants_dense:
        dense = _as_weights(_random_dense_tensors(config, device, weights) if shared else home, weights)
    return (pool if ep_arms else None), dense, shared


def _random_dense_tensors(config: EPConfig, device: torch.device, weights: str) -> dict[str, torch.Tensor]:
    """All ``E`` experts' weights in format ``weights`` for the dense arm, apart from a shared pool."""
    tensors = {}
    for name, (rows, columns) in _matrices(config).items():
        if weights == "bf16":
            tensors[name] = torch.empty(config.experts, rows, columns, dtype=torch.bfloat16, device=device)
            continue
        (values, values_dtype), (scales, scales_dtype) = packed_layout(weights, rows, columns)
        tensors[name] = torch.empty(config.experts, *values, dtype=values_dtype, device=device)
        tensors[f"{name}_scale"] = torch.empty(config.experts, *scales, dtype=scales_dtype, device=device)
    fill_random(tensors, config, weights)
    return tensors


def read_results(path: Path) -> list[dict[str, Any]]:
    """Every cell already in a ``results.jsonl``."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def cells(sweep: Sweep) -> Iterator[tuple[str, int, float]]:
    """``(arm, tokens, maxvio target)`` of every cell, cell by cell: every arm of one (tokens,
    maxvio) point runs before the next point, on the same inputs."""
    for tokens in sweep.tokens:
        for target in sweep.maxvio:
            for arm in sweep.arms:
                yield arm, tokens, float(target)


def _points(todo: list[tuple[str, int, float]]) -> Iterator[tuple[tuple[int, float], list[str]]]:
    """``((tokens, maxvio target), arms)`` of every point with cells to run, in the order of ``todo``
    (the order of :func:`cells`), its arms in the sweep's order."""
    arms_by_point: dict[tuple[int, float], list[str]] = {}
    for arm, tokens, target in todo:
        arms_by_point.setdefault((tokens, target), []).append(arm)
    yield from arms_by_point.items()


def _check_resumable(rows: list[dict[str, Any]], identity: dict[str, Any], path: Path) -> None:
    """Refuse to append to results of another config (or an older flatep that did not record it)."""
    for row in rows:
        differ = {key: (row.get(key), value) for key, value in identity.items() if row.get(key) != value}
        if differ:
            shown = ", ".join(f"{key}: {old!r} there, {new!r} now" for key, (old, new) in sorted(differ.items()))
            raise ValueError(f"--resume: {path} holds results of another sweep config ({shown}); use another --out or drop --resume")


def run(sweep: Sweep, out_dir: Path, device: torch.device, resume: bool = False, progress: bool = True, backend: str = "auto") -> list[dict[str, Any]]:
    """Run the sweep, appending one JSON object per cell to ``out_dir/results.jsonl``.

    With ``resume``, cells already in the file are skipped; a file written by another config
    (any field of :data:`IDENTITY` differs) raises ``ValueError``. Returns every row of the file.
    """
    from tqdm import tqdm

    backend = resolve_backend(backend, device)
    on_gpu = device.type == "cuda"
    hardware = device_name(device)
    config = sweep.ep_config(max(sweep.tokens))
    cost = sweep.cost_profile()
    identity = dict(
        sweep=sweep.name, model=sweep.model_name, ranks=sweep.ranks, hidden=config.hidden, experts=config.experts,
        top_k=config.top_k, intermediate=config.intermediate, align=config.align, tolerance=config.tolerance,
        dedup=config.dedup, link_gbps_model=sweep.link_gbps, warmup=sweep.warmup, iters=sweep.iters,
        graph_calls=sweep.graph_calls, device=hardware,
        backend=backend, weights=sweep.weights, layout=pool_layout(sweep.weights), dispatch=sweep.dispatch,
        cost_profile=cost.to_dict(),
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    results_path = out_dir / "results.jsonl"
    if resume:
        _check_resumable(read_results(results_path), identity, results_path)
    elif results_path.exists():
        results_path.unlink()
    done = {tuple(row[k] for k in CELL_KEY) for row in read_results(results_path)}
    # The fractions of a ceiling are GPU figures: a CPU's copy and GEMM rates at these sizes say
    # little about its kernels (a 512^3 bf16 product can be slower than the experts' fp32 path).
    ceilings = dict(
        copy_ceiling_gbps=copy_ceiling_gbps(device, 1024) if on_gpu else None,
        read_ceiling_gbps=read_ceiling_gbps(device, 4096) if on_gpu else None,
        gemm_ceiling_tflops=gemm_ceiling_tflops(device, 8192) if on_gpu else None,
    )
    todo = [c for c in cells(sweep) if (sweep.model_name, sweep.ranks, c[1], c[2], c[0]) not in done]
    pool, dense_weights, shared = _random_weights(config, device, sweep.arms, sweep.weights) if todo else (None, None, False)
    if pool is not None and cost.expert_bytes is None:
        cost = cost.with_expert_bytes(pool.expert_nbytes())  # as ep_moe does: the model counts packed bytes
    if packs_rows(sweep.dispatch_dtype()) and cost.row_bytes is None:  # and the link bytes of packed rows
        cost = cost.with_row_bytes(entry_link_bytes(config.hidden, 2, sweep.dispatch_dtype()))
    bar = tqdm(total=len(todo), desc=f"flatep bench {sweep.name}", disable=not progress, unit="cell")
    with results_path.open("a") as results:
        for (tokens, target), arms in _points(todo):
            bar.set_postfix(tokens=tokens, maxvio=target)
            cell = Cell(sweep, config, tokens, target, device)
            ep_arms = [arm for arm in arms if arm != "dense"]
            measured, peak_memory_gb = {}, {}
            # The EP arms run together (one peak, all their shards held at once), the dense arm after them.
            for part in ([ep_arms] if ep_arms else []) + ([["dense"]] if "dense" in arms else []):
                if on_gpu:
                    torch.cuda.reset_peak_memory_stats(device)
                if part == ["dense"]:
                    measured["dense"] = _dense_cell(sweep, config, cell, dense_weights, device, backend)
                else:
                    measured.update(_ep_cells(sweep, config, cell, part, pool, device, backend, cost))
                peak_memory_gb.update({arm: torch.cuda.max_memory_allocated(device) / 1e9 if on_gpu else None for arm in part})
            for arm in arms:
                row = dict(
                    **identity, tokens=tokens, maxvio_target=target, maxvio=cell.maxvio, sigma=cell.sigma, arm=arm,
                    **ceilings, **measured[arm],
                    peak_memory_gb=peak_memory_gb[arm],
                    weights_shared_across_virtual_ranks=shared and arm != "dense",
                    timing="cuda_graph" if on_gpu else "eager",
                )
                for name in ("dispatch_copy_fraction", "combine_copy_fraction"):
                    if name in row:
                        row[name] = row[name] / row["copy_ceiling_gbps"] if on_gpu else None
                row["experts_gemm_fraction"] = row["experts_tflops_slowest"] / row["gemm_ceiling_tflops"] if on_gpu else None
                if "experts_read_gbps_slowest" in row:
                    row["experts_read_fraction"] = row["experts_read_gbps_slowest"] / row["read_ceiling_gbps"] if on_gpu else None
                results.write(json.dumps({k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}) + "\n")
                results.flush()
            bar.update(len(arms))
    bar.close()
    return read_results(results_path)
