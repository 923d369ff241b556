"""The backward pass of an EP MoE step on the local (virtual ranks), collective and NVLink (one rank per process) transports.

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
  per-process transports the owners push them, :meth:`CollectiveGroup.push_experts`,
  :meth:`NVLinkGroup.push_copies`). Its backward
  gives the rows' and route weights' gradients and every expert's weight gradients.
- :class:`CombineRows`: output rows (and the links) -> ``[R, s, H]``. Its backward is a dispatch
  of the output gradient to the token's carriers, expanded there into the very rows the forward
  summed (padding rows are not written: see below).

Tensors carry a leading rank dimension: ``R`` on the local transport, ``1`` (this process's rank)
on the per-process ones, where dispatch and combine are the group's own (``dispatch``, ``combine``,
``gather_entries``): all-to-alls on the collective transport, the dispatch and combine kernels over
symmetric staging buffers on the NVLink one.

What the forward keeps for the backward, per rank: the dispatched rows ``[rows, H]`` in ``x``'s
dtype and their route weights ``[rows]`` fp32 (``rows`` = the plan's ``shard_rows``, sized by
``s``, never by ``E``), the plan's tables (int32 ``[s, K]`` destinations, ``[2*epn]`` offsets and
slots), and references to the weight tensors themselves (no copies). The gate/up GEMM and the
activation are recomputed in the backward rather than kept (``[rows, 2I]`` and ``[rows, I]`` per
rank would outweigh the rows), and the borrowed experts are read again from ``w13``/``w2`` (on the
per-process transports the forward keeps the pushed copies, ``epn`` experts: a second push would
cost the messages again).

The expert backward computes in fp32 whatever the weights' dtype and reads nothing back to the
host: per home or slot part of a rank it recomputes the gate/up projection with a grouped GEMM,
takes the activation's derivative by autograd on that elementwise function alone (so
:class:`flatep.experts.ClampedSwiGLU` and other activations work), and runs grouped GEMMs for the
input and weight gradients, over the plan's offsets on the device (:mod:`flatep.kernels.grouped_fp32`:
Triton on CUDA, where ``torch._grouped_mm`` would synchronise in fp32; ``torch._grouped_mm`` on a
CPU). Rows that hold no entry (group padding, rows outside every group) are masked by the plan's
row counts (``group_start``, ``alloc``), not trusted to be zero: they add nothing to any gradient,
even if they hold NaN. Only the weight gradients autograd asks for are computed.
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
run; they equal a dense (non-EP) layer's within rounding. On the local transport the reduction is
a gather, add and scatter of whole expert rows per receiver (a receiver holds an expert in one
slot at most: no atomics), on the device. On the collective transport each receiver sends its fp32
slot gradients to the owner (:meth:`CollectiveGroup.return_slot_gradients`, read on the host),
which adds them in that same order; on the NVLink transport each owner reads them from the
receivers' staging buffers and adds them on the device in that order
(:meth:`NVLinkGroup.add_slot_gradients`). Both therefore equal the local transport's gradients bit
for bit. There a rank's weight gradient covers its home experts only: a ``[E, ...]`` tensor gets zeros elsewhere
(the other ranks' experts are theirs to train), an ``[epn, ...]`` slice gets all of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from flatep.exchange import combine_rows, dispatch_rows
from flatep.experts.grouped import Activation, grouped_swiglu, row_groups
from flatep.kernels.grouped_fp32 import grouped_outer_mm, grouped_rows_mm
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
        top_k: ``K``.
    """

    plan: Layout
    group: Group
    experts_per_rank: int
    activation: Activation
    precision: str
    rows_dtype: torch.dtype
    backend: str
    comm_programs: int | None
    top_k: int

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
    if group.peer_addressable and not group.stacked:  # NVLink: the kernels need symmetric buffers, staged there
        group.dispatch(rows[0], route_weights[0], plan, shard[0], shard_weights[0], links[0])
    else:
        dispatch_rows(rows, route_weights, plan, group, shard, shard_weights, links, context.backend,
                      context.comm_programs)
    return shard, shard_weights, links


def _gather(shard: torch.Tensor, links: torch.Tensor, tokens: int, top_k: int, out_dtype: torch.dtype,
            context: StepContext) -> torch.Tensor:
    """Combine: ``[R, s, H]`` in ``out_dtype``, every token the sum of its K rows of ``shard [R, rows, H]``
    (each rank's rows of a token summed first, into a fresh tensor: ``shard`` is left as it is)."""
    group = context.group
    if group.peer_addressable and not group.stacked:  # NVLink: staged in symmetric buffers
        return group.combine(shard[0], context.plan, links[0], out_dtype).unsqueeze(0)
    sums = torch.empty_like(shard) if group.peer_addressable else None
    out = combine_rows(shard, context.plan, group, links, tokens, top_k, out_dtype, context.backend,
                       context.comm_programs, sums=sums)
    return out if group.stacked else out.unsqueeze(0)


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
    """On the per-process transports (collective, NVLink): this rank's slots, ``[epn, ...]`` per tensor of ``tensors``
    (``None`` stays ``None``), pushed from their owners' home experts; empty slots are zeros."""
    group, rank = context.group, context.group.local_ranks[0]
    slots = []
    for tensor in tensors:
        if tensor is None:
            slots.append(None)
            continue
        home = context.home(tensor, rank).contiguous()
        if group.peer_addressable:  # NVLink: the push kernel moves weights between symmetric buffers only
            slots.append(group.push_copies(home, context.plan.slot_experts))
            continue
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
                    out=out[local_index, first:end], rows_per_group=context.plan.rows_per_expert(context.top_k),
                )
        ctx.context, ctx.pushed = context, pushed
        ctx.save_for_backward(shard, shard_weights, w13, w2, b13, b2)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        context: StepContext = ctx.context
        shard, shard_weights, w13, w2, b13, b2 = ctx.saved_tensors
        tensors = (w13, w2, b13, b2)
        wanted = tuple(t is not None and needed for t, needed in zip(tensors, ctx.needs_input_grad[2:6]))
        grad_shard = torch.zeros_like(shard)
        grad_shard_weights = torch.zeros_like(shard_weights)
        stacked = context.group.stacked
        # fp32 weight gradients: every expert's [E + 1, ...] on the local transport (the extra row
        # takes empty slots' gradients, see _add_slots), this rank's home experts [epn, ...] otherwise.
        experts = context.plan.alloc.shape[0] + 1 if stacked else context.experts_per_rank
        totals = [torch.zeros(experts, *t.shape[1:], dtype=torch.float32, device=shard.device) if want else None
                  for t, want in zip(tensors, wanted)]
        # Parts outer, ranks inner: every home gradient is in place before the first slot gradient is
        # added to it, so one rank's slot gradients at a time are alive, and the order is fixed.
        for part, first, end in context.parts():
            for local_index in range(shard.shape[0]):
                rank = context.group.local_ranks[local_index]
                weights = _expert_weights(context, local_index, part, tensors, ctx.pushed)
                grads = _experts_backward(
                    shard[local_index, first:end], shard_weights[local_index, first:end],
                    grad_out[local_index, first:end], _real_rows(context, rank, part, first, end), weights,
                    _part_offsets(context, rank, part, first), context.activation, wanted, context.backend,
                    grad_shard[local_index, first:end], grad_shard_weights[local_index, first:end],
                )
                if part == "home":
                    home = slice(rank * context.experts_per_rank, (rank + 1) * context.experts_per_rank) if stacked else slice(None)
                    for total, grad in zip(totals, grads):
                        if total is not None:
                            total[home] = grad
                elif stacked:
                    _add_slots(totals, grads, context.plan.slot_experts[rank])
                else:
                    _add_returned_slots(totals, grads, context)
        results = []
        for tensor, total in zip(tensors, totals):
            if total is not None and stacked:
                total = total[:-1]
            elif total is not None and context.home(tensor, context.group.local_ranks[0]) is not tensor:
                # An [E, ...] tensor on a per-process transport: this rank's home rows, zeros elsewhere.
                full = torch.zeros(tensor.shape, dtype=torch.float32, device=total.device)
                rank = context.group.local_ranks[0]
                full[rank * context.experts_per_rank : (rank + 1) * context.experts_per_rank] = total
                total = full
            results.append(None if total is None else total.to(tensor.dtype))
        return (grad_shard, grad_shard_weights, *results, None)


def _real_rows(context: StepContext, rank: int, part: str, first: int, end: int) -> torch.Tensor:
    """``[end - first]`` bool: which rows of ``rank``'s shard part hold a dispatched entry.

    A group's real rows are ``[group_start, group_start + alloc)`` of its expert on this rank (the
    plan's row counts); its padding rows and the rows outside every group are not real, whatever
    they hold (dispatch need not zero them). Read on the device only.
    """
    plan, epn = context.plan, context.experts_per_rank
    experts = plan.group_experts[rank, :epn] if part == "home" else plan.group_experts[rank, epn:]
    present = experts >= 0
    expert = experts.long().clamp_min(0)
    starts = plan.group_start[rank].long()[expert]
    ends = starts + torch.where(present, plan.alloc[expert, rank].long(), 0)
    row = torch.arange(first, end, device=experts.device).unsqueeze(1)
    return ((row >= starts) & (row < ends)).any(1)


def _add_slots(totals: list[torch.Tensor | None], grads: list[torch.Tensor | None], slot_experts: torch.Tensor) -> None:
    """Local transport: add one receiver's slot gradients ``[epn, ...]`` to their owners' rows of ``totals``.

    A gather, an add and a scatter of whole rows: a receiver borrows an expert into one slot at
    most, so each owner row is written once per receiver (no atomics, deterministic); empty slots
    (``-1``) go to the extra last row, which is dropped. Called receiver by receiver in ascending
    rank, after every home gradient: the documented order of the sums.
    """
    for total, grad in zip(totals, grads):
        if total is not None:
            target = torch.where(slot_experts >= 0, slot_experts, total.shape[0] - 1).long()
            total.index_copy_(0, target, total.index_select(0, target) + grad)


def _add_returned_slots(totals: list[torch.Tensor | None], grads: list[torch.Tensor | None], context: StepContext) -> None:
    """Per-process transports: send this rank's slot gradients to their owners and add the ones it owns to ``totals``.

    Tensor by tensor, every rank in the same order. The collective transport returns them by messages
    (read on the host, added here receiver by receiver in ascending rank); the NVLink transport adds
    them on the device in that same order (:meth:`NVLinkGroup.add_slot_gradients`).
    """
    group, slot_experts = context.group, context.plan.slot_experts
    for total, grad in zip(totals, grads):
        if total is None:
            continue
        if group.peer_addressable:
            group.add_slot_gradients(total, grad, slot_experts)
            continue
        for index, _, values in group.return_slot_gradients(grad, slot_experts):
            total[index] += values


def _experts_backward(
    rows: torch.Tensor,
    route_weights: torch.Tensor,
    grad_out: torch.Tensor,
    real: torch.Tensor,
    weights: tuple[torch.Tensor | None, ...],
    offsets: torch.Tensor,
    activation: Activation,
    wanted: tuple[bool, ...],
    backend: str,
    grad_rows: torch.Tensor,
    grad_route_weights: torch.Tensor,
) -> list[torch.Tensor | None]:
    """Backward of one part (home or slots) of one rank's experts, in fp32, with grouped GEMMs
    (TF32 products for 16-bit weights on CUDA: :mod:`flatep.kernels.grouped_fp32`).

    ``y = w * (W2 a + b2)``, ``a = act(gate, up)``, ``[gate, up] = W13 x + b13`` per row of a
    group. Writes ``grad_rows [n, H]`` (in the rows' dtype) and ``grad_route_weights [n]`` fp32;
    rows that are not ``real`` get zeros and add nothing to the weight gradients, even if they
    hold NaN. Reads nothing on the host: the GEMMs take ``offsets`` on the device
    (:mod:`flatep.kernels.grouped_fp32`).

    Args:
        rows: ``[n, H]``; route_weights: ``[n]`` fp32; grad_out: ``[n, H]``; real: ``[n]`` bool.
        weights: ``(w13 [G, 2I, H], w2 [G, H, I], b13 [G, 2I] | None, b2 [G, H] | None)``.
        offsets: ``[G]`` int32 inclusive end rows of the groups, from row 0 of ``rows``.
        wanted: which of ``(dW13, dW2, db13, db2)`` to compute.
        backend: ``auto``/``triton`` (the Triton GEMMs) or ``torch`` (``torch._grouped_mm``).

    Returns:
        fp32 ``[dW13 [G, 2I, H], dW2 [G, H, I], db13 [G, 2I], db2 [G, H]]``, ``None`` where not wanted.
    """
    w13, w2, b13, b2 = weights
    intermediate = w2.shape[-1]
    # Weights stored in 16 bits carry less precision than TF32's operands: their products run on
    # the tensor cores; fp32 weights keep IEEE fp32 products.
    gemm = dict(backend=backend, precision="tf32" if w13.element_size() == 2 else "ieee")
    # Rows that are not real become zeros (torch.where, not a product: NaN * 0 is NaN), so their
    # gradients, and their terms in every weight gradient, are exactly zero.
    x = torch.where(real.unsqueeze(-1), rows.float(), 0.0)
    grad_y = torch.where(real.unsqueeze(-1), grad_out.float(), 0.0)
    route = torch.where(real, route_weights.float(), 0.0).unsqueeze(-1)
    groups = row_groups(offsets, rows.shape[0]) if b13 is not None or b2 is not None else None
    projected = grouped_rows_mm(x, w13.transpose(-2, -1), offsets, **gemm)  # [n, 2I]
    if b13 is not None:
        projected = projected + b13.float()[groups]
    with torch.enable_grad():
        gate = projected[:, :intermediate].detach().requires_grad_()
        up = projected[:, intermediate:].detach().requires_grad_()
        activated = activation(gate, up)
    grad_activated = grouped_rows_mm(grad_y, w2, offsets, **gemm)  # [n, I]: dy W2, before the route weight
    grad_route = (grad_activated * activated.detach()).sum(-1)
    if b2 is not None:
        grad_route = grad_route + (grad_y * b2.float()[groups]).sum(-1)
    grad_gate, grad_up = torch.autograd.grad(activated, (gate, up), grad_activated * route, allow_unused=True)
    grad_projected = torch.cat([torch.zeros_like(gate) if grad_gate is None else grad_gate,
                                torch.zeros_like(up) if grad_up is None else grad_up], dim=-1)
    grad_rows.copy_(grouped_rows_mm(grad_projected, w13, offsets, **gemm))
    grad_route_weights.copy_(torch.where(real, grad_route, 0.0))
    # Bias gradients are per-group sums (in IEEE fp32: small): a grouped product with a column of ones (4 wide: torch's
    # grouped GEMM wants 16-byte rows), of which the first is kept.
    ones = torch.ones(rows.shape[0], 4, dtype=torch.float32, device=rows.device) if wanted[2] or wanted[3] else None
    return [
        grouped_outer_mm(grad_projected, x, offsets, **gemm) if wanted[0] else None,
        grouped_outer_mm(grad_y, activated.detach() * route, offsets, **gemm) if wanted[1] else None,
        grouped_outer_mm(ones, grad_projected, offsets, backend)[:, 0] if wanted[2] else None,
        grouped_outer_mm(ones, grad_y * route, offsets, backend)[:, 0] if wanted[3] else None,
    ]


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
                          comm_programs, topk_weights.shape[-1])
    if not group.stacked:  # one rank per process: a rank dimension of 1, so both transports share the code
        x, topk_weights = x.unsqueeze(0), topk_weights.unsqueeze(0)
    shard, shard_weights, links = DispatchRows.apply(x, topk_weights, context)
    rows = GroupedExperts.apply(shard, shard_weights, w13, w2, b13, b2, context)
    out = CombineRows.apply(rows, links, x.shape[-2], topk_weights.shape[-1], x.dtype, context)
    return out if group.stacked else out[0]
