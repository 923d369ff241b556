"""Weight push: owners copy each borrowed expert into the receiver's slot for one step.

Home pools and slots are symmetric buffers laid out ``[epn, numel]`` per rank. One persistent
copy kernel moves every pool of a layer (values, scales, biases) in one launch: every program
reads the plan's slot table, lists (in registers) the slots this process must fill, and copies a
strided share of the chunks of each listed expert in each pool. Each (expert, pool) segment
starts at the program after the one that took the previous segment's last chunk, so the programs'
shares of all segments together differ by at most one chunk (a pool of scales, a few dozen
chunks an expert, does not leave most programs idle; an expert whose chunks do not divide evenly
does not cost a whole round). One launch for all pools pays the launch and the table scan once:
a packed pool has twice the tensors of a bf16 one (values and scales), and on the H200 each
launch cost about 5 us. Grid sizes depend only on the device (and an optional cap on the
programs), never on the routing, and nothing waits on the host. Each pool is copied as the
widest integers its rows allow (:func:`copy_views`): the kernel cannot know that peer addresses
are aligned, so each element is one memory access, and 8-byte elements move 4x (bf16) to 8x (fp8,
packed mxfp4) the bytes per access of the pools' own types. Pools keep their own element types in
one launch (a pool of odd-sized scales rows does not narrow the values' copies).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import check_programs


@triton.jit
def _push_kernel(
    homes, home_peers, slots, slot_peers, numels, slot_experts_ptr, first_rank, local_ranks,
    SLOTS: tl.constexpr, SLOTS_BLOCK: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr,
):
    # homes, home_peers, slots, slot_peers, numels: tuples with one entry per pool.
    program = tl.program_id(0)
    programs = tl.num_programs(0)
    # The slots whose expert one of this process's ranks owns, numbered in slot order.
    slot_ids = tl.arange(0, SLOTS_BLOCK)
    table = tl.load(slot_experts_ptr + slot_ids, mask=slot_ids < SLOTS, other=-1)
    owners = table // EPN
    mine = (table >= 0) & (owners >= first_rank) & (owners < first_rank + local_ranks)
    position = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    count = tl.sum(mine.to(tl.int32), axis=0)
    block = tl.full([], BLOCK, tl.int64)  # chunk * BLOCK may pass 2**31 near the end of a large expert
    taken = tl.full([], 0, tl.int32)  # chunks of the segments so far: the next starts at program taken % programs
    for index in range(count):
        slot = tl.sum(tl.where(mine & (position == index), slot_ids, 0), axis=0)
        expert = tl.load(slot_experts_ptr + slot)
        owner = expert // EPN
        receiver = slot // EPN
        for pool in tl.static_range(len(homes)):
            # Pools exceed 2**31 elements at real sizes (Kimi-K3: 224 experts x 22M): index in int64.
            numel = tl.full([], numels[pool], tl.int64)
            source = homes[pool] + tl.load(home_peers[pool] + owner) + (expert - owner * EPN) * numel
            target = slots[pool] + tl.load(slot_peers[pool] + receiver) + (slot % EPN) * numel
            chunks = tl.cdiv(numels[pool], BLOCK)
            for chunk in range((program + programs - taken % programs) % programs, chunks, programs):
                column = chunk * block + tl.arange(0, BLOCK)
                mask = column < numel
                tl.store(target + column, tl.load(source + column, mask=mask), mask=mask)
            taken += chunks


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
    CUDA, 8 KiB under the interpreter), whatever the element size."""
    chunk_bytes = 16384 if pool.device.type == "cuda" else 8192
    return max(chunk_bytes // pool.element_size(), 1)


def copy_views(*pools: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``pools`` reinterpreted as the widest integers (8, 4, 2 or 1 bytes) that divide the bytes of
    every pool's rows (its last dimension) and every pool's address: the same bytes, as few
    elements as possible, one element type for all (the kernel indexes them alike).

    On the H200 the push moved its elements at about the same rate whatever their size (a Kimi-K2
    expert in fp8, half the bytes, took 0.86x the time of one in bf16), so wider elements move
    more bytes per access.

    Args:
        pools: tensors whose last dimension is contiguous.
    """
    for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        width = dtype.itemsize
        if all((pool.shape[-1] * pool.element_size()) % width == 0 and pool.data_ptr() % width == 0 for pool in pools):
            return tuple(pool if pool.dtype == dtype else pool.view(torch.uint8).view(dtype) for pool in pools)
    raise AssertionError("a one-byte view always fits")


class PoolCopy(NamedTuple):
    """One pool of a layer as the push kernel takes it.

    Attributes:
        home: base of this process's home pool, ``[.., epn, *expert_shape]``, contiguous, viewed
            as the element type of :func:`copy_views` (with ``slots``).
        home_peers: ``[R] int64`` element offsets of every rank's home pool from ``home``'s base.
        slots: base of this process's slots of that pool, shaped like ``home``.
        slot_peers: ``[R] int64`` element offsets of every rank's slots from ``slots``' base.
        expert_numel: elements of one expert in this pool.
    """

    home: torch.Tensor
    home_peers: torch.Tensor
    slots: torch.Tensor
    slot_peers: torch.Tensor
    expert_numel: int


def push_triton(
    pools: Sequence[PoolCopy],
    slot_experts: torch.Tensor,
    first_rank: int,
    local_ranks: int,
    programs: int | None = None,
) -> None:
    """Copy every expert lent by this process's ranks into its receivers' slots, in every pool, in one launch.

    Args:
        pools: the layer's pools (at least one).
        slot_experts: ``[R, epn]`` int32 global id borrowed into each slot (``-1`` empty).
        first_rank, local_ranks: the ranks this process drives, ``[first_rank, first_rank + local_ranks)``.
        programs: at most this many copy programs (default 4 per SM), to leave SMs to work
            running beside the push; the bytes copied do not depend on it.
    """
    if not pools or any(pool.home.dtype != pool.slots.dtype for pool in pools):
        raise ValueError(f"pools must be one or more, home and slots of one element type each, got "
                         f"{[(pool.home.dtype, pool.slots.dtype) for pool in pools]}")
    home = pools[0].home
    grid = (push_programs(home.device, programs),)
    # One chunk length for all pools (a constexpr): that of the widest elements, so that no chunk
    # exceeds chunk_elements' bytes.
    block = min(chunk_elements(pool.home) for pool in pools)
    ranks, epn = slot_experts.shape
    _push_kernel[grid](
        tuple(pool.home for pool in pools), tuple(pool.home_peers for pool in pools),
        tuple(pool.slots for pool in pools), tuple(pool.slot_peers for pool in pools),
        tuple(pool.expert_numel for pool in pools), slot_experts, first_rank, local_ranks,
        SLOTS=ranks * epn, SLOTS_BLOCK=triton.next_power_of_2(ranks * epn), EPN=epn, BLOCK=block,
        num_warps=8,
    )


def push_torch(homes: torch.Tensor, slots: torch.Tensor, slot_experts: torch.Tensor) -> None:
    """Plain-torch push on stacked pools: ``homes [R, epn, ...]`` into ``slots [R, epn, ...]`` (host loop)."""
    epn = slot_experts.shape[1]
    for receiver, slot in (slot_experts >= 0).nonzero().tolist():
        expert = int(slot_experts[receiver, slot])
        slots[receiver, slot].copy_(homes[expert // epn, expert % epn])
