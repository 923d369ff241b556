"""Expert weight pools: each rank's home experts followed by its borrow slots.

Per projection a pool is a symmetric buffer whose per-rank part is ``[2*epn, ...]``: rows
``[0, epn)`` hold the rank's own experts, rows ``[epn, 2*epn)`` the experts it borrows for the
current step. That per-rank part is exactly the compute view that ``torch._grouped_mm`` takes with
``offs = offsets``, so the experts run as one grouped GEMM per projection with no copy.
"""
from __future__ import annotations

import torch

from flatep.config import EPConfig
from flatep.kernels.backend import use_triton
from flatep.kernels.push import push_torch, push_triton
from flatep.transport.base import Group


class ExpertPool:
    """Weights of one MoE layer laid out for expert parallelism.

    Attributes:
        w13: pool of the fused gate/up projection, ``[n, 2*epn, 2I, H]`` on the local transport
            (``n`` = ranks this process drives), ``[2*epn, 2I, H]`` otherwise.
        w2: pool of the down projection, ``[n, 2*epn, H, I]`` (or ``[2*epn, H, I]``).
    """

    def __init__(self, config: EPConfig, group: Group, dtype: torch.dtype) -> None:
        self.config = config
        self.group = group
        epn, hidden, intermediate = config.experts_per_rank, config.hidden, config.intermediate
        self.w13 = group.symmetric_empty((2 * epn, 2 * intermediate, hidden), dtype)
        self.w2 = group.symmetric_empty((2 * epn, hidden, intermediate), dtype)
        self._peers = {name: group.peer_offsets(getattr(self, name)) for name in ("w13", "w2")}

    @classmethod
    def from_weights(cls, w13: torch.Tensor, w2: torch.Tensor, config: EPConfig, group: Group) -> "ExpertPool":
        """Build a pool from all ``E`` experts' weights, keeping each rank's own slice.

        Args:
            w13: ``[E, 2I, H]`` gate rows then up rows (vLLM layout).
            w2: ``[E, H, I]``.
        """
        check_expert_weights(w13, w2, config)
        pool = cls(config, group, w13.dtype)
        pool.load(w13, w2)
        return pool

    def home(self, name: str) -> torch.Tensor:
        """Home experts of the ranks this process drives: ``[n, epn, ...]`` (or ``[epn, ...]``)."""
        epn = self.config.experts_per_rank
        pool = getattr(self, name)
        return pool[:, :epn] if self.group.stacked else pool[:epn]

    def load(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Copy the slices of ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` homed on this process's ranks."""
        epn = self.config.experts_per_rank
        first = self.group.first_rank * epn
        count = len(self.group.local_ranks) * epn
        for name, weights in (("w13", w13), ("w2", w2)):
            mine = weights[first : first + count].to(self.home(name).device)
            self.home(name).copy_(mine.view(self.home(name).shape))

    def push(self, slot_experts: torch.Tensor, backend: str = "auto") -> None:
        """Copy every borrowed expert of this step from its owner into the receiver's slot.

        Args:
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
        """
        for name in ("w13", "w2"):
            pool = getattr(self, name)
            if use_triton(pool.device, backend):
                numel = pool[0, 0].numel() if self.group.stacked else pool[0].numel()
                push_triton(pool, self._peers[name], slot_experts, self.group.first_rank, len(self.group.local_ranks), numel)
            else:
                if not self.group.stacked:
                    raise ValueError("the torch push path needs the local transport (stacked pools)")
                push_torch(pool, slot_experts)

    def compute_view(self, local_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [2*epn, 2I, H], w2 [2*epn, H, I])`` of one rank this process drives."""
        if self.group.stacked:
            return self.w13[local_index], self.w2[local_index]
        return self.w13, self.w2


def check_expert_weights(w13: torch.Tensor, w2: torch.Tensor, config: EPConfig) -> None:
    """Raise ``ValueError`` unless ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` match ``config``."""
    experts, hidden, intermediate = config.experts, config.hidden, config.intermediate
    if tuple(w13.shape) != (experts, 2 * intermediate, hidden):
        raise ValueError(f"w13 must have shape [E, 2I, H] = {[experts, 2 * intermediate, hidden]}, got {list(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise ValueError(f"w2 must have shape [E, H, I] = {[experts, hidden, intermediate]}, got {list(w2.shape)}")
    if w13.dtype != w2.dtype or w13.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w13 and w2 must both be bfloat16 or float32, got {w13.dtype} and {w2.dtype}")
