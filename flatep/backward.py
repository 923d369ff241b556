"""The backward pass of an EP MoE step on the local (virtual ranks) and collective (one rank per process) transports.

A step is three autograd functions chained over the forward's plan, which the backward reuses
as it is (no re-planning):

- :class:`DispatchRows`: ``x [R, s, H]``, ``topk_weights [R, s, K]`` fp32 -> shard rows
  ``[R, rows, H]``, their route weights ``[R, rows]`` fp32 and the dispatch's links (each token
  crosses the link once per destination rank and is expanded there: :mod:`flatep.exchange`). Its
  backward is a combine: each token's input gradient is the sum of its K rows' gradients (each
  rank's rows of the token summed first, then the partial sums, as the forward's combine sums), and
  each route weight's gradient is read back from the row it was dispatched to.
- :class:`GroupedExperts`: shard rows -> expert output rows ``[R, rows, H]``, home experts from
  ``w13``/``w2`` (and ``b13``/``b2``) at their own ranks, borrowed experts read from the same
  tensors at the slot table's ids (on the local transport that read is the weight push; on the
  collective transport the owners push them, :meth:`CollectiveGroup.push_experts`). Its backward
  gives the rows' and route weights' gradients and every expert's weight gradients.
- :class:`CombineRows`: output rows (and the links) -> ``[R, s, H]``. Its backward is a dispatch
  of the output gradient to the token's carriers, expanded there into the very rows the forward
  summed (padding rows are not written: see below).

Tensors carry a leading rank dimension: ``R`` on the local transport, ``1`` (this process's rank)
on the collective one, where dispatch and combine are the group's all-to-alls instead of kernels.

What the forward keeps for the backward, per rank: the dispatched rows ``[rows, H]`` in ``x``'s
dtype and their route weights ``[rows]`` fp32 (``rows`` = the plan's ``shard_rows``, sized by
``s``, never by ``E``), the plan's tables (int32 ``[s, K]`` destinations, ``[2*epn]`` offsets and
slots), and references to the weight tensors themselves (no copies). The gate/up GEMM and the
activation are recomputed in the backward rather than kept (``[rows, 2I]`` and ``[rows, I]`` per
rank would outweigh the rows), and the borrowed experts are read again from ``w13``/``w2`` (on the
collective transport the forward keeps the pushed copies, ``epn`` experts: a second push would cost
the messages again).

The expert backward computes in fp32 whatever the weights' dtype: per group (one expert's
contiguous rows) it recomputes the gate/up projection, takes the activation's derivative by
autograd on that elementwise function alone (so :class:`flatep.experts.ClampedSwiGLU` and other
activations work), and runs plain per-group matmuls for the input and weight gradients. It reads
the plan's offsets and slot table on the host once per backward (a synchronisation on CUDA).
It differentiates the exact function ``w * (W2 act(W13 x + b13) + b2)``, which both precisions
(``fp32`` and ``native``) round differently but compute alike.

Padding rows: dispatch leaves the rows that pad each group to ``align`` unwritten (in the forward
and in the backward's dispatches alike), so they hold garbage, NaN included. The expert backward
therefore runs over each group's real rows only (its padded end less its padding count from the
plan): weight gradients sum over rows, and a padding row must contribute nothing to them. The
padding rows' input gradients stay zero, and no combine reads them.

Borrowed experts: a rank that computed with a borrowed expert computes that expert's weight
gradient from its own rows, in fp32, and the gradients are reduced into the home expert's in a
fixed order: the home rank's own gradient first, then each receiver's in ascending rank. Every
sum therefore happens in the same order on every run, and the gradients are bit-identical run to
run; they equal a dense (non-EP) layer's within rounding. On the collective transport each receiver
sends its fp32 slot gradients to the owner (:meth:`CollectiveGroup.return_slot_gradients`), which
adds them in that same order, so its gradients equal the local transport's bit for bit. There a
rank's weight gradient covers its home experts only: a ``[E, ...]`` tensor gets zeros elsewhere
(the other ranks' experts are theirs to train), an ``[epn, ...]`` slice gets all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flatep.exchange import combine_rows, dispatch_rows
from flatep.experts.grouped import Activation, grouped_swiglu
from flatep.plan.types import Layout
from flatep.transport.base import Group


@dataclass(frozen=True)
class StepContext:
    """What the three functions of one step share: the plan and how to run.

    Attributes:
        plan: the step's plan in the split layout (``dest_rank``/``dest_row`` ``[R, s, K]`` int32).
        group: the local group (stacked ranks) or a collective one (one rank per process).
        experts_per_rank: ``epn``.
        activation, precision: as for :func:`flatep.ep_moe`.
        rows_dtype: dtype of the expert output rows that combine sums (``combine_dtype``).
        backend: ``auto``, ``triton`` or ``torch`` (for dispatch, combine and the forward experts).
        comm_programs: cap on the dispatch and combine kernels' programs.
    """

    plan: Layout
    group: Group
    experts_per_rank: int
    activation: Activation
    precision: str
    rows_dtype: torch.dtype
    backend: str
    comm_programs: int | None

    def entries(self, tokens: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dest_rank, dest_row)``, each ``[R, s, K]`` int32."""
        return self.plan.dest_rank.view(-1, tokens, top_k), self.plan.dest_row.view(-1, tokens, top_k)

    def parts(self) -> list[tuple[str, int, int]]:
        """``(part, first row, end row)`` of the shard's home and (when the plan borrows) slot halves."""
        plan = self.plan
        if not plan.slot_base:
            return [("home", 0, plan.shard_rows)]
        return [("home", 0, plan.slot_base), ("slots", plan.slot_base, plan.shard_rows)]

    def home(self, tensor: torch.Tensor | None, rank: int) -> torch.Tensor | None:
        """``rank``'s ``[epn, ...]`` home experts of ``tensor``: a view of an ``[E, ...]`` tensor, or a
        per-process ``[epn, ...]`` slice itself."""
        epn = self.experts_per_rank
        if tensor is None or tensor.shape[0] != self.plan.alloc.shape[0]:
            return tensor
        return tensor[rank * epn : (rank + 1) * epn]


def _scatter(
    rows: torch.Tensor, route_weights: torch.Tensor, context: StepContext
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch ``rows [R, s, H]`` and ``route_weights [R, s, K]`` fp32 into fresh ``[R, shard_rows, H]`` and
    ``[R, shard_rows]`` fp32 tensors, and their ``[R, shard_rows, 2]`` int32 links (once per
    destination rank, then expanded; only real rows written: padding rows hold garbage, which
    :func:`_experts_backward` never reads).

    Fresh tensors, not the group's shared buffers: autograd keeps them until the backward, while the
    next layer reuses the buffers.
    """
    group, plan = context.group, context.plan
    ranks, tokens, hidden = rows.shape
    shard = torch.empty(ranks, plan.shard_rows, hidden, dtype=rows.dtype, device=rows.device)
    shard_weights = torch.empty(ranks, plan.shard_rows, dtype=torch.float32, device=rows.device)
    links = torch.empty(ranks, plan.shard_rows, 2, dtype=torch.int32, device=rows.device)
    dispatch_rows(rows, route_weights, plan, group, shard, shard_weights, links, context.backend, context.comm_programs)
    return shard, shard_weights, links


def _gather(shard: torch.Tensor, links: torch.Tensor, tokens: int, top_k: int, out_dtype: torch.dtype,
            context: StepContext) -> torch.Tensor:
    """Combine: ``[R, s, H]`` in ``out_dtype``, every token the sum of its K rows of ``shard [R, rows, H]``
    (each rank's rows of a token summed first, into a fresh tensor: ``shard`` is left as it is)."""
    sums = torch.empty_like(shard) if context.group.peer_addressable else None
    out = combine_rows(shard, context.plan, context.group, links, tokens, top_k, out_dtype, context.backend,
                       context.comm_programs, sums=sums)
    return out if context.group.stacked else out.unsqueeze(0)


class DispatchRows(torch.autograd.Function):
    """``(x [R, s, H], topk_weights [R, s, K] fp32) -> (shard [R, rows, H], shard_weights [R, rows] fp32,
    links [R, rows, 2] int32)`` (the links are not differentiable; combine needs them)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, context: StepContext
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ctx.context, ctx.x_dtype, ctx.tokens, ctx.top_k = context, x.dtype, x.shape[-2], topk_weights.shape[-1]
        shard, shard_weights, links = _scatter(x, topk_weights, context)
        ctx.mark_non_differentiable(links)
        ctx.save_for_backward(links)
        return shard, shard_weights, links

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_shard: torch.Tensor, grad_shard_weights: torch.Tensor,
                 _grad_links: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        context, tokens = ctx.context, ctx.tokens
        (links,) = ctx.saved_tensors
        # A token's gradient is the sum of its rows' gradients: each rank's rows summed, then combined.
        grad_x = _gather(grad_shard.contiguous(), links, tokens, ctx.top_k, ctx.x_dtype, context)
        dest_rank, dest_row = context.entries(tokens, ctx.top_k)
        planned = dest_rank >= 0
        # Each route weight went to one row beside its token's copy: its gradient is that row's.
        if context.group.stacked:
            grad_weights = grad_shard_weights[dest_rank.clamp_min(0).long(), dest_row.clamp_min(0).long()]
        else:
            rows_weights = grad_shard_weights[0].unsqueeze(-1)
            grad_weights = context.group.gather_entries(rows_weights, context.plan).view(dest_rank.shape)
        return grad_x, torch.where(planned, grad_weights, 0.0), None


class CombineRows(torch.autograd.Function):
    """``(rows [R, rows, H], links [R, rows, 2] int32) -> [R, s, H]`` in ``out_dtype``: every token the sum of its K rows."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, links: torch.Tensor, tokens: int, top_k: int, out_dtype: torch.dtype,
                context: StepContext) -> torch.Tensor:
        ctx.context, ctx.rows_dtype, ctx.top_k = context, rows.dtype, top_k
        return _gather(rows, links, tokens, top_k, out_dtype, context)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # The gradient of a sum reaches each summand unchanged: dispatch it to the token's carriers
        # and expand it there into every row combine summed (padding rows are not written).
        ranks, tokens, _ = grad_out.shape
        unused_weights = torch.zeros(ranks, tokens, ctx.top_k, dtype=torch.float32, device=grad_out.device)
        grad_rows, _, _ = _scatter(grad_out.to(ctx.rows_dtype).contiguous(), unused_weights, ctx.context)
        return grad_rows, None, None, None, None, None


def _expert_weights(
    context: StepContext, local_index: int, part: str, tensors: tuple[torch.Tensor | None, ...],
    pushed: tuple[torch.Tensor | None, ...] | None,
) -> tuple[torch.Tensor | None, ...]:
    """``(w13, w2, b13, b2)`` of one rank's home experts or slots, each ``[epn, ...]`` (biases may be None).

    Home experts are views of the tensors (:meth:`StepContext.home`). Slots are, on the local
    transport, rows of the ``[E, ...]`` tensors at the plan's slot ids (indexing is the weight
    push; empty slots (``-1``) read expert 0: their groups have no rows), on the collective one the
    copies ``pushed`` from their owners (:func:`_push_slots`).
    """
    rank = context.group.local_ranks[local_index]
    if part == "home":
        return tuple(context.home(t, rank) for t in tensors)
    if pushed is not None:
        return pushed
    ids = context.plan.slot_experts[rank].clamp_min(0).long()
    return tuple(None if t is None else t.index_select(0, ids) for t in tensors)


def _push_slots(context: StepContext, tensors: tuple[torch.Tensor | None, ...]) -> tuple[torch.Tensor | None, ...]:
    """On the collective transport: this rank's slots, ``[epn, ...]`` per tensor of ``tensors``
    (``None`` stays ``None``), pushed from their owners' home experts; empty slots are zeros."""
    group, rank = context.group, context.group.local_ranks[0]
    slots = []
    for tensor in tensors:
        if tensor is None:
            slots.append(None)
            continue
        home = context.home(tensor, rank).contiguous()
        slot = torch.zeros_like(home)
        group.push_experts(home, slot, context.plan.slot_experts)
        slots.append(slot)
    return tuple(slots)


def _part_offsets(context: StepContext, rank: int, part: str, first: int) -> torch.Tensor:
    """``[epn]`` int32 inclusive end row of each group of ``part``, counted from the part's first row."""
    epn = context.experts_per_rank
    offsets = context.plan.offsets[rank]
    return offsets[:epn] if part == "home" else offsets[epn:] - first


class GroupedExperts(torch.autograd.Function):
    """Every rank's experts over its shard: ``[R, rows, H]`` in ``context.rows_dtype``.

    Inputs: ``shard [R, rows, H]``, ``shard_weights [R, rows]`` fp32, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]``, optional ``b13 [E, 2I]`` and ``b2 [E, H]`` (the weights in the shard's dtype).
    """

    @staticmethod
    def forward(ctx: Any, shard: torch.Tensor, shard_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                b13: torch.Tensor | None, b2: torch.Tensor | None, context: StepContext) -> torch.Tensor:
        out = torch.empty(shard.shape, dtype=context.rows_dtype, device=shard.device)
        tensors = (w13, w2, b13, b2)
        pushed = _push_slots(context, tensors) if not context.group.stacked and context.plan.slot_base else None
        for local_index in range(shard.shape[0]):
            rank = context.group.local_ranks[local_index]
            for part, first, end in context.parts():
                weights = _expert_weights(context, local_index, part, tensors, pushed)
                grouped_swiglu(
                    shard[local_index, first:end], shard_weights[local_index, first:end], weights[0], weights[1],
                    _part_offsets(context, rank, part, first), b13=weights[2], b2=weights[3],
                    activation=context.activation, precision=context.precision, backend=context.backend,
                    out=out[local_index, first:end],
                )
        ctx.context, ctx.pushed = context, pushed
        ctx.save_for_backward(shard, shard_weights, w13, w2, b13, b2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        context: StepContext = ctx.context
        shard, shard_weights, w13, w2, b13, b2 = ctx.saved_tensors
        want_weights = any(ctx.needs_input_grad[2:6])
        epn = context.experts_per_rank
        grad_shard = torch.zeros_like(shard)
        grad_shard_weights = torch.zeros_like(shard_weights)
        # fp32 weight gradients of every rank's home experts [R, epn, ...] and slots.
        home: list[list[torch.Tensor]] = []
        slots: list[list[torch.Tensor]] = []
        # Host copies for the per-group loops (one sync on CUDA each).
        offsets, padding = context.plan.offsets.tolist(), context.plan.padding[..., 1].tolist()
        slot_ids = context.plan.slot_experts.tolist()
        for local_index in range(shard.shape[0]):
            rank = context.group.local_ranks[local_index]
            for part, first, end in context.parts():
                weights = _expert_weights(context, local_index, part, (w13, w2, b13, b2), ctx.pushed)
                groups = slice(0, epn) if part == "home" else slice(epn, 2 * epn)
                ends = [row - first for row in offsets[rank][groups]]
                grads = _experts_backward(
                    shard[local_index, first:end], shard_weights[local_index, first:end], grad_out[local_index, first:end],
                    weights, ends, padding[rank][groups], context.activation, grad_shard[local_index, first:end],
                    grad_shard_weights[local_index, first:end], want_weights,
                )
                (home if part == "home" else slots).append(grads)
        if not want_weights:
            return grad_shard, grad_shard_weights, None, None, None, None, None
        tensors = (w13, w2, b13, b2)
        if context.group.stacked:
            totals = _reduce_stacked(home, slots, slot_ids, context)
        else:
            totals = _reduce_per_process(home[0], slots[0] if slots else None, tensors, context)
        results = [None if t is None else total.to(t.dtype) for t, total in zip(tensors, totals)]
        return (grad_shard, grad_shard_weights, *results, None)


def _reduce_stacked(
    home: list[list[torch.Tensor]], slots: list[list[torch.Tensor]], slot_ids: list[list[int]], context: StepContext
) -> list[torch.Tensor]:
    """Local transport: fp32 ``[E, ...]`` weight gradients from every rank's home and slot gradients.

    Home gradients in expert order (rank r holds [r*epn, (r+1)*epn)), then each receiver's
    borrowed-expert gradients added to their owners', receivers in ascending rank: a fixed order.
    """
    totals = [torch.cat([grads[which] for grads in home]) for which in range(4)]
    for local_index, grads in enumerate(slots):
        rank = context.group.local_ranks[local_index]
        for slot, expert in enumerate(slot_ids[rank]):
            if expert >= 0:
                for which in range(4):
                    totals[which][expert] += grads[which][slot]
    return totals


def _reduce_per_process(
    home: list[torch.Tensor], slots: list[torch.Tensor] | None, tensors: tuple[torch.Tensor | None, ...],
    context: StepContext,
) -> list[torch.Tensor | None]:
    """Collective transport: fp32 weight gradients of this rank's home experts, shaped like ``tensors``.

    The receivers send their slot gradients here (tensor by tensor, every rank in the same order)
    and they are added after this rank's own, receivers in ascending rank: the local transport's
    order. A ``[E, ...]`` tensor gets them in its home rows and zeros elsewhere.
    """
    rank = context.group.local_ranks[0]
    epn = context.experts_per_rank
    totals: list[torch.Tensor | None] = []
    for which, tensor in enumerate(tensors):
        if tensor is None:
            totals.append(None)
            continue
        total = home[which]
        if slots is not None:
            for index, _, values in context.group.return_slot_gradients(slots[which], context.plan.slot_experts):
                total[index] += values
        if context.home(tensor, rank) is not tensor:  # an [E, ...] tensor, not this rank's slice
            full = torch.zeros(tensor.shape, dtype=torch.float32, device=total.device)
            full[rank * epn : (rank + 1) * epn] = total
            total = full
        totals.append(total)
    return totals


def _experts_backward(
    rows: torch.Tensor,
    route_weights: torch.Tensor,
    grad_out: torch.Tensor,
    weights: tuple[torch.Tensor | None, ...],
    ends: list[int],
    padding: list[int],
    activation: Activation,
    grad_rows: torch.Tensor,
    grad_route_weights: torch.Tensor,
    want_weights: bool,
) -> list[torch.Tensor]:
    """Backward of one part (home or slots) of one rank's experts, group by group, in fp32.

    ``y = w * (W2 a + b2)``, ``a = act(gate, up)``, ``[gate, up] = W13 x + b13`` per row of a
    group. Writes ``grad_rows [n, H]`` (in the rows' dtype) and ``grad_route_weights [n]`` fp32
    over every group's real rows; reads nothing of its padding rows (garbage, even NaN: dispatch
    leaves them unwritten), whose gradients keep the values they had (the caller's zeros).

    Args:
        rows: ``[n, H]``; route_weights: ``[n]`` fp32; grad_out: ``[n, H]``.
        weights: ``(w13 [G, 2I, H], w2 [G, H, I], b13 [G, 2I] | None, b2 [G, H] | None)``.
        ends: ``G`` inclusive padded end rows of the groups, from row 0 of ``rows``.
        padding: ``G`` padding rows at the end of each group (the plan's ``padding[..., 1]``).

    Returns:
        fp32 ``[dW13 [G, 2I, H], dW2 [G, H, I], db13 [G, 2I], db2 [G, H]]`` (zeros for groups
        without rows; the bias gradients even where the layer has no biases, then unused), or an
        empty list without ``want_weights``.
    """
    w13, w2, b13, b2 = weights
    groups, double_intermediate, hidden = w13.shape
    intermediate = double_intermediate // 2
    fp32 = dict(dtype=torch.float32, device=rows.device)
    grads = [torch.zeros(groups, double_intermediate, hidden, **fp32), torch.zeros(groups, hidden, intermediate, **fp32),
             torch.zeros(groups, double_intermediate, **fp32), torch.zeros(groups, hidden, **fp32)] if want_weights else []
    start = 0
    for group, (padded_end, pad) in enumerate(zip(ends, padding)):
        # Real rows only: a padding row's garbage must reach neither the weight gradients (sums
        # over rows) nor anything else.
        end = padded_end - pad
        if end == start:
            start = padded_end
            continue
        x = rows[start:end].float()
        route = route_weights[start:end].float().unsqueeze(-1)
        grad_y = grad_out[start:end].float()
        up_weights, down_weights = w13[group].float(), w2[group].float()
        projected = x @ up_weights.T
        if b13 is not None:
            projected = projected + b13[group].float()
        with torch.enable_grad():
            gate = projected[:, :intermediate].detach().requires_grad_()
            up = projected[:, intermediate:].detach().requires_grad_()
            activated = activation(gate, up)
        grad_activated = grad_y @ down_weights  # [n, I]: d(W2 a)/da applied to dy, before the route weight
        grad_route = (grad_activated * activated.detach()).sum(-1)
        if b2 is not None:
            grad_route = grad_route + grad_y @ b2[group].float()
        grad_gate, grad_up = torch.autograd.grad(activated, (gate, up), grad_activated * route, allow_unused=True)
        grad_projected = torch.cat([torch.zeros_like(gate) if grad_gate is None else grad_gate,
                                    torch.zeros_like(up) if grad_up is None else grad_up], dim=-1)
        grad_rows[start:end] = (grad_projected @ up_weights).to(grad_rows.dtype)
        grad_route_weights[start:end] = grad_route
        if want_weights:
            grads[0][group] = grad_projected.T @ x
            grads[1][group] = grad_y.T @ (activated.detach() * route)
            grads[2][group] = grad_projected.sum(0)
            grads[3][group] = (grad_y * route).sum(0)
        start = padded_end
    return grads


def differentiable_step(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    plan: Layout,
    group: Group,
    *,
    experts_per_rank: int,
    activation: Activation,
    precision: str,
    combine_dtype: torch.dtype | None,
    backend: str,
    comm_programs: int | None,
) -> torch.Tensor:
    """One EP step on the local or collective transport that autograd can differentiate: dispatch, experts, combine.

    Called by :func:`flatep.ep_moe` when grad is enabled and an input requires it; the forward
    computes what ``ep_moe`` computes without grad, bit for bit.

    Args:
        x: ``[R, s, H]`` (local) or ``[s, H]`` (collective) bf16 or fp32, contiguous; topk_weights:
            ``[R, s, K]`` (or ``[s, K]``) fp32, contiguous.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]`` (``x``'s dtype); b13: ``[E, 2I]`` or None; b2: ``[E, H]``
            or None. On the collective transport also this rank's ``[epn, ...]`` slices.
        plan: the step's checked plan in the split layout (a :class:`RankPlan` on the collective
            transport); group: a local or collective group.
        experts_per_rank, activation, precision, combine_dtype, backend, comm_programs: as for ``ep_moe``.

    Returns:
        ``[R, s, H]`` (or ``[s, H]``) in ``x``'s dtype.
    """
    context = StepContext(plan, group, experts_per_rank, activation, precision, combine_dtype or x.dtype, backend,
                          comm_programs)
    if not group.stacked:  # one rank per process: a rank dimension of 1, so both transports share the code
        x, topk_weights = x.unsqueeze(0), topk_weights.unsqueeze(0)
    shard, shard_weights, links = DispatchRows.apply(x, topk_weights, context)
    rows = GroupedExperts.apply(shard, shard_weights, w13, w2, b13, b2, context)
    out = CombineRows.apply(rows, links, x.shape[-2], topk_weights.shape[-1], x.dtype, context)
    return out if group.stacked else out[0]
