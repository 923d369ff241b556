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
from flatep.kernels.push import push_torch, push_triton


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


class Group(ABC):
    """A group of EP ranks as seen from one process.

    Attributes:
        world: ranks in the group ``R``.
        device: the device this process computes on.
        local_ranks: the ranks this process drives (all ``R`` on the local transport, one rank on
            the per-process transports).
        stacked: whether tensors carry a leading rank dimension (true only on the local transport).
    """

    world: int
    device: torch.device
    local_ranks: tuple[int, ...]
    stacked: bool

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A symmetric buffer cached by ``(name, shape, dtype)``: allocated once, reused every step.

        Reuse keeps addresses fixed, which CUDA-graph replays and peer tables rely on.
        """
        cache = self.__dict__.setdefault("_buffers", {})
        key = (name, tuple(shape), dtype)
        if key not in cache:
            cache[key] = self.symmetric_empty(tuple(shape), dtype)
        return cache[key]

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

    def check(self) -> None:
        """Raise if an earlier barrier failed (e.g. after replaying a CUDA graph that holds barriers).

        Transports whose barriers cannot fail have nothing to check.
        """

    def push_experts(self, home: torch.Tensor, slots: torch.Tensor, slot_experts: torch.Tensor, backend: str = "auto") -> None:
        """Copy every expert lent by this process's ranks into its receivers' slots (one projection).

        The default moves weights through the peer offset tables (the push kernel); transports
        without addressable peers override it.

        Args:
            home: this process's home pool of one projection, ``[n, epn, *expert_shape]`` when
                stacked, else ``[epn, *expert_shape]``; contiguous, from :meth:`symmetric_empty`.
            slots: the borrow slots of that projection, shaped like ``home`` (also symmetric).
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
        """
        numel = home[0, 0].numel() if self.stacked else home[0].numel()
        if use_triton(home.device, backend):
            push_triton(home, self.peer_offsets(home), slots, self.peer_offsets(slots), slot_experts,
                        self.first_rank, len(self.local_ranks), numel)
        elif self.stacked:
            push_torch(home, slots, slot_experts)
        else:
            raise ValueError("the torch push path needs the local transport (stacked pools)")

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[R, *shape]``: every rank's ``tensor`` (on the local transport ``tensor`` already is that)."""

    def close(self) -> None:
        """Free the group's buffers."""
        self.__dict__.pop("_buffers", None)
