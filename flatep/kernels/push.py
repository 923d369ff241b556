"""Weight push: owners copy each borrowed expert into the receiver's slot for one step.

Home pools and slots are symmetric buffers laid out ``[epn, numel]`` per rank. A
one-program kernel first lists the slots this process must fill (a compaction of the plan's slot
table, on the device); a persistent copy kernel then walks that list, every program copying a
strided share of the chunks of each listed expert. Grid sizes depend only on the device (and an
optional cap on the programs), never on the routing, and nothing waits on the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import check_programs


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
    home_ptr, home_peers_ptr, slots_ptr, slot_peers_ptr, slot_experts_ptr, pushes_ptr, count_ptr, numel,
    EPN: tl.constexpr, BLOCK: tl.constexpr,
):
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    # Pools exceed 2**31 elements at real sizes (Kimi-K3: 224 experts x 22M): index in int64.
    expert_stride = tl.full([], numel, tl.int64)
    block = tl.full([], BLOCK, tl.int64)  # chunk * BLOCK may pass 2**31 near the end of a large expert
    chunks = tl.cdiv(numel, BLOCK)
    count = tl.load(count_ptr)
    for index in range(count):
        slot = tl.load(pushes_ptr + index)
        expert = tl.load(slot_experts_ptr + slot)
        owner = expert // EPN
        receiver = slot // EPN
        source = home_ptr + tl.load(home_peers_ptr + owner) + (expert - owner * EPN) * expert_stride
        target = slots_ptr + tl.load(slot_peers_ptr + receiver) + (slot % EPN) * expert_stride
        for chunk in range(program, chunks, programs):
            column = chunk * block + tl.arange(0, BLOCK)
            mask = column < numel
            tl.store(target + column, tl.load(source + column, mask=mask), mask=mask)


def push_programs(device: torch.device, programs: int | None = None) -> int:
    """Programs of the push copy kernel: 4 per SM on CUDA (2 under the interpreter), at most ``programs``.

    Raises:
        ValueError: if ``programs`` is not None or a positive int.
    """
    check_programs(programs)
    if device.type == "cuda":
        default = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        default = 2  # the interpreter runs programs one after another: few and long is fastest
    return min(default, programs or default)


def chunk_elements(pool: torch.Tensor) -> int:
    """Elements of ``pool`` one push program copies per chunk: a fixed number of bytes (16 KiB on
    CUDA, 8 KiB under the interpreter), whatever the element size. Counted in elements, chunks of
    one-byte pools (fp8 values, packed mxfp4 blocks, e8m0 scales) held half a bf16 chunk's bytes,
    and on the H200 an fp8 Kimi-K2 push moved its bytes at 0.65x a bf16 push's rate."""
    chunk_bytes = 16384 if pool.device.type == "cuda" else 8192
    return max(chunk_bytes // pool.element_size(), 1)


def push_triton(
    home: torch.Tensor,
    home_peers: torch.Tensor,
    slots: torch.Tensor,
    slot_peers: torch.Tensor,
    slot_experts: torch.Tensor,
    first_rank: int,
    local_ranks: int,
    expert_numel: int,
    programs: int | None = None,
) -> None:
    """Copy every expert lent by this process's ranks into its receivers' slots.

    Args:
        home: base of this process's home pool of one projection, ``[.., epn, *expert_shape]``, contiguous.
        home_peers: ``[R] int64`` element offsets of every rank's home pool from ``home``'s base.
        slots: base of this process's slots of that projection, shaped like ``home``.
        slot_peers: ``[R] int64`` element offsets of every rank's slots from ``slots``' base.
        slot_experts: ``[R, epn]`` int32 global id borrowed into each slot (``-1`` empty).
        first_rank, local_ranks: the ranks this process drives, ``[first_rank, first_rank + local_ranks)``.
        expert_numel: elements of one expert in this projection.
        programs: at most this many copy programs (default 4 per SM), to leave SMs to work
            running beside the push; the bytes copied do not depend on it.
    """
    grid = (push_programs(home.device, programs),)
    ranks, epn = slot_experts.shape
    pushes = torch.empty(ranks * epn, dtype=torch.int32, device=home.device)
    count = torch.empty(1, dtype=torch.int32, device=home.device)
    _list_pushes_kernel[(1,)](
        slot_experts, pushes, count, first_rank, local_ranks,
        SLOTS=ranks * epn, EPN=epn, BLOCK=triton.next_power_of_2(ranks * epn),
    )
    block = chunk_elements(home)
    _push_kernel[grid](
        home, home_peers, slots, slot_peers, slot_experts, pushes, count, expert_numel, EPN=epn, BLOCK=block, num_warps=8,
    )


def push_torch(homes: torch.Tensor, slots: torch.Tensor, slot_experts: torch.Tensor) -> None:
    """Plain-torch push on stacked pools: ``homes [R, epn, ...]`` into ``slots [R, epn, ...]`` (host loop)."""
    epn = slot_experts.shape[1]
    for receiver, slot in (slot_experts >= 0).nonzero().tolist():
        expert = int(slot_experts[receiver, slot])
        slots[receiver, slot].copy_(homes[expert // epn, expert % epn])
