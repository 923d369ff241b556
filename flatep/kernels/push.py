"""Weight push: owners copy each borrowed expert into the receiver's slot for one step.

Pools are symmetric buffers laid out ``[2*epn, numel]`` per rank: home experts, then slots. A
one-program kernel first lists the slots this process must fill (a compaction of the plan's slot
table, on the device); a persistent copy kernel then walks that list, every program copying a
strided share of the chunks of each listed expert. Grid sizes depend only on the device, never on
the routing, and nothing waits on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _list_pushes_kernel(slot_experts_ptr, pushes_ptr, count_ptr, first_rank, local_ranks, SLOTS: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.arange(0, BLOCK)
    expert = tl.load(slot_experts_ptr + slot, mask=slot < SLOTS, other=-1)
    owner = expert // EPN
    mine = (expert >= 0) & (owner >= first_rank) & (owner < first_rank + local_ranks)
    position = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    tl.store(pushes_ptr + position, slot, mask=mine)
    tl.store(count_ptr, tl.sum(mine.to(tl.int32), axis=0))


@triton.jit
def _push_kernel(
    pool_ptr, pool_peers_ptr, slot_experts_ptr, pushes_ptr, count_ptr, numel,
    EPN: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    # Pools exceed 2**31 elements at real sizes (Kimi-K3: 224 experts x 22M): index in int64.
    expert_stride = tl.full([], numel, tl.int64)
    chunks = tl.cdiv(numel, BLOCK)
    count = tl.load(count_ptr)
    for index in range(count):
        slot = tl.load(pushes_ptr + index)
        expert = tl.load(slot_experts_ptr + slot)
        owner = expert // EPN
        receiver = slot // EPN
        source = pool_ptr + tl.load(pool_peers_ptr + owner) + (expert - owner * EPN) * expert_stride
        target = pool_ptr + tl.load(pool_peers_ptr + receiver) + (EPN + slot % EPN) * expert_stride
        for chunk in range(program, chunks, programs):
            column = chunk * BLOCK + tl.arange(0, BLOCK)  # one expert stays below 2**31 elements
            mask = column < numel
            tl.store(target + column, tl.load(source + column, mask=mask), mask=mask)


def _programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # the interpreter runs programs one after another: few and long is fastest


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
    pushes = torch.empty(ranks * epn, dtype=torch.int32, device=pool.device)
    count = torch.empty(1, dtype=torch.int32, device=pool.device)
    _list_pushes_kernel[(1,)](
        slot_experts, pushes, count, first_rank, local_ranks,
        SLOTS=ranks * epn, EPN=epn, BLOCK=triton.next_power_of_2(ranks * epn),
    )
    block = 8192 if pool.device.type == "cuda" else 4096
    _push_kernel[(_programs(pool.device),)](
        pool, pool_peers, slot_experts, pushes, count, expert_numel, EPN=epn, BLOCK=block, num_warps=8,
    )


def push_torch(pools: torch.Tensor, slot_experts: torch.Tensor) -> None:
    """Plain-torch push on stacked pools ``[R, 2*epn, ...]`` (host loop over occupied slots)."""
    epn = slot_experts.shape[1]
    for receiver, slot in (slot_experts >= 0).nonzero().tolist():
        expert = int(slot_experts[receiver, slot])
        pools[receiver, epn + slot].copy_(pools[expert // epn, expert % epn])
