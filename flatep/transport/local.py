"""Virtual ranks: R ranks stacked on dim 0 of one tensor, in one process, on CPU or one GPU."""
from __future__ import annotations

import operator

import torch

from flatep.transport.base import Group


class LocalGroup(Group):
    """All ``R`` ranks in this process; rank ``r``'s buffer is ``buffer[r]``.

    A barrier is stream order: every kernel launch covers all virtual ranks, so a launch that
    follows another sees all of its writes.
    """

    stacked = True

    def __init__(self, ranks: int, device: torch.device | str = "cpu", eager_check: bool = True) -> None:
        try:  # numpy integers too
            count = -1 if isinstance(ranks, bool) else operator.index(ranks)
        except TypeError:
            count = -1
        if count < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        self.world = count
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.local_ranks = tuple(range(count))
        self._peer_tables: dict[tuple[torch.device, int], torch.Tensor] = {}
        self._start_checks(eager_check)

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((self.world, *shape), dtype=dtype, device=self.device)

    def peer_offsets(self, buffer: torch.Tensor) -> torch.Tensor:
        if buffer.shape[0] != self.world:
            raise ValueError(f"buffer must have a leading rank dimension of {self.world}, got {list(buffer.shape)}")
        # Cached per stride: making the table is two small launches, and every dispatch, combine
        # and push asks for several (on the H200 they were a visible part of a decode step's phases).
        key = (buffer.device, buffer.stride(0))
        table = self._peer_tables.get(key)
        if table is None:
            table = torch.arange(self.world, device=buffer.device, dtype=torch.int64) * buffer.stride(0)
            # A table made while a CUDA graph is captured lives in that graph's memory pool: not kept.
            if not (buffer.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._peer_tables[key] = table
        return table

    def barrier(self) -> None:
        """Nothing to do: kernels of all virtual ranks are ordered on one stream."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __repr__(self) -> str:
        return f"LocalGroup(ranks={self.world}, device={self.device}, eager_check={self.eager_check})"
