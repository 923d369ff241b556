"""One process per GPU: symmetric buffers mapped on every rank over NVLink or PCIe P2P, no multicast.

Memory comes from PyTorch symmetric memory with its CUDA backend rather than from CUDA VMM driven
through cuda-python. Both end in the same driver calls (``cuMemCreate``, a POSIX-fd export, import
and ``cuMemMap`` of every peer's allocation), but PyTorch already does that dance, exchanges the fds
through the process group's store (so a gloo group works as well as NCCL), supports several ranks
on one GPU (``TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1``) and adds no dependency. FlatEP uses only
the mapping: the peers' addresses (``handle.buffer_ptrs``) become the peer offset table of its own
kernels, and the barrier is its own kernel (:mod:`flatep.transport.barrier`), because PyTorch's
traps the whole CUDA context on a timeout instead of naming the ranks that did not arrive.
Multicast is switched off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``) and nothing here ever uses it.

Every symmetric allocation is collective. Before it, ranks compare the shape and dtype they ask
for through the process group and raise on every rank if they differ (a mismatched rendezvous
could hang or map buffers of different sizes).
"""
from __future__ import annotations

import atexit
import os
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from flatep.plan.types import RankPlan
from flatep.transport.barrier import cross_rank_barrier
from flatep.transport.base import Group, join_process_group


@triton.jit
def _scatter_to_peers_kernel(src_ptr, dst_ptr, dst_peers_ptr, rank, numel, RANKS: tl.constexpr, BLOCK: tl.constexpr):
    offset = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offset < numel
    values = tl.load(src_ptr + offset, mask=mask)
    for peer in range(RANKS):
        target = dst_ptr + tl.load(dst_peers_ptr + peer) + rank * numel
        tl.store(target + offset, values, mask=mask)


def scatter_to_peers(src: torch.Tensor, dst: torch.Tensor, dst_peers: torch.Tensor, rank: int) -> None:
    """Write ``src`` into row ``rank`` of every rank's copy of ``dst`` (the send half of an all-gather).

    Args:
        src: ``[*shape]`` contiguous.
        dst: this process's copy of a symmetric ``[R, *shape]`` buffer of ``src``'s dtype.
        dst_peers: ``[R] int64`` element offsets of every rank's ``dst`` from this one.
        rank: this process's rank (the row written).
    """
    numel = src.numel()
    block = 1024
    _scatter_to_peers_kernel[(triton.cdiv(numel, block),)](
        src, dst, dst_peers, rank, numel, RANKS=dst.shape[0], BLOCK=block,
    )


@triton.jit
def _add_slot_gradients_kernel(total_ptr, staged_ptr, staged_peers_ptr, table_ptr, numel,
                               RANKS: tl.constexpr, EPN: tl.constexpr, BLOCK: tl.constexpr):
    expert = tl.program_id(0)
    offset = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offset < numel
    target = total_ptr + expert.to(tl.int64) * numel + offset
    acc = tl.load(target, mask=mask)
    for receiver in range(RANKS):  # ascending: the order every transport adds them in
        slot = tl.load(table_ptr + receiver * (EPN + 1) + expert)
        if slot >= 0:
            source = staged_ptr + tl.load(staged_peers_ptr + receiver) + slot.to(tl.int64) * numel
            acc += tl.load(source + offset, mask=mask)
    tl.store(target, acc, mask=mask)


def add_slot_gradients_triton(
    total: torch.Tensor, staged: torch.Tensor, staged_peers: torch.Tensor, slot_experts: torch.Tensor, rank: int
) -> None:
    """Add to ``total`` the gradients that the receivers of this rank's experts computed in their slots.

    For each home expert ``j`` of ``rank``, receivers in ascending rank: ``total[j] += staged[slot]``
    of every receiver that borrowed it (into slot ``slot``), read from the receiver's copy of
    ``staged`` over P2P. Nothing is read on the host.

    Args:
        total: ``[epn, *shape]`` fp32 contiguous: this rank's home gradients, added to in place.
        staged: this process's copy of a symmetric ``[epn, *shape]`` fp32 buffer holding every rank's
            slot gradients (each rank its own).
        staged_peers: ``[R] int64`` element offsets of every rank's ``staged`` from this one.
        slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
        rank: this process's rank.
    """
    ranks, epn = slot_experts.shape
    # table[r, j]: the slot of receiver r that holds home expert j of this rank, -1 if none. A
    # receiver borrows an expert into one slot at most, so each real entry is written once; every
    # other slot writes the extra last column, which is never read.
    local = slot_experts.long() - rank * epn
    mine = (local >= 0) & (local < epn)
    table = torch.full((ranks, epn + 1), -1, dtype=torch.int32, device=total.device)
    slots = torch.arange(epn, dtype=torch.int32, device=total.device).expand(ranks, epn)
    table.scatter_(1, torch.where(mine, local, epn), slots)
    numel = total[0].numel()
    block = 1024
    _add_slot_gradients_kernel[(epn, triton.cdiv(numel, block))](
        total, staged, staged_peers, table, numel, RANKS=ranks, EPN=epn, BLOCK=block,
    )


@dataclass
class _Allocation:
    """One symmetric allocation: the handle that keeps the peers mapped, and where they are."""

    handle: object
    peer_pointers: list[int]  # byte address, in this process, of every rank's copy of the tensor
    nbytes: int


class NVLinkGroup(Group):
    """One EP rank per process, each on a GPU; peers reached by plain loads and stores over P2P.

    Buffers from :meth:`symmetric_empty` exist on every rank at mapped addresses, so the dispatch,
    combine and push kernels of the local transport run unchanged, each process launching them
    for its own rank. :meth:`barrier` is the cross-rank flag kernel; it never waits for the host: a
    rank that does not arrive within ``barrier_timeout`` seconds is recorded on the device, and
    :meth:`check` raises :class:`TimeoutError` naming it (each eager step checks before returning
    when ``eager_check`` is on; after CUDA-graph replays, call :meth:`check`).

    Args:
        process_group: the EP ranks (default: the whole world). Only allocation, set-up and
            :meth:`close` talk through it; every per-step exchange goes through symmetric memory.
        device: this process's GPU (default: the current CUDA device); made the current device,
            because Triton launches there.
        barrier_timeout: seconds a barrier waits for the other ranks before giving up.
        eager_check: see :attr:`Group.eager_check`. With ``False``, a timeout surfaces at the next
            :meth:`check`, and until then later kernels run on whatever the late ranks had not yet
            written.
    """

    stacked = False

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        barrier_timeout: float = 60.0,
        eager_check: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise ValueError("the nvlink transport needs CUDA GPUs")
        if not barrier_timeout > 0:
            raise ValueError(f"barrier_timeout must be a positive number of seconds, got {barrier_timeout!r}")
        self._process_group, self.world, self.rank = join_process_group(process_group, "nvlink")
        self.local_ranks = (self.rank,)
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"device must be a CUDA device for the nvlink transport, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.barrier_timeout = float(barrier_timeout)
        self._start_checks(eager_check)
        self._allocations: dict[int, _Allocation] = {}
        self._peer_tables: dict[tuple[int, int], torch.Tensor] = {}
        self._closed = False
        _use_symmetric_memory_without_multicast(self.device)
        self._flags = self.symmetric_empty((2, self.world), torch.int32)
        self._flags.zero_()
        self._state = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._missing = torch.zeros(self.world, dtype=torch.int32, device=self.device)
        self.peer_offsets(self._flags)  # built now, so a barrier first seen inside graph capture copies nothing
        torch.cuda.synchronize(self.device)
        # No rank may set a flag in a peer's table before that peer has zeroed it.
        dist.barrier(group=self.process_group)
        atexit.register(self.close)

    # -- memory -----------------------------------------------------------------------------

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """``shape`` on this GPU, mapped on every rank; collective (every rank must ask alike).

        Raises:
            ValueError: on every rank, if the ranks ask for different shapes or dtypes.
        """
        from torch.distributed import _symmetric_memory as symm_mem

        self._check_open()
        shape = tuple(int(size) for size in shape)
        requests = self._gather_object((shape, str(dtype)))
        if any(request != requests[0] for request in requests):
            raise ValueError(f"ranks asked for different symmetric buffers (shape, dtype) by rank: {requests}")
        tensor = symm_mem.empty(shape, dtype=dtype, device=self.device)
        handle = symm_mem.rendezvous(tensor, self.process_group)
        bases = [int(pointer) for pointer in handle.buffer_ptrs]
        # buffer_ptrs may be allocation bases rather than tensor addresses (PyTorch's symmetric
        # memory pool places tensors inside larger allocations): every rank reports its own
        # tensor's offset inside its allocation, and peers' tensors sit at base + that offset.
        within = self._gather_object(tensor.data_ptr() - bases[self.rank])
        pointers = [base + offset for base, offset in zip(bases, within)]
        if pointers[self.rank] != tensor.data_ptr():
            raise RuntimeError("symmetric memory reported an address table that does not contain this tensor")
        self._allocations[tensor.data_ptr()] = _Allocation(handle, pointers, tensor.untyped_storage().nbytes())
        # Forget the mapping with the tensor: its address may be reused by a later allocation.
        weakref.finalize(tensor, self._forget, tensor.data_ptr())
        return tensor

    def _forget(self, pointer: int) -> None:
        self._allocations.pop(pointer, None)
        for key in [key for key in self._peer_tables if key[0] == pointer]:
            del self._peer_tables[key]

    def peer_offsets(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[R] int64`` element offsets of every rank's copy of ``buffer`` (cached per allocation).

        ``buffer`` may be a view inside a symmetric allocation: every rank's copy lies at the same
        offset inside its own allocation, so the differences of the allocations' addresses apply.
        """
        self._check_open()
        pointer = buffer.data_ptr()
        for base, allocation in self._allocations.items():
            if base <= pointer < base + max(allocation.nbytes, 1):
                break
        else:
            raise ValueError("buffer is not inside a symmetric buffer of this group (allocate it with symmetric_empty)")
        element = buffer.element_size()
        key = (base, element)
        if key not in self._peer_tables:
            distances = [peer - base for peer in allocation.peer_pointers]
            if any(distance % element for distance in distances):
                raise RuntimeError(f"peer copies are not {element}-byte aligned relative to this one: {distances}")
            self._peer_tables[key] = torch.tensor(
                [distance // element for distance in distances], dtype=torch.int64, device=self.device
            )
        return self._peer_tables[key]

    # -- synchronisation -----------------------------------------------------------------------

    def barrier(self) -> None:
        """Cross-rank barrier on the current stream, asynchronous: a timeout is recorded for :meth:`check`."""
        self._check_open()
        cross_rank_barrier(
            self._flags, self.peer_offsets(self._flags), self._state, self._missing, self.rank, self.barrier_timeout
        )

    def check(self) -> None:
        """Wait for the GPU; raise if any barrier so far timed out, then as :meth:`Group.check`.

        Raises:
            TimeoutError: naming the ranks that did not arrive. The group is unusable afterwards
                (the ranks' barrier counters no longer agree): close it.
            ValueError: for the errors of :meth:`Group.check`.
        """
        self._check_open()
        missing = [rank for rank, absent in enumerate(self._missing.tolist()) if absent]
        if missing:
            raise TimeoutError(
                f"rank {self.rank}: a barrier timed out after {self.barrier_timeout:g} s; "
                f"rank(s) {missing} did not arrive (stopped, crashed or running a different step)"
            )
        super().check()

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[R, *shape]`` of every rank's ``tensor``, through a symmetric buffer (two barriers)."""
        tensor = tensor.contiguous()
        gathered = self.buffer("all_gather", (self.world, *tensor.shape), tensor.dtype)
        self.barrier()  # every peer has copied out the previous gather from this buffer
        scatter_to_peers(tensor, gathered, self.peer_offsets(gathered), self.rank)
        self.barrier()  # every peer's row has landed here
        return gathered.clone()

    # -- backward (flatep.backward): the collective transport's primitives over peer stores ---------

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, plan: RankPlan, shard: torch.Tensor,
                 shard_weights: torch.Tensor, links: torch.Tensor) -> None:
        """Send every token's rows and route weights to their rows of the destinations' shards (collective).

        :func:`flatep.exchange.dispatch_rows` into symmetric staging buffers, then copied into
        ``shard``, ``shard_weights`` and ``links``: autograd keeps those until the backward, while
        the staging buffers serve the next call.

        Args:
            x: ``[s, H]`` this rank's tokens; topk_weights: ``[s, K]`` fp32; plan: this rank's plan.
            shard: ``[shard_rows, H]`` in ``x``'s dtype; shard_weights: ``[shard_rows]`` fp32;
                links: ``[shard_rows, 2]`` int32 (written: real rows; padding rows hold whatever
                the staging buffers held).
        """
        from flatep.exchange import dispatch_rows  # flatep.exchange imports the transports

        rows = self.buffer("backward_rows", tuple(shard.shape), x.dtype)
        weights = self.buffer("backward_route_weights", tuple(shard_weights.shape), torch.float32)
        staged_links = self.buffer("backward_links", tuple(links.shape), torch.int32)
        self.barrier()  # every peer has copied out what the buffers held before
        dispatch_rows(x, topk_weights, plan, self, rows, weights, staged_links)
        shard.copy_(rows)
        shard_weights.copy_(weights)
        links.copy_(staged_links)

    def combine(self, shard: torch.Tensor, plan: RankPlan, links: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Sum every token's K rows from the ranks' ``shard``s (:func:`flatep.exchange.combine_rows`; collective).

        Args:
            shard: ``[shard_rows, H]`` this rank's rows (any tensor: staged in a symmetric buffer).
            plan: this rank's plan; links: ``[shard_rows, 2]`` int32 from :meth:`dispatch`;
            out_dtype: dtype of the result.

        Returns:
            ``[s, H]`` in ``out_dtype``; padded tokens get zeros.
        """
        from flatep.exchange import combine_rows

        tokens, top_k = plan.dest_rank.shape
        rows = self.buffer("backward_rows", tuple(shard.shape), shard.dtype)
        sums = self.buffer("backward_sums", tuple(shard.shape), shard.dtype)
        staged_links = self.buffer("backward_links", tuple(links.shape), torch.int32)
        self.barrier()  # every peer has finished reading the buffers' previous contents
        rows.copy_(shard)
        staged_links.copy_(links)
        out = combine_rows(rows, plan, self, staged_links, tokens, top_k, out_dtype, sums=sums)
        return out.view(tokens, -1)

    def gather_entries(self, values: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        """Each shard row's ``values`` returned to the entry dispatched to it, unsummed (collective).

        Args:
            values: ``[shard_rows, C]`` per row of this rank's shard (small: route-weight gradients).
            plan: this rank's plan.

        Returns:
            ``[s, K, C]``: entry ``(t, k)`` gets its row's values; padded entries zeros.
        """
        every = self.all_gather(values)  # [R, shard_rows, C]
        dest_rank, dest_row = plan.dest_rank.long(), plan.dest_row.long()
        picked = every[dest_rank.clamp_min(0), dest_row.clamp_min(0)]
        return torch.where((dest_rank >= 0).unsqueeze(-1), picked, 0)

    def push_copies(self, home: torch.Tensor, slot_experts: torch.Tensor) -> torch.Tensor:
        """This rank's slots filled from their owners' ``home`` experts (one projection; collective).

        :meth:`push_experts` for tensors that are not symmetric (the weights autograd differentiates):
        ``home`` is staged in a symmetric buffer, pushed by the push kernel, and the slots copied out.

        Args:
            home: ``[epn, *expert_shape]`` this rank's home experts.
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).

        Returns:
            ``[epn, *expert_shape]`` in ``home``'s dtype; empty slots are zeros.
        """
        staged = self.buffer("backward_home", tuple(home.shape), home.dtype)
        slots = self.buffer("backward_slots", tuple(home.shape), home.dtype)
        self.barrier()  # every peer has copied out the previous push
        staged.copy_(home)
        slots.zero_()
        self.barrier()  # every owner's experts are staged, every receiver's slots cleared
        self.push_experts(staged, slots, slot_experts)
        self.barrier()  # every push has landed
        return slots.clone()

    def add_slot_gradients(self, total: torch.Tensor, slot_grads: torch.Tensor, slot_experts: torch.Tensor) -> None:
        """Return every receiver's borrowed-expert gradients to their owners (collective).

        Each rank stages its ``slot_grads``; each owner adds the ones of its experts to ``total``
        on the device, receivers in ascending rank (:func:`add_slot_gradients_triton`): the
        collective transport's :meth:`return_slot_gradients` order, without reading the plan on the host.

        Args:
            total: ``[epn, *shape]`` fp32 contiguous, this rank's home gradients (added to in place).
            slot_grads: ``[epn, *shape]`` fp32, this rank's gradient for each of its slots.
            slot_experts: ``[R, epn]`` int32 from the plan.
        """
        staged = self.buffer("slot_gradients", tuple(slot_grads.shape), torch.float32)
        self.barrier()  # every owner has finished reading the previous gradients
        staged.copy_(slot_grads)
        self.barrier()  # every receiver's gradients are in place
        add_slot_gradients_triton(total, staged, self.peer_offsets(staged), slot_experts, self.rank)

    # -- control plane -------------------------------------------------------------------------

    def _gather_object(self, value: object) -> list[object]:
        gathered: list[object] = [None] * self.world
        dist.all_gather_object(gathered, value, group=self.process_group)
        return gathered

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("this NVLinkGroup is closed")

    def close(self) -> None:
        """Wait for this GPU, then drop every buffer and mapping this group made (also run at exit).

        Memory still referenced elsewhere (e.g. an :class:`ExpertPool`'s tensors) is freed when
        those references go; peers that mapped it keep their mapping until they close.
        """
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        torch.cuda.synchronize(self.device)
        super().close()
        self._peer_tables.clear()
        self._allocations.clear()
        del self._flags, self._state, self._missing, self._errors

    def __repr__(self) -> str:
        return f"NVLinkGroup(rank={self.rank}, world={self.world}, device={self.device})"


def _use_symmetric_memory_without_multicast(device: torch.device) -> None:
    """Select PyTorch symmetric memory's CUDA backend with multicast off, before the first allocation."""
    from torch.distributed import _symmetric_memory as symm_mem

    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    if not hasattr(symm_mem, "set_backend"):
        return  # older PyTorch: the CUDA backend is the only one
    current = symm_mem.get_backend(device) if hasattr(symm_mem, "get_backend") else None
    if current != "CUDA":
        try:
            symm_mem.set_backend("CUDA")
        except RuntimeError as error:
            raise RuntimeError(
                f"FlatEP needs PyTorch symmetric memory's CUDA backend, but {symm_mem.get_backend(device)!r} is already "
                "in use in this process"
            ) from error
