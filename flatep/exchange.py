"""Dispatch and combine on any transport, once per destination rank: what the layer and the backward share.

Both steps follow the plan's ``carrier`` and ``send_order`` (:class:`flatep.plan.types.Plan`). On the
peer-addressable transports (local, nvlink) the Triton kernels, or their plain-torch twins on the
local transport, move the rows; the collective transport moves them with its own all-to-alls
(:class:`flatep.transport.collective.CollectiveGroup`), in the same arithmetic, so every transport
gives bit-identical outputs.
"""
from __future__ import annotations

import torch

from flatep.kernels.backend import use_triton
from flatep.kernels.combine import combine_torch, combine_triton, sum_runs_torch, sum_runs_triton
from flatep.kernels.dispatch import dispatch_torch, dispatch_triton, expand_torch, expand_triton, real_rows_torch
from flatep.kernels.fp8_rows import pack_rows_torch, pack_rows_triton, unpack_real_rows_torch, unpack_real_rows_triton
from flatep.plan.types import Layout
from flatep.transport.base import Group


def entry_tables(plan: Layout, tokens: int, top_k: int) -> tuple[torch.Tensor, ...]:
    """The plan's ``(dest_rank, dest_row, carrier, send_order)``, each ``[n, s, K]`` int32 for the ranks this process drives."""
    return tuple(table.view(-1, tokens, top_k) for table in (plan.dest_rank, plan.dest_row, plan.carrier, plan.send_order))


def dispatch_rows(
    x: torch.Tensor, topk_weights: torch.Tensor, plan: Layout, group: Group, shard: torch.Tensor,
    shard_weights: torch.Tensor, links: torch.Tensor, backend: str = "auto", programs: int | None = None,
) -> None:
    """Dispatch, barrier, then expand: every real row of every shard holds its token's row and route weight.

    Args:
        x: ``[n, s, H]`` or ``[s, H]`` tokens of the ranks this process drives; topk_weights:
            ``[.., s, K]`` fp32.
        plan: the step's plan; group: its group.
        shard: ``[n, rows, H]`` (or ``[rows, H]``, or ``[1, rows, H]`` on a per-process
            transport), in ``x``'s dtype; shard_weights: ``[.., rows]`` fp32; links:
            ``[.., rows, 2]`` int32; all three written on their real rows only (links with
            ``plan.dedup``; combine reads them). Symmetric buffers on the nvlink transport.
        backend, programs: see :func:`flatep.ep_moe` (``programs`` caps the kernels' grids).
    """
    hidden = x.shape[-1]
    tokens, top_k = topk_weights.shape[-2:]
    if not group.peer_addressable:
        group.dispatch(x.view(tokens, hidden), topk_weights.view(tokens, top_k), plan, shard.view(-1, hidden),
                       shard_weights.view(-1), links.view(-1, 2))
        return
    tables = entry_tables(plan, tokens, top_k)
    if use_triton(x.device, backend):
        dispatch_triton(
            x.view(-1, tokens, hidden), topk_weights.view(-1, tokens, top_k), *tables, shard, shard_weights, links,
            group.peer_offsets(shard), group.peer_offsets(shard_weights), group.peer_offsets(links), plan.dedup,
            programs=programs,
        )
        group.barrier()  # every carrier row and link has landed: the expansion reads them
        if plan.dedup:
            expand_triton(shard, links, plan.offsets, plan.padding, plan.slot_base, group.first_rank, programs=programs)
        return
    if not group.stacked:
        raise ValueError("the torch dispatch path needs the local transport")
    dispatch_torch(x, topk_weights, *tables, shard, shard_weights, links, plan.dedup)
    if plan.dedup:
        expand_torch(shard, links, real_rows_torch(plan.offsets, plan.padding, plan.slot_base, shard.shape[-2]))


def pack_rows(x: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``x [.., H]`` quantized into packed fp8 rows ``[.., W]`` int32 (:mod:`flatep.kernels.fp8_rows`)."""
    return pack_rows_triton(x) if use_triton(x.device, backend) else pack_rows_torch(x)


def unpack_rows(
    packed: torch.Tensor, shard: torch.Tensor, plan: Layout, group: Group, backend: str = "auto",
    programs: int | None = None,
) -> None:
    """Unpack the real rows of this process's packed shards (after :func:`dispatch_rows`) into ``shard``.

    Args:
        packed: ``[n, rows, W]`` (or ``[rows, W]``) int32, every real row complete (expanded).
        shard: ``[n, rows, H]`` (or ``[rows, H]``) the experts' input rows; padding rows untouched.
        plan, group, backend, programs: as for :func:`dispatch_rows`.
    """
    if use_triton(shard.device, backend):
        unpack_real_rows_triton(packed, shard, plan.offsets, plan.padding, plan.slot_base, group.first_rank,
                                programs=programs)
        return
    ranks = slice(group.first_rank, group.first_rank + len(group.local_ranks))
    rows, hidden = shard.shape[-2:]
    real = real_rows_torch(plan.offsets[ranks], plan.padding[ranks], plan.slot_base, rows)
    unpack_real_rows_torch(packed.view(-1, rows, packed.shape[-1]), shard.view(-1, rows, hidden), real)


def combine_rows(
    rows: torch.Tensor, plan: Layout, group: Group, links: torch.Tensor, tokens: int, top_k: int,
    out_dtype: torch.dtype, backend: str = "auto", programs: int | None = None, sums: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum each run into its carrier's row, barrier, then sum every token's carriers: ``[n, s, H]`` (or ``[s, H]``).

    Args:
        rows: ``[n, rows, H]`` (or ``[rows, H]``, ``[1, rows, H]``) expert outputs of this process's shards.
        plan: the plan dispatch used; group: its group; links: the link tables dispatch wrote.
        tokens, top_k: ``s`` and ``K``; out_dtype: dtype of the result.
        backend, programs: see :func:`flatep.ep_moe`.
        sums: where the runs' sums go, shaped like ``rows`` (default ``rows`` itself: its carrier
            rows are overwritten); only carrier rows are written and read. Symmetric on nvlink.
            Unused without ``plan.dedup``: each run is then its carrier's row alone, already its sum.

    Returns:
        ``[n, s, H]`` on the peer-addressable transports, ``[s, H]`` on the collective one;
        padded tokens get zeros.
    """
    hidden = rows.shape[-1]
    if not group.peer_addressable:
        return group.combine(rows.view(-1, hidden), plan, links.view(-1, 2), out_dtype)
    # Without dedup there is nothing to sum, and combine reads ``rows`` themselves (``sums`` stays unwritten).
    sums = rows if sums is None or not plan.dedup else sums
    tables = entry_tables(plan, tokens, top_k)
    if use_triton(rows.device, backend):
        if plan.dedup:
            sum_runs_triton(rows, sums, links, plan.offsets, plan.padding, plan.slot_base, group.first_rank, top_k,
                            programs=programs)
        group.barrier()  # every rank's run sums are complete
        out = torch.empty(tables[0].shape[0], tokens, hidden, dtype=out_dtype, device=rows.device)
        combine_triton(out, *tables, sums, group.peer_offsets(sums), programs=programs)
        return out
    if not group.stacked:
        raise ValueError("the torch combine path needs the local transport")
    if plan.dedup:
        sum_runs_torch(rows, sums, links, real_rows_torch(plan.offsets, plan.padding, plan.slot_base, rows.shape[-2]),
                       top_k)
    return combine_torch(*tables, sums, out_dtype)
