"""Weight push: owners copy each borrowed expert into the receiver's slot for one step.

Pools are symmetric buffers laid out ``[2*epn, numel]`` per rank: home experts, then slots. Every
program copies one ``BLOCK``-element chunk of every expert that this process's ranks lend, so the
grid size depends only on the expert size, never on the routing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _push_kernel(
    pool_ptr, pool_peers_ptr, slot_experts_ptr, first_rank, local_ranks, numel,
    RANKS: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr,
):
    column = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = column < numel
    # Pools exceed 2**31 elements at real sizes (Kimi-K3: 224 experts x 22M): index in int64.
    expert_stride = tl.full([], numel, tl.int64)
    for slot in range(RANKS * EPN):
        expert = tl.load(slot_experts_ptr + slot)
        owner = expert // EPN
        if (expert >= 0) & (owner >= first_rank) & (owner < first_rank + local_ranks):
            receiver = slot // EPN
            source = pool_ptr + tl.load(pool_peers_ptr + owner) + (expert - owner * EPN) * expert_stride
            target = pool_ptr + tl.load(pool_peers_ptr + receiver) + (EPN + slot % EPN) * expert_stride
            tl.store(target + column, tl.load(source + column, mask=mask), mask=mask)


def push_triton(
    pool: torch.Tensor,
    pool_peers: torch.Tensor,
    slot_experts: torch.Tensor,
    first_rank: int,
    local_ranks: int,
    expert_numel: int,
) -> None:
    """Copy every expert lent by this process's ranks into its receivers' slots.

    Args:
        pool: base of this process's pool of one projection, ``[.., 2*epn, *expert_shape]``, contiguous.
        pool_peers: ``[R] int64`` element offsets of every rank's pool from ``pool``'s base.
        slot_experts: ``[R, epn]`` int32 global id borrowed into each slot (``-1`` empty).
        first_rank, local_ranks: the ranks this process drives, ``[first_rank, first_rank + local_ranks)``.
        expert_numel: elements of one expert in this projection.
    """
    ranks, epn = slot_experts.shape
    block = 4096
    _push_kernel[(triton.cdiv(expert_numel, block),)](
        pool, pool_peers, slot_experts, first_rank, local_ranks, expert_numel, RANKS=ranks, EPN=epn, BLOCK=block,
    )


def push_torch(pools: torch.Tensor, slot_experts: torch.Tensor) -> None:
    """Plain-torch push on stacked pools ``[R, 2*epn, ...]`` (host loop over occupied slots)."""
    epn = slot_experts.shape[1]
    for receiver, slot in (slot_experts >= 0).nonzero().tolist():
        expert = int(slot_experts[receiver, slot])
        pools[receiver, epn + slot].copy_(pools[expert // epn, expert % epn])
