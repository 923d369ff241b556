"""Expert weight pools: each rank's home experts followed by its borrow slots.

Per projection a pool is a symmetric buffer whose per-rank part is ``[2*epn, ...]``: rows
``[0, epn)`` hold the rank's own experts, rows ``[epn, 2*epn)`` the experts it borrows for the
current step. That per-rank part is exactly the compute view that ``torch._grouped_mm`` takes with
``offs = offsets``, so the experts run as one grouped GEMM per projection with no copy.
"""
from __future__ import annotations

import torch

from flatep.config import EPConfig
from flatep.transport.base import Group


class ExpertPool:
    """Weights of one MoE layer laid out for expert parallelism.

    Attributes:
        w13: pool of the fused gate/up projection, ``[n, 2*epn, 2I, H]`` on the local transport
            (``n`` = ranks this process drives), ``[2*epn, 2I, H]`` otherwise.
        w2: pool of the down projection, ``[n, 2*epn, H, I]`` (or ``[2*epn, H, I]``).
        b13, b2: with ``biases=True``, pools of the gate/up bias ``[n, 2*epn, 2I]`` and the down
            bias ``[n, 2*epn, H]`` (same layout, pushed with the weights); otherwise None.
        names: the pool tensors that exist (``w13``, ``w2``, then ``b13``, ``b2`` with biases).
    """

    def __init__(self, config: EPConfig, group: Group, dtype: torch.dtype, biases: bool = False) -> None:
        self.config = config
        self.group = group
        epn, hidden, intermediate = config.experts_per_rank, config.hidden, config.intermediate
        self.w13 = group.symmetric_empty((2 * epn, 2 * intermediate, hidden), dtype)
        self.w2 = group.symmetric_empty((2 * epn, hidden, intermediate), dtype)
        self.b13 = group.symmetric_empty((2 * epn, 2 * intermediate), dtype) if biases else None
        self.b2 = group.symmetric_empty((2 * epn, hidden), dtype) if biases else None
        self.names: tuple[str, ...] = ("w13", "w2", "b13", "b2") if biases else ("w13", "w2")

    @classmethod
    def from_weights(
        cls,
        w13: torch.Tensor,
        w2: torch.Tensor,
        config: EPConfig,
        group: Group,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
    ) -> "ExpertPool":
        """Build a pool from all ``E`` experts' weights, keeping each rank's own slice.

        Args:
            w13: ``[E, 2I, H]`` gate rows then up rows (vLLM layout).
            w2: ``[E, H, I]``.
            b13, b2: optional biases ``[E, 2I]`` and ``[E, H]`` (both or neither).
        """
        check_expert_weights(w13, w2, config, b13, b2)
        pool = cls(config, group, w13.dtype, biases=b13 is not None)
        pool.load(w13, w2, b13, b2)
        return pool

    def home(self, name: str) -> torch.Tensor:
        """Home experts of the ranks this process drives: ``[n, epn, ...]`` (or ``[epn, ...]``)."""
        epn = self.config.experts_per_rank
        pool = getattr(self, name)
        return pool[:, :epn] if self.group.stacked else pool[:epn]

    def load(
        self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
    ) -> None:
        """Copy the slices of ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (and of the biases ``b13 [E, 2I]``,
        ``b2 [E, H]`` when the pool has them) homed on this process's ranks."""
        if (b13 is not None) != (self.b13 is not None) or (b2 is not None) != (self.b2 is not None):
            raise ValueError(f"this pool holds {self.names}: pass b13 and b2 exactly when it has bias pools")
        epn = self.config.experts_per_rank
        first = self.group.first_rank * epn
        count = len(self.group.local_ranks) * epn
        self.load_home(*(None if weights is None else weights[first : first + count] for weights in (w13, w2, b13, b2)))

    def load_home(
        self, w13: torch.Tensor, w2: torch.Tensor, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
    ) -> None:
        """Copy the experts homed on this process's ranks only: ``w13 [n*epn, 2I, H]``, ``w2 [n*epn, H, I]``
        (``n`` = ranks this process drives; rank ``r``'s experts are ``[r*epn, (r+1)*epn)``), and biases alike."""
        for name, weights in zip(self.names, (w13, w2, b13, b2)):
            home = self.home(name)
            if weights is None or weights.numel() != home.numel():
                raise ValueError(f"{name} must hold the {home.shape[-3] * (home.shape[0] if self.group.stacked else 1)} "
                                 f"experts homed on this process, shape {[*home.shape]}, got "
                                 f"{None if weights is None else list(weights.shape)}")
            home.copy_(weights.to(home.device).reshape(home.shape))

    def push(self, slot_experts: torch.Tensor, backend: str = "auto") -> None:
        """Copy every borrowed expert of this step from its owner into the receiver's slot.

        How the weights travel is the transport's business (:meth:`Group.push_experts`): the push
        kernel over peer addresses, or point-to-point messages on the collective transport.

        Args:
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
        """
        for name in self.names:
            self.group.push_experts(getattr(self, name), slot_experts, backend)

    def compute_view(self, local_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [2*epn, 2I, H], w2 [2*epn, H, I])`` of one rank this process drives."""
        if self.group.stacked:
            return self.w13[local_index], self.w2[local_index]
        return self.w13, self.w2

    def bias_view(self, local_index: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(b13 [2*epn, 2I], b2 [2*epn, H])`` of one rank this process drives, or ``(None, None)``."""
        if self.b13 is None or self.b2 is None:
            return None, None
        if self.group.stacked:
            return self.b13[local_index], self.b2[local_index]
        return self.b13, self.b2


def check_expert_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    config: EPConfig,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> None:
    """Raise ``ValueError`` unless ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (and the optional biases
    ``b13 [E, 2I]``, ``b2 [E, H]``, both or neither, in the weights' dtype) match ``config``."""
    experts, hidden, intermediate = config.experts, config.hidden, config.intermediate
    if tuple(w13.shape) != (experts, 2 * intermediate, hidden):
        raise ValueError(f"w13 must have shape [E, 2I, H] = {[experts, 2 * intermediate, hidden]}, got {list(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise ValueError(f"w2 must have shape [E, H, I] = {[experts, hidden, intermediate]}, got {list(w2.shape)}")
    if w13.dtype != w2.dtype or w13.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"w13 and w2 must both be bfloat16 or float32, got {w13.dtype} and {w2.dtype}")
    if (b13 is None) != (b2 is None):
        raise ValueError("pass both expert biases b13 and b2, or neither")
    if b13 is not None and b2 is not None:
        if tuple(b13.shape) != (experts, 2 * intermediate):
            raise ValueError(f"b13 must have shape [E, 2I] = {[experts, 2 * intermediate]}, got {list(b13.shape)}")
        if tuple(b2.shape) != (experts, hidden):
            raise ValueError(f"b2 must have shape [E, H] = {[experts, hidden]}, got {list(b2.shape)}")
        if b13.dtype != w13.dtype or b2.dtype != w13.dtype:
            raise ValueError(f"b13 and b2 must have the weights' dtype {w13.dtype}, got {b13.dtype} and {b2.dtype}")
