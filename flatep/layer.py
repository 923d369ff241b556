"""The expert-parallel MoE layer: route, plan, dispatch, experts, combine.

On the local transport every tensor carries a leading rank dimension (``x [R, s, H]``); on the
per-process transports it does not (``x [s, H]``). That is the only difference users see.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatep.config import POLICIES, EPConfig, check_policy
from flatep.experts.grouped import PRECISIONS, Activation, grouped_swiglu, swiglu
from flatep.experts.pool import ExpertPool, check_expert_weights
from flatep.kernels.backend import use_triton
from flatep.kernels.combine import combine_torch, combine_triton
from flatep.kernels.dispatch import dispatch_torch, dispatch_triton
from flatep.plan.reference import _valid_mask, histogram, make_plan, plan_rank
from flatep.plan.split import split_slot_rows
from flatep.plan.triton import make_plan_triton, plan_rank_triton, supports_triton_planner
from flatep.plan.types import Layout, Plan, RankPlan
from flatep.transport.base import Group
from flatep.transport.collective import CollectiveGroup

# What ranks of a per-process group must agree on before they exchange anything sized by it.
_AGREED = ("s", "R", "E", "K", "H", "I", "capacity", "align", "tolerance", "policy", "dtype")
_DTYPE_CODES = {None: 0, torch.bfloat16: 1, torch.float32: 2}
_TOLERANCE_SCALE = 2**20  # the header is int64: tolerance travels in fixed point


def _entries(plan: Layout, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plan's destinations as ``[n, s, K]`` for the ranks this process drives."""
    return plan.dest_rank.view(-1, tokens, top_k), plan.dest_row.view(-1, tokens, top_k)


def check_inputs(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, config: EPConfig, group: Group
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the layer's inputs before any kernel runs; return them contiguous, ids int32, weights fp32.

    Raises:
        ValueError: naming the argument and what was expected.
    """
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
    return x.contiguous(), topk_ids.to(torch.int32).contiguous(), topk_weights.float().contiguous()


def plan_step(
    topk_ids: torch.Tensor,
    config: EPConfig,
    group: Group,
    policy: str = "exact",
    tokens: list[int] | int | None = None,
    dtype: torch.dtype | None = None,
) -> Plan | RankPlan:
    """Plan one step: a :class:`Plan` of all ranks on the local transport, else this rank's :class:`RankPlan`.

    On a per-process group this is collective (every rank must call it): the ranks first gather a
    fixed-size header (``s``, the config, the policy, the activation dtype, their real token count
    and whether their ids are valid) and all raise ``ValueError`` together if they disagree or any
    rank's input is bad, so no rank is left waiting in an exchange sized differently from its
    peers'. Then they gather the ``[E]`` histograms and each plans its own entries.

    Args:
        topk_ids: ``[R, s, K]`` (local) or ``[s, K]`` int32 expert ids.
        config: group sizes.
        group: from :func:`flatep.init_group`.
        policy: ``exact`` or ``none``.
        tokens: real tokens per rank, rows beyond are padding: ``[R]`` counts on the local
            transport, this rank's count on a per-process one (default ``s``).
        dtype: activation dtype the ranks must agree on (per-process groups; ``None``: not checked).

    The plan comes in the layer's split layout (:func:`flatep.plan.split.split_slot_rows`: slot
    groups from row ``slot_base``), which dispatch, experts and combine expect.

    On CUDA the sync-free Triton planner plans (bit-equal to the reference planner, which plans on
    CPU and for configs beyond the Triton planner's limits). Ids are range-checked first, which
    costs one host sync, except while a CUDA graph is being captured.
    """
    check_policy(policy)
    if group.stacked:
        if not (topk_ids.is_cuda and supports_triton_planner(config)):
            return split_slot_rows(make_plan(topk_ids, config, policy, tokens))
        if not torch.cuda.is_current_stream_capturing():
            counts = [topk_ids.shape[1]] * config.ranks if tokens is None else list(tokens)
            _valid_mask(topk_ids, counts, config.experts, "topk_ids")
        return split_slot_rows(make_plan_triton(topk_ids, config, policy, tokens))
    if dtype not in _DTYPE_CODES:
        raise ValueError(f"dtype must be torch.bfloat16, torch.float32 or None, got {dtype}")
    if tokens is not None and not isinstance(tokens, int):
        raise ValueError(f"tokens must be this rank's token count (an int) on a per-process group, got {tokens!r}")
    return split_slot_rows(_plan_this_rank(topk_ids, config, group, policy, tokens, dtype))


def _plan_this_rank(
    topk_ids: torch.Tensor, config: EPConfig, group: Group, policy: str, tokens: int | None, dtype: torch.dtype | None
) -> RankPlan:
    """:func:`plan_step` on a per-process group (collective)."""
    step = topk_ids.shape[0]
    real = step if tokens is None else tokens
    valid = (torch.arange(step, device=topk_ids.device).unsqueeze(1) < real).expand_as(topk_ids)
    if not 0 <= real <= step:
        bad = None
        ok = torch.zeros(1, dtype=torch.int64, device=group.device)
    else:
        # The validity flag travels in the header, so the happy path needs no sync of its own.
        bad = valid & ((topk_ids < 0) | (topk_ids >= config.experts))
        ok = (~bad.any()).to(torch.int64).view(1).to(group.device)
    header = [step, config.ranks, config.experts, config.top_k, config.hidden, config.intermediate,
              config.capacity, config.align, round(config.tolerance * _TOLERANCE_SCALE), POLICIES.index(policy),
              _DTYPE_CODES[dtype], real]
    header = torch.cat([torch.tensor(header, dtype=torch.int64, device=group.device), ok])
    everyone = group.all_gather(header).cpu()
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
        if bad is None:
            raise ValueError(f"tokens must be in [0, s={step}], got {tokens}")
        if bad.any():
            token, k = bad.nonzero()[0].tolist()
            raise ValueError(
                f"topk_ids[{token}, {k}] = {int(topk_ids[token, k])} is not an expert id in [0, {config.experts})"
            )
        raise ValueError(f"rank(s) {failed} passed invalid inputs to this step (see their errors); every rank raises")
    if config.ranks != group.world:
        raise ValueError(f"config.ranks={config.ranks} must equal the group's size {group.world}")
    total = int(everyone[:, -2].sum())
    if total == 0:
        raise ValueError("no rank has tokens in this step")
    counts = histogram(topk_ids.unsqueeze(0), valid.unsqueeze(0), config.experts)[0]
    gathered = group.all_gather(counts)
    planner = plan_rank_triton if topk_ids.is_cuda and supports_triton_planner(config) else plan_rank
    return planner(group.first_rank, topk_ids, gathered, config, policy, total_tokens=total, tokens=real)


def dispatch_step(
    x: torch.Tensor, topk_weights: torch.Tensor, plan: Layout, group: Group, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter rows and route weights into the receive shards.

    Returns:
        ``(shard [n, rows, H], shard_weights [n, rows] fp32)`` (``n`` = ranks this process
        drives; no leading dimension on per-process transports), ``rows = plan.shard_rows``.
    """
    hidden = x.shape[-1]
    tokens, top_k = topk_weights.shape[-2:]
    shard = group.buffer("shard", (plan.shard_rows, hidden), x.dtype)
    shard_weights = group.buffer("shard_weights", (plan.shard_rows,), torch.float32)
    dest_rank, dest_row = _entries(plan, tokens, top_k)
    # Peers may still be combining the previous step out of these shards: wait for them first.
    group.barrier()
    if isinstance(group, CollectiveGroup):
        group.dispatch(x, topk_weights, plan, shard, shard_weights)
    elif use_triton(x.device, backend):
        dispatch_triton(
            x.view(-1, tokens, hidden), topk_weights.view(-1, tokens, top_k), dest_rank, dest_row, plan.padding,
            shard, shard_weights, group.peer_offsets(shard), group.peer_offsets(shard_weights), group.first_rank,
        )
    else:
        if not group.stacked:
            raise ValueError("the torch dispatch path needs the local transport")
        dispatch_torch(x, topk_weights, dest_rank, dest_row, plan.padding, shard, shard_weights)
    group.barrier()
    return shard, shard_weights


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
) -> None:
    """Run one rank's experts over its shard and write the result into ``out`` (default: the shard itself).

    Two grouped GEMMs per projection: the layer's home experts over rows ``[0, slot_base)``, then
    the process's shared slots over rows ``[slot_base, shard_rows)`` (the split layout of
    :func:`flatep.plan.split.split_slot_rows`; a plan without borrowed experts runs only the
    first). ``out`` is a symmetric buffer shaped like the shard, possibly of another dtype (fp32
    rows keep the route-weighted products unrounded until combine). With Triton (``backend``), only
    each part's real rows (before its ``offsets[-1]``) are written; combine never reads the others.

    Raises:
        ValueError: if ``plan`` borrows experts but is not in the split layout.
    """
    if plan.policy != "none" and not plan.slot_base:
        raise ValueError("experts_step needs the split layout for plans that borrow experts: pass split_slot_rows(plan)")
    rank = group.local_ranks[local_index]
    rows = shard[local_index] if group.stacked else shard
    weights = shard_weights[local_index] if group.stacked else shard_weights
    target = shard if out is None else out
    target = target[local_index] if group.stacked else target
    epn = pool.config.experts_per_rank
    offsets = plan.offsets[rank]
    parts = [("home", 0, plan.slot_base or plan.shard_rows, offsets[:epn])]
    if plan.slot_base:
        parts.append(("slots", plan.slot_base, plan.shard_rows, offsets[epn:] - plan.slot_base))
    for part, first, end, part_offsets in parts:
        w13, w2, b13, b2 = pool.compute_view(local_index, part)
        grouped_swiglu(
            rows[first:end], weights[first:end], w13, w2, part_offsets, b13=b13, b2=b2, activation=activation,
            precision=precision, backend=backend, out=target[first:end],
        )


def combine_step(
    shard: torch.Tensor, plan: Layout, group: Group, tokens: int, top_k: int, out_dtype: torch.dtype, backend: str = "auto"
) -> torch.Tensor:
    """Sum every token's K expert outputs from the shards: ``[n, s, H]`` (or ``[s, H]``)."""
    group.barrier()
    if isinstance(group, CollectiveGroup):
        return group.combine(shard, plan, out_dtype)
    hidden = shard.shape[-1]
    dest_rank, dest_row = _entries(plan, tokens, top_k)
    if use_triton(shard.device, backend):
        out = torch.empty(dest_rank.shape[0], tokens, hidden, dtype=out_dtype, device=shard.device)
        combine_triton(out, dest_rank, dest_row, shard, group.peer_offsets(shard))
    else:
        if not group.stacked:
            raise ValueError("the torch combine path needs the local transport")
        out = combine_torch(dest_rank, dest_row, shard, out_dtype)
    return out if group.stacked else out[0]


def ep_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor | None = None,
    w2: torch.Tensor | None = None,
    *,
    config: EPConfig,
    group: Group,
    policy: str = "exact",
    pool: ExpertPool | None = None,
    plan: Plan | RankPlan | None = None,
    backend: str = "auto",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Activation = swiglu,
    precision: str = "fp32",
    combine_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """One expert-parallel MoE step.

    Args:
        x: ``[R, s, H]`` (local transport) or ``[s, H]`` tokens, bfloat16 or float32;
            non-contiguous inputs are copied.
        topk_ids: ``[R, s, K]`` (or ``[s, K]``) int32/int64 expert ids in ``[0, E)``.
        topk_weights: ``[R, s, K]`` (or ``[s, K]``) route weights (used in fp32).
        w13: ``[E, 2I, H]`` all experts' gate/up weights (each rank uses its own slice plus what it
            borrows), float or packed (:class:`flatep.quant.QuantizedTensor`); copied into a fresh
            pool each call. Pass ``pool`` instead to avoid the copy.
        w2: ``[E, H, I]``.
        config: group sizes; group: from :func:`flatep.init_group`.
        policy: ``exact`` (flat) or ``none`` (classic EP).
        pool: an :class:`ExpertPool` holding the layer's weights (then ``w13``/``w2`` must be None).
        plan: a precomputed plan for these ``topk_ids`` (e.g. to keep planning outside a CUDA graph).
        backend: ``auto`` (Triton on CUDA or under ``TRITON_INTERPRET=1``), ``triton`` or ``torch``.
        b13: optional ``[E, 2I]`` gate then up biases, with ``w13``/``w2`` (a ``pool`` brings its own).
        b2: optional ``[E, H]`` down-projection biases (with ``b13``).
        activation: ``act(gate, up)`` of the experts (default ``silu(gate) * up``;
            :class:`flatep.experts.ClampedSwiGLU` for gpt-oss).
        precision: ``fp32`` (activations in fp32, route weight before the down GEMM) or ``native``
            (the models' own rounding order: see :mod:`flatep.experts.grouped`).
        combine_dtype: dtype of the expert outputs that combine sums (default ``x``'s). ``float32``
            rounds each token once, after the sum, as models with fp32 route weights do (DeepSeek-V3,
            Kimi-K2 in transformers), at twice the combine bytes.

    Returns:
        ``[R, s, H]`` (or ``[s, H]``) in ``x``'s dtype: ``sum_k w[t,k] * expert_{ids[t,k]}(x[t])``.
    """
    check_policy(policy)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if combine_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"combine_dtype must be None, x's dtype or torch.float32, got {combine_dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or (w13 is not None and w13.requires_grad)):
        raise NotImplementedError("ep_moe has no backward yet: run it under torch.no_grad() or on tensors without grad")
    x, topk_ids, topk_weights = check_inputs(x, topk_ids, topk_weights, config, group)
    if pool is None:
        if w13 is None or w2 is None:
            raise ValueError("pass either w13 and w2 or pool")
        check_expert_weights(w13, w2, config, b13, b2)
        if isinstance(w13, torch.Tensor) and w13.dtype != x.dtype:  # packed weights: a pool in x's dtype
            raise ValueError(f"w13/w2 dtype {w13.dtype} must match x dtype {x.dtype}")
    elif w13 is not None or w2 is not None or b13 is not None or b2 is not None:
        raise ValueError("pass either w13 and w2 (and biases) or pool, not both")
    elif pool.dtype != x.dtype:
        raise ValueError(f"pool dtype {pool.dtype} must match x dtype {x.dtype}")
    if plan is None:
        # Per-process ranks agree on the step while planning, before the pool's collective allocation.
        plan = plan_step(topk_ids, config, group, policy, dtype=x.dtype)
    elif plan.policy != policy:
        raise ValueError(f"plan was made with policy {plan.policy!r}, not {policy!r}")
    elif not group.stacked and not (isinstance(plan, RankPlan) and plan.rank == group.first_rank):
        raise ValueError(f"plan must be this rank's RankPlan (rank {group.first_rank}), from plan_step")
    else:
        plan = split_slot_rows(plan)
    if pool is None:
        pool = ExpertPool.from_weights(w13, w2, config, group, b13, b2, dtype=x.dtype)
    tokens = x.shape[-2]
    shard, shard_weights = dispatch_step(x, topk_weights, plan, group, backend)
    if plan.policy != "none":
        pool.push(plan.slot_experts, backend)
        group.barrier()
    out = shard
    if combine_dtype not in (None, x.dtype):
        out = group.buffer("expert_out", (plan.shard_rows, x.shape[-1]), combine_dtype)
    for local_index in range(len(group.local_ranks)):
        experts_step(shard, shard_weights, pool, plan, group, local_index, activation, precision, out=out, backend=backend)
    return combine_step(out, plan, group, tokens, config.top_k, x.dtype, backend)


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
    ) -> None:
        super().__init__()
        check_policy(policy)
        self.config, self.group, self.policy = config, group, policy
        self.renormalize, self.backend = renormalize, backend
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

    def expert_pool(self) -> ExpertPool:
        """The layer's pool, rebuilt if ``w13`` or ``w2`` changed since it was built."""
        versions = (self.w13._version, self.w2._version, self.w13.data_ptr(), self.w2.data_ptr())
        if self._pool is None or versions != self._pool_versions:
            self._pool = ExpertPool(self.config, self.group, self.w13.dtype)
            self._pool.load_home(self.w13.detach(), self.w2.detach())
            self._pool_versions = versions
        return self._pool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [R, s, H]`` (local transport) or ``[s, H]`` -> same shape and dtype."""
        logits = x.float() @ self.router.float().T
        topk_ids, topk_weights = route(logits, self.config.top_k, self.renormalize)
        with torch.no_grad():
            out = ep_moe(
                x.detach(), topk_ids, topk_weights, config=self.config, group=self.group, policy=self.policy,
                pool=self.expert_pool(), backend=self.backend,
            )
        if self.shared_w13 is not None:
            intermediate = self.shared_w2.shape[-1]
            projected = x @ self.shared_w13.T
            out = out + (F.silu(projected[..., :intermediate]) * projected[..., intermediate:]) @ self.shared_w2.T
        return out
