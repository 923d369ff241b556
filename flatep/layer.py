"""The expert-parallel MoE layer: route, plan, dispatch, experts, combine.

On the local transport every tensor carries a leading rank dimension (``x [R, s, H]``); on the
per-process transports it does not (``x [s, H]``). That is the only difference users see.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatep.backward import differentiable_step
from flatep.config import POLICIES, EPConfig, check_policy
from flatep.experts.grouped import (
    PRECISIONS,
    Activation,
    grouped_swiglu,
    swiglu,
    takes_decode_kernels,
    takes_packed_kernels,
)
from flatep.experts.pool import ExpertPool, check_expert_weights, check_slot_sets
from flatep.kernels.backend import check_programs, interpreting, use_triton
from flatep.exchange import combine_rows, dispatch_rows, pack_rows, unpack_rows
from flatep.kernels.combine import combine_grid
from flatep.kernels.decode_gemm import DECODE_ROWS_PER_GROUP
from flatep.kernels.dispatch import dispatch_grid
from flatep.kernels.fp8_rows import FP8_DISPATCH, Fp8Rows, check_dispatch_dtype, entry_link_bytes, packed_words, packs_rows
from flatep.plan.auto import candidates_for, slot_rows
from flatep.plan.cost import CostProfile, check_cost
from flatep.plan.reference import _check_ids, _valid_mask, dedup_tables, histogram, make_plan, plan_rank
from flatep.plan.split import split_slot_rows
from flatep.plan.triton import count_rank_triton, make_plan_triton, plan_rank_triton, supports_triton_planner
from flatep.plan.types import Layout, MadeFor, Plan, RankPlan, ids_fingerprint
from flatep.quant.tensor import QuantizedTensor, expert_weight_nbytes
from flatep.transport.base import Group

# What ranks of a per-process group must agree on before they exchange anything sized by it.
_AGREED = ("s", "R", "E", "K", "H", "I", "capacity", "align", "tolerance", "dedup", "policy", "dtype", "dispatch")
_DTYPE_CODES = {None: 0, torch.bfloat16: 1, torch.float32: 2}
_TOLERANCE_SCALE = 2**20  # the header is int64: tolerance travels in fixed point


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _checks_now(group: Group) -> bool:
    """Whether this step may read back to the host to check itself (see :attr:`Group.eager_check`)."""
    return group.eager_check and not _capturing()


def _check_types(config: object, group: object, **tensors: object) -> None:
    """Clear errors for arguments of the wrong type, before anything looks inside them."""
    if not isinstance(config, EPConfig):
        raise ValueError(f"config must be a flatep.EPConfig, got {type(config).__name__}: {config!r}")
    if not isinstance(group, Group):
        raise ValueError(f"group must be a flatep Group from flatep.init_group, got {type(group).__name__}: {group!r}")
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")


def _cost_of_this_step(
    cost: CostProfile | None, pool: ExpertPool | None, w13: torch.Tensor | QuantizedTensor | None, config: EPConfig,
    dtype: torch.dtype, dispatch_dtype: torch.dtype | None,
) -> CostProfile:
    """``auto``'s profile with the bytes one expert of this step's weights really has (packed fp8 or
    mxfp4 values and scales, biases) and, with fp8 dispatch, the link bytes of one entry (a packed
    row out, the route weight, a row of ``dtype`` back), unless the profile already says."""
    cost = CostProfile.default() if cost is None else cost
    if packs_rows(dispatch_dtype) and cost.row_bytes is None:
        cost = cost.with_row_bytes(entry_link_bytes(config.hidden, dtype.itemsize, dispatch_dtype))
    if cost.expert_bytes is not None:
        return cost
    if pool is not None:
        return cost.with_expert_bytes(pool.expert_nbytes())
    if isinstance(w13, QuantizedTensor):
        return cost.with_expert_bytes(expert_weight_nbytes(w13.format, config.hidden, config.intermediate))
    return cost


def requiring_grad(**tensors: torch.Tensor | None) -> list[str]:
    """Names of ``tensors`` that autograd would differentiate through (grad enabled and requiring grad)."""
    if not torch.is_grad_enabled():
        return []
    return [name for name, tensor in tensors.items() if isinstance(tensor, torch.Tensor) and tensor.requires_grad]


def refuse_autograd(reason: str, **tensors: torch.Tensor | None) -> None:
    """Raise if autograd would have to flow through a FlatEP path that has no backward.

    Args:
        reason: why this path has none (starts the message).
        tensors: the inputs of the path, by name.

    Raises:
        NotImplementedError: with grad enabled, if any of ``tensors`` requires grad (the output
            would otherwise silently carry no gradient to them).
    """
    needing = requiring_grad(**tensors)
    if needing:
        raise NotImplementedError(
            f"{reason}, but {', '.join(needing)} require grad: run it under torch.no_grad() "
            "or torch.inference_mode() (or detach them)"
        )


def _without_backward(pool: ExpertPool | None, w13: object, dispatch_dtype: torch.dtype | None) -> str | None:
    """Why a step with these arguments has no backward, or ``None`` when it has one (on every transport)."""
    if pool is not None:
        # A pool holds copies of the weights: training through it would leave the weights the
        # caller optimises (e.g. a model's experts) silently without gradients.
        return ("ep_moe has no backward through a prebuilt pool= (pass w13, w2, and b13, b2, as tensors to train "
                "the experts)")
    if isinstance(w13, QuantizedTensor):
        return f"ep_moe has no backward through {w13.format} expert weights"
    if packs_rows(dispatch_dtype):
        return "ep_moe has no backward through fp8 dispatch (dispatch_dtype=torch.float8_e4m3fn)"
    return None


def _as_all_experts(tensor: torch.Tensor | None, config: EPConfig) -> torch.Tensor | None:
    """A shape-only ``[E, ...]`` stand-in (on the meta device, no memory) for a rank's ``[epn, ...]``
    slice, so the all-experts check applies to it; any other tensor as it is."""
    if isinstance(tensor, torch.Tensor) and tensor.shape[:1] == (config.experts_per_rank,):
        return torch.empty((config.experts, *tensor.shape[1:]), dtype=tensor.dtype, device="meta")
    return tensor


def planned_policy(policy: str, cost: CostProfile | None, config: EPConfig, total_tokens: int) -> tuple[str, dict]:
    """The policy a step is planned with, and the planner's cost argument.

    ``auto`` steps where moving weights can never pay (:func:`flatep.plan.auto.candidates_for`
    keeps classic alone; decided from ``T`` on the host, so a captured graph keeps it) are
    planned as ``none``: classic's plan, unsplit, with no model to evaluate and no slot half, so
    such a step costs what classic costs. The plan still says it was made for ``auto``
    (``plan.made_for.policy``) and uses ``auto``'s buffers.
    """
    if policy != "auto":
        return policy, {}
    if len(candidates_for(config, cost, total_tokens)) == 1:
        return "none", {}
    return policy, {"cost": cost}


def buffer_rows(config: EPConfig, policy: str) -> int:
    """Rows of the receive buffers of a group for ``config`` and ``policy``: those of a full step (``s = S``).

    Every step of any ``s`` uses the same buffers, so memory does not grow with the number of
    distinct batch sizes a run sees. ``exact`` and ``bounded`` plans come in the split layout (twice
    the planner's rows: home rows, then slot rows); ``none`` plans borrow nothing; ``auto`` plans
    have a home half sized like ``none`` and a slot half sized by
    :func:`flatep.plan.auto.slot_rows` (not twice the home half, which at Kimi-K2 sizes alone
    would not fit a GPU's memory).
    """
    if policy == "auto":
        return config.shard_rows(policy) + slot_rows(config, config.ranks * config.capacity)
    return config.shard_rows(policy) * (1 if policy == "none" else 2)


def link_buffer(group: Group, rows: int) -> torch.Tensor:
    """The group's ``[.., rows, 2]`` int32 link table of shards of ``rows`` rows (written by dispatch, read by combine)."""
    return group.buffer("shard_links", (rows, 2), torch.int32)


def packed_buffer(group: Group, rows: int, hidden: int) -> torch.Tensor:
    """The group's ``[.., rows, W]`` int32 receive buffer of packed fp8 rows (:mod:`flatep.kernels.fp8_rows`)."""
    return group.buffer("shard_fp8", (rows, packed_words(hidden)), torch.int32)


def shard_buffers(
    group: Group, config: EPConfig, policy: str, dtype: torch.dtype, dispatch_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's receive buffers for ``config``/``policy``/``dtype``: ``(shard [.., rows, H], weights [.., rows] fp32)``.

    Allocated on first use (collectively, on the per-process transports) and reused by every layer
    and step of that shape, ``rows`` = :func:`buffer_rows`. With fp8 dispatch (``dispatch_dtype``)
    the packed rows land in a :func:`packed_buffer` first, allocated here too.
    """
    rows = buffer_rows(config, policy)
    link_buffer(group, rows)  # allocated with the shards (collectively on nvlink), not first inside a step
    if packs_rows(dispatch_dtype):
        packed_buffer(group, rows, config.hidden)
    return (group.buffer("shard", (rows, config.hidden), dtype), group.buffer("shard_weights", (rows,), torch.float32))


def check_plan(
    plan: Layout, topk_ids: torch.Tensor, config: EPConfig, group: Group, policy: str,
    dispatch_dtype: torch.dtype | None = None, dtype: torch.dtype | None = None,
) -> Layout:
    """Refuse a plan that was not made for this step, before any kernel trusts its destinations.

    Host facts (policy, ``s``, ``K``, config, token counts, rank, whether rows cross in fp8, the
    activation dtype if the plan recorded one) raise at once. The last two keep the ranks of a
    per-process group agreeing on ``dispatch_dtype`` and on ``x``'s dtype: they agreed on them in
    :func:`plan_step`, and each step must pass the ones its plan was made for. On the device,
    without synchronising: the ids' fingerprint must equal the plan's (plans from
    :func:`plan_step`), and every planned entry must land inside the real rows of its own
    expert's group on its destination; otherwise the group's ``plan`` error flag is set
    (:meth:`Group.check`) and the destinations are clamped into the shard, so no kernel writes or
    reads outside it.

    Args:
        plan: a plan (from :func:`plan_step`, or from the planner functions).
        topk_ids: ``[R, s, K]`` (local) or ``[s, K]`` int32 ids of this step (checked already).
        dispatch_dtype: the step's (see :func:`ep_moe`).
        dtype: the step's activation dtype (``x``'s).

    Returns:
        The plan in the split layout, its destinations clamped.

    Raises:
        ValueError: for a plan made with other host-side facts.
    """
    if not isinstance(plan, Layout) or not hasattr(plan, "dest_rank"):
        raise ValueError(f"plan must be a Plan or RankPlan from flatep.plan_step, got {type(plan).__name__}")
    made_with = plan.policy if plan.made_for is None else plan.made_for.policy
    if made_with != policy:
        raise ValueError(f"plan was made with policy {made_with!r}, not {policy!r}")
    if not group.stacked and not (isinstance(plan, RankPlan) and plan.rank == group.first_rank):
        raise ValueError(f"plan must be this rank's RankPlan (rank {group.first_rank}), from plan_step")
    if tuple(plan.dest_rank.shape) != tuple(topk_ids.shape) or tuple(plan.tokens_per_expert.shape) != (config.ranks, config.experts):
        raise ValueError(
            f"plan was made for ids of shape {list(plan.dest_rank.shape)} and {list(plan.tokens_per_expert.shape)[::-1]} "
            f"experts x ranks, not {list(topk_ids.shape)} with E={config.experts}, R={config.ranks}"
        )
    origin = plan.made_for
    if origin is not None:
        if origin.config != config:
            raise ValueError(f"plan was made for {origin.config}, not {config}")
        if origin.tokens != topk_ids.shape[-2]:
            raise ValueError(f"plan was made for s={origin.tokens} tokens per rank, not {topk_ids.shape[-2]}")
        if origin.packed_rows != packs_rows(dispatch_dtype):
            made = "torch.float8_e4m3fn" if origin.packed_rows else "None (rows in x's dtype)"
            raise ValueError(f"plan was made for dispatch_dtype={made}, not {dispatch_dtype}: pass plan_step the "
                             f"step's dispatch_dtype")
        if origin.dtype is not None and dtype is not None and origin.dtype != dtype:
            raise ValueError(f"plan was made for activations in {origin.dtype} (plan_step's dtype), not {dtype}")
        group.flag("plan", ids_fingerprint(topk_ids) != origin.fingerprint)
    plan = split_slot_rows(plan)
    ranks, experts = config.ranks, config.experts
    dest_rank, dest_row = plan.dest_rank.long(), plan.dest_row.long()
    planned = dest_rank >= 0
    rank = dest_rank.clamp(0, ranks - 1)
    expert = topk_ids.long().clamp(0, experts - 1)
    start = plan.group_start.long()[rank, expert]
    count = plan.alloc.long()[expert, rank]
    fits = (topk_ids >= 0) & (topk_ids < experts) & (dest_rank < ranks) & (start >= 0) & (dest_row >= start)
    group.flag("plan", planned & ~(fits & (dest_row < start + count)))
    safe_rank = torch.where(planned, rank, -1).to(torch.int32)
    safe_row = torch.where(planned, dest_row.clamp(0, plan.shard_rows - 1), -1).to(torch.int32)
    if plan.dedup != config.dedup:
        raise ValueError(f"plan was made with dedup={plan.dedup}, not with the config's dedup={config.dedup}")
    # The kernels index entries through carrier and send_order: use tables derived from the safe
    # destinations, and flag a plan whose own tables differ.
    carrier, send_order = dedup_tables(safe_rank, config.dedup)
    group.flag("plan", (carrier != plan.carrier) | (send_order != plan.send_order))
    return dataclasses.replace(plan, dest_rank=safe_rank, dest_row=safe_row, carrier=carrier, send_order=send_order)


def check_inputs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, config: EPConfig, group: Group,
    backend: str = "auto", comm_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the layer's inputs before any kernel runs; return them contiguous, ids int32, weights fp32.

    With the Triton kernels (``backend``), also the launch limits of dispatch and combine for
    these ``s`` and ``comm_programs`` (before anything is copied).

    Raises:
        ValueError: naming the argument and what was expected.
    """
    _check_types(config, group, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
    leading = (group.world,) if group.stacked else ()
    layout = "[R, s, H]" if group.stacked else "[s, H]"
    if x.dim() != len(leading) + 2 or tuple(x.shape[: len(leading)]) != leading or x.shape[-1] != config.hidden:
        raise ValueError(f"x must have shape {layout} with R={group.world}, H={config.hidden}, got {list(x.shape)}")
    tokens = x.shape[-2]
    if not 1 <= tokens <= config.capacity:
        raise ValueError(f"x: tokens per rank s must be in [1, capacity={config.capacity}], got {tokens}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bfloat16 or float32, got {x.dtype}")
    expected = (*leading, tokens, config.top_k)
    for name, tensor in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} must have shape {list(expected)}, got {list(tensor.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be a floating-point tensor, got {topk_weights.dtype}")
    for name, tensor in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tensor.device != group.device:
            raise ValueError(f"{name} must be on the group's device {group.device}, got {tensor.device}")
    if use_triton(x.device, backend) and group.peer_addressable:
        ranks_here = len(group.local_ranks)
        dispatch_grid(ranks_here, tokens, programs=comm_programs)
        combine_grid(ranks_here, tokens, programs=comm_programs)
    return x.contiguous(), topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous()


def plan_step(
    topk_ids: torch.Tensor,
    config: EPConfig,
    group: Group,
    policy: str = "exact",
    tokens: list[int] | int | None = None,
    dtype: torch.dtype | None = None,
    cost: CostProfile | None = None,
    dispatch_dtype: torch.dtype | None = None,
) -> Plan | RankPlan:
    """Plan one step, on any transport: THE way to plan outside :func:`ep_moe` (e.g. before a CUDA graph).

    Returns a :class:`Plan` of all ranks on the local transport, else this rank's
    :class:`RankPlan`, in the layer's split layout (:func:`flatep.plan.split.split_slot_rows`),
    carrying what it was made for (:class:`flatep.plan.types.MadeFor`: config, policy, ``s``,
    token counts and a device fingerprint of the ids), so that :func:`ep_moe` refuses it for
    other ids. ``make_plan``/``plan_rank`` are the reference planner itself (the specification).

    On a per-process group this is collective (every rank must call it). The ranks gather a
    fixed-size header (``s``, the config, the policy, the activation dtype, whether rows cross in
    fp8, their real token count and whether their ids are valid), then the ``[E]`` histograms, and each plans its own
    entries. With ``group.eager_check`` (outside CUDA-graph capture) every rank reads the header
    and all raise ``ValueError`` together if they disagree or any rank's input is bad; otherwise
    nothing is read back and a disagreement sets the ``step`` error flag (:meth:`Group.check`).

    Args:
        topk_ids: ``[R, s, K]`` (local) or ``[s, K]`` int32/int64 expert ids.
        config: group sizes.
        group: from :func:`flatep.init_group`.
        policy: ``exact``, ``bounded``, ``none`` or ``auto``.
        tokens: real tokens per rank, rows beyond are padding: ``[R]`` counts on the local
            transport, this rank's count (an int) on a per-process one (default ``s``).
        dtype: activation dtype the ranks must agree on (per-process groups; ``None``: not
            checked); a step given the plan must then run in it.
        cost: the :class:`flatep.CostProfile` of ``policy="auto"`` (per-process ranks must pass the same).
        dispatch_dtype: ``torch.float8_e4m3fn`` if the step will dispatch fp8 rows (per-process
            groups: the ranks must agree; see :func:`ep_moe`).

    On CUDA the sync-free Triton planner plans (bit-equal to the reference planner, which plans on
    CPU and for configs beyond the Triton planner's limits). Ids of real tokens outside ``[0, E)``
    raise ``ValueError`` when the group checks eagerly; otherwise (and always under capture) they
    set the ``ids`` error flag and their entries are left out of the plan.

    Raises:
        ValueError: for bad arguments (types, shapes, ids when checked eagerly, disagreeing ranks).
    """
    _check_types(config, group, topk_ids=topk_ids)
    check_policy(policy)
    check_cost(policy, cost)
    if topk_ids.device != group.device:
        raise ValueError(f"topk_ids must be on the group's device {group.device}, got {topk_ids.device}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if dispatch_dtype not in (*_DTYPE_CODES, FP8_DISPATCH):
        raise ValueError(f"dispatch_dtype must be None, torch.bfloat16, torch.float32 or torch.float8_e4m3fn, "
                         f"got {dispatch_dtype}")
    if packs_rows(dispatch_dtype):
        packed_words(config.hidden)  # raises for a hidden size fp8 rows cannot take
    ids = topk_ids.contiguous()
    if group.stacked:
        total = ids.shape[0] * ids.shape[1] if tokens is None else sum(int(count) for count in tokens)
        planned, planner_cost = planned_policy(policy, cost, config, max(total, 1))
        if not (ids.is_cuda and supports_triton_planner(config)):
            plan = make_plan(ids, config, planned, tokens, **planner_cost)
        else:
            counts = [ids.shape[1]] * config.ranks if tokens is None else [int(count) for count in tokens]
            if _checks_now(group):
                _valid_mask(ids, counts, config.experts, "topk_ids")
            else:
                group.flag("ids", _invalid_ids(ids, counts, config.experts))
            plan = make_plan_triton(ids, config, planned, tokens, **planner_cost)
        counts = None if tokens is None else tuple(int(count) for count in tokens)
    else:
        if dtype not in _DTYPE_CODES:
            raise ValueError(f"dtype must be torch.bfloat16, torch.float32 or None, got {dtype}")
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int)):
            raise ValueError(f"tokens must be this rank's token count (an int) on a per-process group, got {tokens!r}")
        plan = _plan_this_rank(ids, config, group, policy, tokens, dtype, cost, packs_rows(dispatch_dtype))
        counts = tokens
    made_for = MadeFor(config=config, policy=policy, tokens=ids.shape[-2], counts=counts, fingerprint=ids_fingerprint(ids),
                       packed_rows=packs_rows(dispatch_dtype), dtype=dtype)
    return dataclasses.replace(split_slot_rows(plan), made_for=made_for)


def _invalid_ids(topk_ids: torch.Tensor, counts: list[int] | int, experts: int) -> torch.Tensor:
    """``bool`` per entry: a real token's id outside ``[0, E)``.

    Device ops with host scalars only (no host-to-device copy), so it can be captured in a graph.
    """
    positions = torch.arange(topk_ids.shape[-2], device=topk_ids.device).view(-1, 1)
    real = torch.stack([positions < count for count in counts]) if isinstance(counts, list) else positions < counts
    return real & ((topk_ids < 0) | (topk_ids >= experts))


def _header(
    group: Group, config: EPConfig, policy: str, dtype: torch.dtype | None, packed: bool, step: int, real: int,
    ok: torch.Tensor,
) -> torch.Tensor:
    """``[len(_AGREED) + 2] int64`` on the group's device: what ranks must agree on, the real token count, ids valid.

    The config part is copied to the device once per (config, policy, dtype, packed) and cached on the
    group; ``s`` and the real count are filled by kernels, so building it never copies from the
    host (a pageable host-to-device copy synchronises, and could not be captured).
    """
    constants = group.__dict__.setdefault("_header_constants", {})
    key = (config, policy, dtype, packed)
    if key not in constants:
        values = [config.ranks, config.experts, config.top_k, config.hidden, config.intermediate, config.capacity,
                  config.align, round(config.tolerance * _TOLERANCE_SCALE), int(config.dedup), POLICIES.index(policy),
                  _DTYPE_CODES[dtype], int(packed)]
        constants[key] = torch.tensor(values, dtype=torch.int64, device=group.device)
    counts = torch.empty(2, dtype=torch.int64, device=group.device)
    counts[0].fill_(step)
    counts[1].fill_(real)
    return torch.cat([counts[:1], constants[key], counts[1:], ok.view(1).to(torch.int64)])


def _plan_this_rank(
    topk_ids: torch.Tensor, config: EPConfig, group: Group, policy: str, tokens: int | None, dtype: torch.dtype | None,
    cost: CostProfile | None = None, packed: bool = False,
) -> RankPlan:
    """:func:`plan_step` on a per-process group (collective)."""
    if config.ranks != group.world:
        raise ValueError(f"config.ranks={config.ranks} must equal the group's size {group.world}")
    _check_ids(topk_ids, config, "topk_ids", ())
    step = topk_ids.shape[0]
    real = step if tokens is None else tokens
    in_range = 0 <= real <= step
    bad = _invalid_ids(topk_ids, real if in_range else 0, config.experts)
    ok = ~bad.any() if in_range else torch.zeros((), dtype=torch.bool, device=group.device)
    everyone = group.all_gather(_header(group, config, policy, dtype, packed, step, real, ok))  # [R, columns]
    on_device = supports_triton_planner(config) and (topk_ids.is_cuda or interpreting())
    # The reference planner reads the tables on the host anyway (and raises for bad ids on its own
    # rank only): reading the header there costs nothing more, and keeps every rank raising together.
    on_host = _checks_now(group) or not on_device
    if on_host:
        everyone = everyone.cpu()
        _raise_for_header(everyone, topk_ids, bad, tokens, step, config.experts, in_range)
    else:
        agreed = (everyone[:, : len(_AGREED)] == everyone[:1, : len(_AGREED)]).all()
        # Ranks that disagree, a rank whose inputs failed, or a step without a single real token.
        group.flag("step", ~agreed | (everyone[:, -1] == 0).any() | (everyone[:, -2].sum() == 0))
        group.flag("ids", bad)
        real = min(max(real, 0), step)  # out of range: every rank's step flag is set already
    if tokens is None:
        total = config.ranks * step  # every rank passes s tokens (the steady state of a server)
    elif on_host:
        total = int(everyone[:, -2].sum())  # the header is on the host already
        if total == 0:
            raise ValueError("no rank has tokens in this step")
    else:
        # Real token counts that differ by rank, read nowhere: the Triton planner takes T*K from the
        # gathered histogram, and the host-side sizes (shard rows, auto's candidates) follow R*s.
        total = None
    planned, planner_cost = planned_policy(policy, cost, config, config.ranks * step if total is None else total)
    if on_device:
        # Counted once: the histogram row to exchange and the ranks the planner needs afterwards.
        counts = count_rank_triton(topk_ids, config.experts, real)
        gathered = group.all_gather(counts.tokens_per_expert)
        return plan_rank_triton(group.first_rank, topk_ids, gathered, config, planned, total_tokens=total, tokens=real,
                                counts=counts, **planner_cost)
    valid = (torch.arange(step, device=topk_ids.device).unsqueeze(1) < real).expand_as(topk_ids)
    gathered = group.all_gather(histogram(topk_ids.unsqueeze(0), valid.unsqueeze(0), config.experts)[0])
    return plan_rank(group.first_rank, topk_ids, gathered, config, planned, total_tokens=total, tokens=real,
                     **planner_cost)


def _raise_for_header(
    everyone: torch.Tensor, topk_ids: torch.Tensor, bad: torch.Tensor, tokens: int | None, step: int, experts: int,
    in_range: bool,
) -> None:
    """Raise on every rank if the gathered headers ``[R, columns]`` (on the host) disagree or any rank failed."""
    differing = []
    for column, name in enumerate(_AGREED):
        if not bool((everyone[:, column] == everyone[0, column]).all()):
            values = everyone[:, column].tolist()
            if name == "tolerance":
                values = [value / _TOLERANCE_SCALE for value in values]
            differing.append(f"{name} {values}")
    if differing:
        raise ValueError(f"ranks disagree on the step (values by rank): {'; '.join(differing)}; every rank raises")
    failed = (everyone[:, -1] == 0).nonzero().flatten().tolist()
    if failed:
        if not in_range:
            raise ValueError(f"tokens must be in [0, s={step}], got {tokens}")
        if bad.any():
            token, k = bad.nonzero()[0].tolist()
            raise ValueError(f"topk_ids[{token}, {k}] = {int(topk_ids[token, k])} is not an expert id in [0, {experts})")
        raise ValueError(f"rank(s) {failed} passed invalid inputs to this step (see their errors); every rank raises")


def dispatch_step(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    plan: Layout,
    group: Group,
    backend: str = "auto",
    *,
    config: EPConfig | None = None,
    comm_programs: int | None = None,
    barrier_before: bool = True,
    dispatch_dtype: torch.dtype | None = None,
    unpack: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows and route weights into the receive shards, barrier, and expand (every real row holds its token).

    Rows cross the link once per (token, destination rank) and are copied into the token's other
    rows there (:func:`flatep.exchange.dispatch_rows`); the links that tell combine how to sum them
    back go to the group's :func:`link_buffer`. Padding rows are left unwritten. With fp8 dispatch
    the rows cross packed (:mod:`flatep.kernels.fp8_rows`) into the group's :func:`packed_buffer`,
    and each rank then unpacks its real rows into the shard.

    Args:
        x: ``[R, s, H]`` (local) or ``[s, H]`` tokens; topk_weights: ``[.., s, K]`` fp32.
        plan: the step's plan. backend: see :func:`flatep.kernels.backend.use_triton`.
        config: sizes the buffers (see Returns).
        comm_programs: cap on the dispatch kernels' programs (Triton only; ``None``: uncapped).
        barrier_before: barrier first, so that no peer still combines the previous step out of
            the shards (:func:`ep_moe` does it itself, to start the push after it).
        dispatch_dtype: ``torch.float8_e4m3fn`` to send packed fp8 rows (``None``: ``x``'s dtype).
        unpack: with fp8 rows, whether to unpack them into the shard; ``False`` where the experts
            read the packed rows themselves (:func:`reads_packed_rows`, :func:`packed_rows`): the
            shard's rows are then left unwritten, and it serves as the experts' output.

    Returns:
        ``(shard [n, rows, H], shard_weights [n, rows] fp32)`` (``n`` = ranks this process
        drives; no leading dimension on per-process transports): the group's buffers of
        :func:`shard_buffers`, ``rows = buffer_rows(config, policy) >= plan.shard_rows``, sized
        from the capacity of ``config`` (default: the config the plan was made for; a plan from the
        planner functions themselves, which does not say, gets buffers of its own ``plan.shard_rows``).
    """
    hidden = x.shape[-1]
    config = config or (plan.made_for.config if plan.made_for is not None else None)
    if config is not None:
        # An auto step planned as classic (see _planned) uses auto's buffers: their home half holds it.
        sized_for = plan.policy if plan.made_for is None else plan.made_for.policy
        shard, shard_weights = shard_buffers(group, config, sized_for, x.dtype, dispatch_dtype)
    else:
        shard = group.buffer("shard", (plan.shard_rows, hidden), x.dtype)
        shard_weights = group.buffer("shard_weights", (plan.shard_rows,), torch.float32)
    rows = shard.shape[-2]
    packed = packs_rows(dispatch_dtype)
    # Quantized before the barrier: it reads only this rank's tokens.
    sent = pack_rows(x, backend) if packed else x
    if barrier_before:  # peers may still be combining the previous step out of these shards
        group.barrier()
    received = packed_buffer(group, rows, hidden) if packed else shard
    dispatch_rows(sent, topk_weights, plan, group, received, shard_weights, link_buffer(group, rows), backend,
                  comm_programs)
    if packed and unpack:
        unpack_rows(received, shard, plan, group, backend, comm_programs)
    return shard, shard_weights


def reads_packed_rows(pool: ExpertPool, dispatch_dtype: torch.dtype | None) -> bool:
    """Whether ``pool``'s experts take fp8 dispatch's rows as they arrive: fp8 experts quantize their
    input as fp8 dispatch does (per token, per 128 columns), so their gate/up GEMMs read the packed
    values and scales, and the rows are neither unpacked nor quantized a second time."""
    return packs_rows(dispatch_dtype) and pool.weights == "fp8"


def packed_rows(group: Group, shard: torch.Tensor) -> Fp8Rows:
    """The packed rows the last fp8 dispatch into ``shard``'s buffers delivered (views, no copy)."""
    rows, hidden = shard.shape[-2:]
    return Fp8Rows.of(packed_buffer(group, rows, hidden), hidden)


def experts_step(
    shard: torch.Tensor,
    shard_weights: torch.Tensor,
    pool: ExpertPool,
    plan: Layout,
    group: Group,
    local_index: int,
    activation: Activation = swiglu,
    precision: str = "fp32",
    out: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    parts: tuple[str, ...] = ("home", "slots"),
    activations: Fp8Rows | None = None,
) -> None:
    """Run one rank's experts over its shard and write the result into ``out`` (default: the shard itself).

    Two grouped GEMMs per projection: the layer's home experts over rows ``[0, slot_base)``, then
    the process's shared slots over rows ``[slot_base, shard_rows)`` (the split layout of
    :func:`flatep.plan.split.split_slot_rows`; a plan without borrowed experts runs only the
    first). Where the decode kernels run (:func:`flatep.experts.grouped.takes_decode_kernels`), or
    the packed kernels at decode sizes (:func:`flatep.experts.grouped.takes_packed_kernels`), both
    parts share each launch. ``out`` is a symmetric buffer shaped like the shard, possibly of another dtype (fp32
    rows keep the route-weighted products unrounded until combine). With Triton (``backend``), only
    each part's real rows (before its ``offsets[-1]``) are written; combine never reads the others.
    ``parts`` selects which of the two run (``("home",)`` needs no slots, so it may run before
    the push has landed). ``activations``: with fp8 experts after fp8 dispatch, the packed rows
    (:class:`flatep.kernels.fp8_rows.Fp8Rows` of the shards, see :func:`reads_packed_rows`), which
    the gate/up GEMMs then read instead of the shard.

    Raises:
        ValueError: if ``plan`` borrows experts but is not in the split layout.
    """
    if plan.policy != "none" and not plan.slot_base:
        raise ValueError("experts_step needs the split layout for plans that borrow experts: pass split_slot_rows(plan)")
    rank = group.local_ranks[local_index]
    rows = shard[local_index] if group.stacked else shard
    weights = shard_weights[local_index] if group.stacked else shard_weights
    if activations is not None and group.stacked:
        activations = activations[local_index]
    target = shard if out is None else out
    target = target[local_index] if group.stacked else target
    epn = pool.config.experts_per_rank
    offsets = plan.offsets[rank]
    # The shard is a buffer sized for the step's worst case: the kernels (decode or not, and their
    # tiles) follow the rows an expert holds on average in this step, T*K/E.
    rows_per_group = plan.rows_per_expert(pool.config.top_k)
    if plan.slot_base and "home" in parts and "slots" in parts:
        # Where the decode kernels or the packed kernels run both parts, one launch per projection
        # covers them: at decode sizes each part alone leaves SMs idle, and a step that borrows
        # nothing pays no launch for its empty slot half.
        (w13, w2, *home_biases), (slot_w13, slot_w2, *slot_biases) = (
            pool.compute_view(local_index, part) for part in ("home", "slots")
        )
        options = dict(precision=precision, activation=activation, backend=backend)
        sets = ((w13, w2, any(b is not None for b in home_biases)),
                (slot_w13, slot_w2, any(b is not None for b in slot_biases)))
        if (all(takes_decode_kernels(rows, weights, gate_up, down, rows_per_group, biased=biased, **options)
                for gate_up, down, biased in sets)
                # Packed: at decode sizes, where the launches are a visible share of the experts'
                # time (past them each part fills the GPU alone).
                or rows_per_group <= DECODE_ROWS_PER_GROUP
                and all(takes_packed_kernels(rows, weights, gate_up, down, biased=biased, **options)
                        for gate_up, down, biased in sets)):
            end = plan.shard_rows
            grouped_swiglu(
                rows[:end], weights[:end], w13, w2, offsets, activation=activation, precision=precision,
                backend=backend, out=target[:end], rows_per_group=rows_per_group, slots=(slot_w13, slot_w2),
                slot_base=plan.slot_base, activations=None if activations is None else activations[:end],
            )
            return
    runs = [("home", 0, plan.slot_base or plan.shard_rows, offsets[:epn])]
    if plan.slot_base:
        runs.append(("slots", plan.slot_base, plan.shard_rows, offsets[epn:] - plan.slot_base))
    for part, first, end, part_offsets in runs:
        if part not in parts:
            continue
        w13, w2, b13, b2 = pool.compute_view(local_index, part)
        grouped_swiglu(
            rows[first:end], weights[first:end], w13, w2, part_offsets, b13=b13, b2=b2, activation=activation,
            precision=precision, backend=backend, out=target[first:end], rows_per_group=rows_per_group,
            activations=None if activations is None else activations[first:end],
        )


def combine_step(
    shard: torch.Tensor, plan: Layout, group: Group, tokens: int, top_k: int, out_dtype: torch.dtype, backend: str = "auto",
    *, comm_programs: int | None = None,
) -> torch.Tensor:
    """Sum every token's expert outputs from the shards: ``[n, s, H]`` (or ``[s, H]``).

    Each rank first sums, in its own shard, the rows of each token computed there into that
    token's carrier row (overwriting it), then barriers, then every token adds its carriers' rows
    (:func:`flatep.exchange.combine_rows`). Reads the links of the step's :func:`dispatch_step`.
    ``comm_programs`` caps the kernels' programs (Triton only; ``None``: uncapped).
    """
    out = combine_rows(shard, plan, group, link_buffer(group, shard.shape[-2]), tokens, top_k, out_dtype, backend,
                       comm_programs)
    return out if group.stacked or not group.peer_addressable else out[0]


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream weight pushes run on beside dispatch, one per device, made once and reused (CUDA graphs
    capture work on it through the fork/join events of :func:`start_push` and :func:`join_push`)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def start_push(
    pool: ExpertPool, slot_experts: torch.Tensor, backend: str = "auto", comm_programs: int | None = None
) -> torch.cuda.Event | None:
    """Launch the push of a plan's borrowed experts into ``pool``'s slots; return what :func:`join_push` waits on.

    On CUDA, where the transport allows it (:attr:`Group.push_on_side_stream`), the push runs on
    a side stream forked from the current one here (so it starts after everything already
    queued, the plan and the barrier that frees the slots included) and overlaps whatever the
    current stream does next; the returned event marks its end. Elsewhere it runs on the current
    stream now and ``None`` is returned. No host synchronisation either way, and the fork/join
    pattern is CUDA-graph capturable (join before the capture ends).

    Args:
        pool: the layer's pool; slot_experts: ``[R, epn]`` int32 from the plan.
        backend, comm_programs: as for :func:`ep_moe`.
    """
    device = pool.group.device
    if device.type != "cuda" or not pool.group.push_on_side_stream:
        pool.push(slot_experts, backend, comm_programs)
        return None
    side = _side_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        # The side stream reads the plan's table: keep its memory from being reused before then.
        slot_experts.record_stream(side)
        pool.push(slot_experts, backend, comm_programs)
        done.record(side)
    return done


def join_push(done: torch.cuda.Event | None, device: torch.device) -> None:
    """Make the current stream wait for a push from :func:`start_push` (nothing to do when it ran in line)."""
    if done is not None:
        torch.cuda.current_stream(device).wait_event(done)


@dataclasses.dataclass(frozen=True, eq=False)
class Prefetch:
    """A weight push started ahead of its step by :func:`prefetch_experts`; pass it as ``ep_moe(..., pushed=)``.

    Attributes:
        pool: the layer's pool whose slot set receives the experts.
        plan: the plan whose ``slot_experts`` were pushed (the very object ``ep_moe`` must get).
        done: CUDA event recorded after the push on the side stream (``None`` when it ran in line).
    """

    pool: ExpertPool
    plan: Layout
    done: torch.cuda.Event | None


def _pending(group: Group) -> dict[int, Prefetch]:
    """Prefetches not yet consumed by their step, by slot set (the address of its first slot buffer)."""
    return group.__dict__.setdefault("_pending_pushes", {})


def _slot_set_key(pool: ExpertPool) -> int:
    return pool.slots(pool.names[0]).data_ptr()


def prefetch_experts(
    pool: ExpertPool, plan: Plan | RankPlan, backend: str = "auto", comm_programs: int | None = None
) -> Prefetch:
    """Start pushing ``plan``'s borrowed experts into ``pool``'s slot set ahead of the layer's step.

    Collective: every rank calls it at the same point of its program. It puts a barrier on the
    current stream (every rank has finished the work it queued before, its steps' use of the
    slots included), then launches the push as :func:`start_push` does (on CUDA on a side stream,
    so it overlaps whatever the current stream runs next, e.g. the previous layer). Then call
    ``ep_moe(..., pool=pool, plan=plan, pushed=<this>)``: that step skips its own push and waits
    for this one before its slot experts.

    With ``ExpertPool(..., slot_sets=2)``, layer ``L+1``'s prefetch may be issued before layer
    ``L``'s step (they use different slot sets); issue it after layer ``L-1``'s step, the last
    one using the same set. A step that would push into a slot set holding an unconsumed
    prefetch raises instead of overwriting it. Pushes share one side stream per device and run
    in the order they were issued, so a step that pushes for itself after a prefetch was issued
    waits for that prefetch too: for full overlap, prefetch every layer.

    Args:
        pool: the pool of the layer the plan is for.
        plan: that layer's plan, from :func:`plan_step` (made before, outside the step).
        backend, comm_programs: as for :func:`ep_moe`.

    Returns:
        The handle to pass as ``pushed=``.

    Raises:
        ValueError: for arguments of the wrong type, or if this slot set already holds an unconsumed prefetch.
    """
    if not isinstance(pool, ExpertPool):
        raise ValueError(f"pool must be an ExpertPool, got {type(pool).__name__}")
    if not isinstance(plan, Layout) or not hasattr(plan, "slot_experts"):
        raise ValueError(f"plan must be a Plan or RankPlan from flatep.plan_step, got {type(plan).__name__}")
    check_programs(comm_programs)
    pending = _pending(pool.group)
    key = _slot_set_key(pool)
    if key in pending:
        raise ValueError("this slot set already holds a prefetch that no step has used yet: run that step first "
                         "(or give the layers two slot sets: ExpertPool(..., slot_sets=2))")
    pool.group.barrier()  # no rank still computes with these slots, nor dispatches into them later than this
    done = start_push(pool, plan.slot_experts, backend, comm_programs) if plan.policy != "none" else None
    pending[key] = prefetch = Prefetch(pool, plan, done)
    return prefetch


def ep_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    *,
    group: Group,
    config: EPConfig | None = None,
    pool: ExpertPool | None = None,
    policy: str = "exact",
    plan: Plan | RankPlan | None = None,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Activation = swiglu,
    precision: str = "fp32",
    combine_dtype: torch.dtype | None = None,
    dispatch_dtype: torch.dtype | None = None,
    cost: CostProfile | None = None,
    backend: str = "auto",
    comm_programs: int | None = None,
    pushed: Prefetch | None = None,
) -> torch.Tensor:
    """One expert-parallel MoE step: ``out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t])``.

    The weights come one of two ways: ``w13``/``w2`` (all ``E`` experts, copied into a fresh pool
    every call: for trying things out) or ``pool=`` (an :class:`ExpertPool` built once: for real
    use). Everything after ``w2`` is keyword-only.

    Args:
        x: ``[R, s, H]`` (local transport) or ``[s, H]`` tokens, bfloat16 or float32;
            non-contiguous inputs are copied.
        topk_ids: ``[R, s, K]`` (or ``[s, K]``) int32/int64 expert ids in ``[0, E)``.
        topk_weights: ``[R, s, K]`` (or ``[s, K]``) route weights (used in fp32). NaN and infinite
            weights propagate as in the dense MoE: that token's output is not finite.
        w13: ``[E, 2I, H]`` all experts' gate/up weights (each rank uses its own slice plus what it
            borrows), float or packed (:class:`flatep.quant.QuantizedTensor`); with ``w2 [E, H, I]``. Leave both out when passing ``pool``.
        group: from :func:`flatep.init_group`.
        config: group sizes (default: the pool's).
        pool: an :class:`ExpertPool` holding the layer's weights.
        policy: ``exact`` (flat), ``bounded``, ``none`` (classic EP) or ``auto`` (the cheapest of
            them by the cost model, chosen on the device: :mod:`flatep.plan.auto`).

    Advanced (keyword-only):
        plan: a plan from :func:`plan_step` for exactly these ``topk_ids`` (to plan outside a
            CUDA graph). A plan made for other ids, ``s``, config or policy is refused: host facts
            raise ``ValueError`` at once; ids whose fingerprint differs, or entries the plan would
            put outside their expert's rows, set the group's ``plan`` error flag (raised by
            :meth:`Group.check`, at once when the group checks eagerly).
        b13, b2: optional ``[E, 2I]`` gate/up and ``[E, H]`` down biases, with ``w13``/``w2``
            (a pool brings its own).
        activation: ``act(gate, up)`` of the experts (default ``silu(gate) * up``;
            :class:`flatep.experts.ClampedSwiGLU` for gpt-oss).
        precision: ``fp32`` (activations in fp32, route weight before the down GEMM) or ``native``
            (the models' own rounding order: see :mod:`flatep.experts.grouped`).
        combine_dtype: dtype of the rows that combine sums (default ``x``'s). ``torch.float32``
            with bfloat16 ``x`` needs ``precision="native"``, where the route weight multiplies
            the down GEMM's output in fp32: the products then reach combine unrounded and each
            token is rounded once, after the sum, as models with fp32 route weights do
            (DeepSeek-V3, Kimi-K2 in transformers), at twice the combine bytes. Under ``fp32``
            precision the down GEMM's output is already rounded to bfloat16 (torch's grouped GEMM
            has no fp32 output for bf16 inputs), so it is refused rather than paid for nothing.
        dispatch_dtype: dtype of the rows dispatch sends (default ``x``'s).
            ``torch.float8_e4m3fn`` sends each row as e4m3 values with one fp32 scale per 128
            columns (DeepSeek-V3's activation quantization; ``H + H/32`` bytes instead of ``2H``
            in bf16: :mod:`flatep.kernels.fp8_rows`), as DeepEP's low-latency dispatch does; each
            receiving rank dequantizes its rows into ``x``'s dtype before its experts, so the
            experts see the quantized activations and combine stays in ``x``'s dtype; fp8 experts
            (a pool with ``weights="fp8"``) read the dispatched values and scales themselves
            instead (their own activation quantization is the same: bit-identical to the step
            without fp8 dispatch, and faster: each token is quantized once before it is sent,
            not once per dispatched row, and dispatch moves half the bytes; pass it with fp8
            pools). Needs ``H % 4 == 0``; inference only (no backward). On a
            per-process group every rank must pass the same (checked with the step's header); a
            ``plan`` from :func:`plan_step` must have been made with the same ``dispatch_dtype``
            (checked), so the ranks agree through it.
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``), ``triton`` or ``torch``.
        cost: the :class:`flatep.CostProfile` of ``policy="auto"`` (default: the generic one).
        comm_programs: at most this many programs (thread blocks) for each of the dispatch,
            combine and weight-push kernels (``None``: as many as they have work for; the push
            4 per SM). Lower it to leave SMs to the expert GEMMs that run beside the push, or to
            work of your own on other streams. Results are bit-identical for every value. It
            bounds the Triton kernels only (the torch backend and the collective transport have
            no grid).
        pushed: a :class:`Prefetch` from :func:`prefetch_experts` for this ``pool`` and this
            very ``plan``: the step skips its own push and waits for that one.

    Order of a step (barriers all on the current stream, so every rank's barriers pair up in
    the same order): barrier (peers are done with the previous step's shards and slots); the
    weight push starts (on CUDA on a side stream, overlapping dispatch and the home experts;
    elsewhere in line); dispatch; barrier (every rank's rows have landed); the home experts
    (they need no slots); the current stream waits for the push; barrier (every donor's push
    has landed in its receivers' slots); the slot experts; barrier; combine.

    Returns:
        ``[R, s, H]`` (or ``[s, H]``) in ``x``'s dtype.

    Raises:
        ValueError: for bad arguments, before any kernel runs.
        NotImplementedError: with grad enabled, if an input (or a pool's tensor) requires grad on
            a path without a backward: ``pool=`` (``pushed=`` included), packed (fp8, mxfp4) weights.

    Training: with grad enabled and ``x``, ``topk_weights``, ``w13``, ``w2``, ``b13`` or ``b2``
    requiring grad, on any transport with float ``w13``/``w2`` (on the per-process ones, collective
    and NVLink, all ``E`` experts or this rank's ``E/R``; a rank's weight gradient covers its home experts),
    the step is differentiable (:mod:`flatep.backward`): the same forward values, bit for bit, and
    gradients for all of them.
    """
    if config is None:
        if pool is None:
            raise ValueError("pass config= (or a pool=, whose config is used)")
        config = pool.config
    _check_types(config, group, x=x, topk_ids=topk_ids, topk_weights=topk_weights)
    check_policy(policy)
    pool_tensors = {f"pool.{name}": pool.home(name) for name in pool.names} if pool is not None else {}
    inputs = dict(x=x, topk_weights=topk_weights, w13=w13, w2=w2, b13=b13, b2=b2, **pool_tensors)
    training = bool(requiring_grad(**inputs))
    if training:
        reason = _without_backward(pool, w13, dispatch_dtype)
        if reason is not None:
            refuse_autograd(reason, **inputs)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if combine_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"combine_dtype must be None, x's dtype or torch.float32, got {combine_dtype}")
    if combine_dtype == torch.float32 and x.dtype != torch.float32 and precision != "native":
        raise ValueError(
            "combine_dtype=torch.float32 with bfloat16 x needs precision='native': under precision='fp32' the down "
            "GEMM's output is already bfloat16, so fp32 combine rows would cost twice the bytes for the same values"
        )
    check_programs(comm_programs)
    x, topk_ids, topk_weights = check_inputs(x, topk_ids, topk_weights, config, group, backend, comm_programs)
    check_dispatch_dtype(dispatch_dtype, x.dtype, config.hidden)
    if pushed is not None:
        if not isinstance(pushed, Prefetch):
            raise ValueError(f"pushed must be a Prefetch from flatep.layer.prefetch_experts, got {type(pushed).__name__}")
        if pushed.pool is not pool or pushed.plan is not plan:
            raise ValueError("pushed was prefetched for another pool or plan: pass the pool= and plan= given to prefetch_experts")
        if _pending(group).get(_slot_set_key(pool)) is not pushed:
            raise ValueError("pushed was already used by a step (a prefetch serves one step)")
    if pool is None:
        if w13 is None or w2 is None:
            raise ValueError("pass either w13 and w2 or pool")
        weights = (w13, w2, b13, b2)
        if training and not group.stacked:  # the backward also takes this rank's [epn, ...] slices (EPMoE's)
            weights = tuple(_as_all_experts(tensor, config) for tensor in weights)
        check_expert_weights(*weights[:2], config, *weights[2:])
        if isinstance(w13, torch.Tensor) and w13.dtype != x.dtype:  # packed weights: a pool in x's dtype
            raise ValueError(f"w13/w2 dtype {w13.dtype} must match x dtype {x.dtype}")
    elif w13 is not None or w2 is not None or b13 is not None or b2 is not None:
        raise ValueError("pass either w13 and w2 (and biases) or pool, not both")
    elif any(getattr(pool.config, size) != getattr(config, size) for size in ("ranks", "experts", "hidden", "intermediate")):
        raise ValueError(f"pool was built for {pool.config}, not for {config}")
    elif pool.dtype != x.dtype:
        raise ValueError(f"pool dtype {pool.dtype} must match x dtype {x.dtype}")
    if plan is None:
        if policy == "auto":
            cost = _cost_of_this_step(cost, pool, w13, config, x.dtype, dispatch_dtype)
        # Per-process ranks agree on the step while planning, before the pool's collective allocation.
        plan = plan_step(topk_ids, config, group, policy, dtype=x.dtype, cost=cost, dispatch_dtype=dispatch_dtype)
    else:
        plan = check_plan(plan, topk_ids, config, group, policy, dispatch_dtype, x.dtype)
        if _checks_now(group):
            group.check()  # a plan made for other ids raises before any kernel trusts it
    if training:
        result = differentiable_step(
            x, topk_weights, w13, w2, b13, b2, plan, group, experts_per_rank=config.experts_per_rank,
            activation=activation, precision=precision, combine_dtype=combine_dtype, backend=backend,
            comm_programs=comm_programs,
        )
        if _checks_now(group):
            group.check()
        return result
    if pool is None:
        pool = ExpertPool.from_weights(w13, w2, config, group, b13, b2, dtype=x.dtype)
    borrowing = plan.policy != "none"
    if borrowing and pushed is None and _slot_set_key(pool) in _pending(group):
        raise ValueError("this step would overwrite slots that hold a prefetch for another step: run that step first "
                         "(or give the layers two slot sets: ExpertPool(..., slot_sets=2))")
    tokens = x.shape[-2]
    # Peers may still be combining the previous step out of the shards, or computing with the slots.
    group.barrier()
    done = None
    if pushed is not None:
        done = _pending(group).pop(_slot_set_key(pool)).done
    elif borrowing:  # the push needs only the plan: start it before dispatch, beside it on CUDA
        done = start_push(pool, plan.slot_experts, backend, comm_programs)
    direct = reads_packed_rows(pool, dispatch_dtype)
    shard, shard_weights = dispatch_step(
        x, topk_weights, plan, group, backend, config=config, comm_programs=comm_programs, barrier_before=False,
        dispatch_dtype=dispatch_dtype, unpack=not direct,
    )
    activations = packed_rows(group, shard) if direct else None
    out = shard
    if combine_dtype not in (None, x.dtype):
        out = group.buffer("expert_out", (shard.shape[-2], x.shape[-1]), combine_dtype)
    local_indices = range(len(group.local_ranks))
    for local_index in local_indices:  # home experts need only the rows: they run while the push lands
        experts_step(shard, shard_weights, pool, plan, group, local_index, activation, precision, out=out,
                     backend=backend, parts=("home",), activations=activations)
    if borrowing:
        join_push(done, group.device)
        # After the join, so this rank's push is complete when it arrives: past it, every donor's is.
        group.barrier()
        for local_index in local_indices:
            experts_step(shard, shard_weights, pool, plan, group, local_index, activation, precision, out=out,
                         backend=backend, parts=("slots",), activations=activations)
    result = combine_step(out, plan, group, tokens, config.top_k, x.dtype, backend, comm_programs=comm_programs)
    if _checks_now(group):
        group.check()
    return result


def route(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing.

    Args:
        logits: ``[..., E]`` router logits.
        top_k: ``K``.
        renormalize: rescale the K selected probabilities to sum to 1.

    Returns:
        ``(topk_ids [..., K] int32, topk_weights [..., K] fp32)``.
    """
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probabilities, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids.to(torch.int32), weights


class EPMoE(nn.Module):
    """An expert-parallel MoE block: router, routed experts over an EP group, optional shared expert.

    Parameters (vLLM layout): ``router [E, H]``, routed experts ``w13 [n, 2I, H]`` and
    ``w2 [n, H, I]`` with ``n`` = the experts homed on this process (all ``E`` on the local
    transport, rank ``r``'s ``E/R`` experts ``[r*E/R, (r+1)*E/R)`` on a per-process one, so memory
    per rank drops with ``R``), and with ``shared_intermediate`` a shared SwiGLU expert
    ``shared_w13 [2Is, H]``, ``shared_w2 [H, Is]``. On a per-process group the replicated
    parameters (router, shared expert) start equal on every rank (rank 0's values). The expert pool
    is rebuilt only when the routed weights change (tracked by their version counters).

    ``comm_programs`` caps the communication kernels' programs (see :func:`ep_moe`); ``layer``
    and ``slot_sets`` choose the pool's slot set (see :class:`ExpertPool`); ``dispatch_dtype``
    ``torch.float8_e4m3fn`` sends fp8 rows (inference only, see :func:`ep_moe`).
    """

    def __init__(
        self,
        config: EPConfig,
        group: Group,
        policy: str = "exact",
        renormalize: bool = True,
        shared_intermediate: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        cost: CostProfile | None = None,
        comm_programs: int | None = None,
        layer: int = 0,
        slot_sets: int = 1,
        dispatch_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        check_policy(policy)
        check_dispatch_dtype(dispatch_dtype, dtype, config.hidden)
        check_cost(policy, cost)
        check_programs(comm_programs)
        check_slot_sets(layer, slot_sets)
        self.config, self.group, self.policy, self.cost = config, group, policy, cost
        self.comm_programs, self.layer, self.slot_sets = comm_programs, layer, slot_sets
        self.renormalize, self.backend, self.dispatch_dtype = renormalize, backend, dispatch_dtype
        if config.ranks != group.world:
            raise ValueError(f"config.ranks={config.ranks} must equal the group's size {group.world}")
        hidden, intermediate, experts = config.hidden, config.intermediate, config.experts
        home_experts = len(group.local_ranks) * config.experts_per_rank
        factory = {"device": group.device, "dtype": dtype}
        self.router = nn.Parameter(torch.randn(experts, hidden, **factory) * hidden**-0.5)
        self.w13 = nn.Parameter(torch.randn(home_experts, 2 * intermediate, hidden, **factory) * hidden**-0.5)
        self.w2 = nn.Parameter(torch.randn(home_experts, hidden, intermediate, **factory) * intermediate**-0.5)
        if shared_intermediate:
            self.shared_w13 = nn.Parameter(torch.randn(2 * shared_intermediate, hidden, **factory) * hidden**-0.5)
            self.shared_w2 = nn.Parameter(torch.randn(hidden, shared_intermediate, **factory) * shared_intermediate**-0.5)
        else:
            self.shared_w13 = self.shared_w2 = None
        if not group.stacked:
            with torch.no_grad():  # replicated parameters: every rank starts from rank 0's values
                for parameter in (self.router, self.shared_w13, self.shared_w2):
                    if parameter is not None:
                        parameter.copy_(group.all_gather(parameter.detach().contiguous())[0])
        self._pool: ExpertPool | None = None
        self._pool_versions: tuple[int, ...] = ()
        shard_buffers(group, config, policy, dtype, dispatch_dtype)  # at set-up, where every rank allocates alike

    def expert_pool(self) -> ExpertPool:
        """The layer's pool, rebuilt if ``w13`` or ``w2`` changed since it was built."""
        versions = (self.w13._version, self.w2._version, self.w13.data_ptr(), self.w2.data_ptr())
        if self._pool is None or versions != self._pool_versions:
            self._pool = ExpertPool(self.config, self.group, self.w13.dtype, layer=self.layer, slot_sets=self.slot_sets)
            self._pool.load_home(self.w13.detach(), self.w2.detach())
            self._pool_versions = versions
        return self._pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, s, H]`` (local transport) or ``[s, H]`` -> same shape and dtype.

        Trains on every transport: with grad enabled and ``x`` or a parameter requiring grad,
        the routed experts run through :func:`ep_moe`'s differentiable step with ``w13``/``w2``
        themselves, so the router (through the route weights), the routed experts and the shared
        expert get gradients. Otherwise (inference) the routed experts run from the layer's pool.
        """
        tensors = dict(x=x, **dict(self.named_parameters()))
        logits = x.float() @ self.router.float().T
        topk_ids, topk_weights = route(logits, self.config.top_k, self.renormalize)
        options = dict(config=self.config, group=self.group, policy=self.policy, backend=self.backend, cost=self.cost,
                       comm_programs=self.comm_programs, dispatch_dtype=self.dispatch_dtype)
        if requiring_grad(**tensors):
            out = ep_moe(x, topk_ids, topk_weights, self.w13, self.w2, **options)
        else:
            out = ep_moe(x, topk_ids, topk_weights, pool=self.expert_pool(), **options)
        if self.shared_w13 is not None:
            intermediate = self.shared_w2.shape[-1]
            projected = x @ self.shared_w13.T
            out = out + (F.silu(projected[..., :intermediate]) * projected[..., intermediate:]) @ self.shared_w2.T
        return out
