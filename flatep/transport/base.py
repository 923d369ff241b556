"""The transport contract: what kernels and layers know about the ranks of a group.

Kernels reach peers only through a *peer offset table*: for a symmetric buffer, the element
offset of every rank's copy relative to the copy this process passes as the kernel's base
pointer. On the local transport (virtual ranks stacked on dim 0 of one tensor) the offsets are
multiples of the rank stride; on a one-process-per-GPU transport they are differences of the
peers' mapped addresses. The same kernel code serves both. A transport whose ranks cannot address
each other's memory (``torch.distributed`` collectives) moves rows and weights itself instead.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from flatep.kernels.backend import use_triton
from flatep.kernels.push import PoolCopy, copy_views, push_torch, push_triton


def join_process_group(process_group, transport: str):
    """``(process_group, world, rank)`` of this process in ``process_group`` (default: the world group).

    Raises ``ValueError`` naming the transport if torch.distributed is not initialised or this
    process is not a member.
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"the {transport} transport needs torch.distributed initialised (e.g. run under torchrun)")
    process_group = process_group if process_group is not None else dist.group.WORLD
    rank = dist.get_rank(process_group)
    if rank < 0:
        raise ValueError("this process is not a member of process_group")
    return process_group, dist.get_world_size(process_group), rank


# Errors a step can find only on the device; each sets its flag, which :meth:`Group.check` reads.
DEVICE_ERRORS = {
    "ids": "topk_ids held an expert id outside [0, E) for a real token (its entries were left out of the plan)",
    "plan": "a plan passed to ep_moe was not made for these topk_ids, or routes an entry outside its expert's rows",
    "step": "the ranks disagreed on a step (s, the config, the policy or the dtype), or a rank's inputs were invalid, "
            "or no rank had tokens",
}


class Group(ABC):
    """A group of EP ranks as seen from one process.

    Attributes:
        world: ranks in the group ``R``.
        device: the device this process computes on.
        local_ranks: the ranks this process drives (all ``R`` on the local transport, one rank on
            the per-process transports).
        stacked: whether tensors carry a leading rank dimension (true only on the local transport).
        eager_check: whether every eager step checks itself before returning (see
            :meth:`check`). ``True`` (default): bad ids, ranks that disagree and, on the nvlink
            transport, barrier timeouts raise from the step that met them, at the price of host
            synchronisations. ``False``: a step reads nothing back to the host (zero host
            synchronisations, as inside a CUDA graph, where steps never check themselves); errors
            found on the device set flags that the next :meth:`check` raises.
        push_on_side_stream: whether :meth:`push_experts` may run on a side CUDA stream while
            dispatch runs on the current one (its kernels then share the GPU). True where the push
            is a kernel over peer addresses; false where push and dispatch are operations of one
            communicator that every rank must issue in one order (NCCL).
        peer_addressable: whether ranks reach each other's buffers through :meth:`peer_offsets`, so
            that the dispatch and combine kernels move rows themselves (local, nvlink). False where
            the transport moves rows with its own ``dispatch`` and ``combine`` (all-to-all).
        static_splits: whether the transport's own dispatch and combine messages have fixed sizes
            (only the collective transport has the option: :class:`flatep.transport.collective.CollectiveGroup`).
    """

    world: int
    device: torch.device
    local_ranks: tuple[int, ...]
    stacked: bool
    eager_check: bool = True
    push_on_side_stream: bool = True
    peer_addressable: bool = True
    static_splits: bool = False

    def _start_checks(self, eager_check: bool) -> None:
        """Set the checking mode and allocate the device error flags (at set-up: never inside a graph)."""
        if not isinstance(eager_check, bool):
            raise ValueError(f"eager_check must be True or False, got {eager_check!r}")
        self.eager_check = eager_check
        self._errors = torch.zeros(len(DEVICE_ERRORS), dtype=torch.int32, device=self.device)

    def flag(self, error: str, condition: torch.Tensor) -> None:
        """Record on the device that ``error`` (a key of ``DEVICE_ERRORS``) happened if any of ``condition`` is true.

        Sticky until :meth:`check` reads it; no host synchronisation, so it may run inside a CUDA graph.
        """
        index = list(DEVICE_ERRORS).index(error)
        self._errors[index : index + 1].bitwise_or_(condition.any().view(1).to(device=self.device, dtype=torch.int32))

    def check(self) -> None:
        """Raise for every error recorded on the device since the last check (one host synchronisation).

        Call it after replaying a CUDA graph, or every few steps with ``eager_check=False``; with
        ``eager_check=True`` every eager step calls it before returning. The flags are cleared
        when read, so the group stays usable after bad input.

        Raises:
            ValueError: naming what went wrong (bad ids, a plan made for other ids, ranks that
                disagreed on a step).
        """
        found = self._errors.tolist()
        if any(found):
            self._errors.zero_()
            raised = [message for message, seen in zip(DEVICE_ERRORS.values(), found) if seen]
            raise ValueError(f"{type(self).__name__} rank {self.first_rank}: since the last check, " + "; ".join(raised))

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A symmetric buffer cached by ``(name, shape, dtype)``: allocated once, reused every step.

        Reuse keeps addresses fixed, which CUDA-graph replays and peer tables rely on.
        """
        cache = self.__dict__.setdefault("_buffers", {})
        key = (name, tuple(shape), dtype)
        if key not in cache:
            cache[key] = self.symmetric_empty(tuple(shape), dtype)
        return cache[key]

    def buffer_bytes(self) -> int:
        """Bytes this process holds in the group's buffer cache (what :meth:`buffer` allocated)."""
        cache = self.__dict__.get("_buffers", {})
        return sum(tensor.untyped_storage().nbytes() for tensor in cache.values())

    @property
    def first_rank(self) -> int:
        """Global rank of the first rank this process drives."""
        return self.local_ranks[0]

    @abstractmethod
    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer every rank of the group holds and every rank can address.

        Returns ``[len(local_ranks), *shape]`` on the local transport, ``shape`` otherwise.
        """

    @abstractmethod
    def peer_offsets(self, buffer: torch.Tensor) -> torch.Tensor:
        """``[R] int64`` element offset of each rank's copy of ``buffer`` relative to ``buffer``'s base.

        Raises ``ValueError`` on transports whose ranks cannot address each other's memory.
        """

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has reached this point (stream-ordered on the GPU)."""

    def push_experts(
        self, home: torch.Tensor, slots: torch.Tensor, slot_experts: torch.Tensor, backend: str = "auto",
        programs: int | None = None,
    ) -> None:
        """Copy every expert lent by this process's ranks into its receivers' slots (one projection).

        Args:
            home: this process's home pool of one projection, ``[n, epn, *expert_shape]`` when
                stacked, else ``[epn, *expert_shape]``; contiguous, from :meth:`symmetric_empty`.
            slots: the borrow slots of that projection, shaped like ``home`` (also symmetric).
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
            programs: cap on the push kernel's programs (``None``: its default, 4 per SM).
        """
        self.push_pools([(home, slots)], slot_experts, backend, programs)

    def push_pools(
        self, pools: list[tuple[torch.Tensor, torch.Tensor]], slot_experts: torch.Tensor, backend: str = "auto",
        programs: int | None = None,
    ) -> None:
        """:meth:`push_experts` for every ``(home, slots)`` pair of a layer (values, scales, biases),
        one step's slot table for all.

        The default moves weights through the peer offset tables: one launch of the push kernel
        for all pools (:func:`flatep.kernels.push.push_triton`), or the torch copies on the local
        transport. Transports without addressable peers override it.
        """
        if not pools:
            return
        if use_triton(pools[0][0].device, backend):
            copies = []
            for home, slots in (copy_views(*pair) for pair in pools):
                numel = home[0, 0].numel() if self.stacked else home[0].numel()
                copies.append(PoolCopy(home, self.peer_offsets(home), slots, self.peer_offsets(slots), numel))
            push_triton(copies, slot_experts, self.first_rank, len(self.local_ranks), programs)
        elif self.stacked:
            for home, slots in pools:
                push_torch(home, slots, slot_experts)
        else:
            raise ValueError("the torch push path needs the local transport (stacked pools)")

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[R, *shape]``: every rank's ``tensor`` (on the local transport ``tensor`` already is that)."""

    @property
    def process_group(self):
        """The ``torch.distributed`` process group of a per-process group.

        Raises:
            ValueError: on the local transport (it has none), or once the group is closed.
        """
        group = self.__dict__.get("_process_group")
        if group is None:
            raise ValueError(f"{type(self).__name__} has no process group (the local transport) or is closed")
        return group

    def close(self) -> None:
        """Free the group's buffers and let go of its process group; a closed group is not used again.

        Letting go matters: a reference kept past ``torch.distributed.destroy_process_group()``
        keeps gloo's worker threads alive until the interpreter exits, where they can abort the
        process (``std::terminate``).
        """
        self.__dict__.pop("_buffers", None)
        self.__dict__.pop("_process_group", None)
