"""The transport contract: what kernels and layers know about the ranks of a group.

Kernels reach peers only through a *peer offset table*: for a symmetric buffer, the element
offset of every rank's copy relative to the copy this process passes as the kernel's base
pointer. On the local transport (virtual ranks stacked on dim 0 of one tensor) the offsets are
multiples of the rank stride; on a one-process-per-GPU transport they are differences of the
peers' mapped addresses. The same kernel code serves both.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch


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
        """``[R] int64`` element offset of each rank's copy of ``buffer`` relative to ``buffer``'s base."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has reached this point (stream-ordered on the GPU)."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[R, *shape]``: every rank's ``tensor`` (on the local transport ``tensor`` already is that)."""

    def close(self) -> None:
        """Free the group's buffers."""
        self.__dict__.pop("_buffers", None)
