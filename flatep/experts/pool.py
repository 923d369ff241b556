"""Expert weight pools: each layer's home experts, and one set of borrow slots per process.

Per projection a layer's pool is a symmetric buffer whose per-rank part ``[epn, ...]`` holds the
rank's own experts. The experts a rank borrows for a step go into *slots*: a symmetric buffer
``[epn, ...]`` per projection that every layer of the same shape and dtype shares (it lives in the
group's buffer cache), because a rank computes one layer at a time. Memory per rank is therefore
``epn`` experts per layer plus one layer's worth of slots, not ``2*epn`` per layer.

Home experts and slots are separate tensors, so a rank's experts run as two grouped GEMMs
(``torch._grouped_mm`` with ``offs``), one per tensor, over the two parts of the split shard
layout (:mod:`flatep.plan.split`).
"""
from __future__ import annotations

import torch

from flatep.config import EPConfig
from flatep.transport.base import Group


class ExpertPool:
    """Weights of one MoE layer laid out for expert parallelism.

    Attributes:
        w13: home experts of the fused gate/up projection, ``[n, epn, 2I, H]`` on the local
            transport (``n`` = ranks this process drives), ``[epn, 2I, H]`` otherwise.
        w2: home experts of the down projection, ``[n, epn, H, I]`` (or ``[epn, H, I]``).
        b13, b2: with ``biases=True``, the gate/up bias ``[n, epn, 2I]`` and the down bias
            ``[n, epn, H]`` of the home experts (pushed with the weights); otherwise None.
        names: the pool tensors that exist (``w13``, ``w2``, then ``b13``, ``b2`` with biases).
    """

    def __init__(self, config: EPConfig, group: Group, dtype: torch.dtype, biases: bool = False) -> None:
        self.config = config
        self.group = group
        self.names: tuple[str, ...] = ("w13", "w2", "b13", "b2") if biases else ("w13", "w2")
        self.w13 = group.symmetric_empty(self.expert_shape("w13"), dtype)
        self.w2 = group.symmetric_empty(self.expert_shape("w2"), dtype)
        self.b13 = group.symmetric_empty(self.expert_shape("b13"), dtype) if biases else None
        self.b2 = group.symmetric_empty(self.expert_shape("b2"), dtype) if biases else None
        for name in self.names:  # allocated with the pool, where every rank of the group takes part
            self.slots(name)

    def expert_shape(self, name: str) -> tuple[int, ...]:
        """``(epn, *one expert's shape)`` of the projection ``name`` per rank."""
        epn, hidden, intermediate = self.config.experts_per_rank, self.config.hidden, self.config.intermediate
        return {
            "w13": (epn, 2 * intermediate, hidden),
            "w2": (epn, hidden, intermediate),
            "b13": (epn, 2 * intermediate),
            "b2": (epn, hidden),
        }[name]

    def slots(self, name: str) -> torch.Tensor:
        """The process's borrow slots of projection ``name``, shaped like its home pool.

        One symmetric buffer per (projection, shape, dtype), from the group's buffer cache, so
        every layer of this shape shares it. Its contents are valid only between a step's push
        and the end of that step's experts.
        """
        home = getattr(self, name)
        return self.group.buffer(f"slots.{name}", self.expert_shape(name), home.dtype)

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
        """Home experts of projection ``name`` of the ranks this process drives: ``[n, epn, ...]`` (or ``[epn, ...]``)."""
        if name not in self.names:
            raise ValueError(f"this pool holds {self.names}, not {name!r}")
        return getattr(self, name)

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
        """Copy every borrowed expert of this step from its owner's home pool into the receiver's slot.

        How the weights travel is the transport's business (:meth:`Group.push_experts`): the push
        kernel over peer addresses, or point-to-point messages on the collective transport.

        Args:
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
        """
        for name in self.names:
            self.group.push_experts(self.home(name), self.slots(name), slot_experts, backend)

    def compute_view(self, local_index: int, part: str = "home") -> tuple[torch.Tensor, ...]:
        """``(w13 [epn, 2I, H], w2 [epn, H, I], b13 [epn, 2I] | None, b2 [epn, H] | None)`` of one
        rank this process drives: its home experts (``part="home"``) or its slots (``"slots"``)."""
        if part not in ("home", "slots"):
            raise ValueError(f"part must be 'home' or 'slots', got {part!r}")
        views = []
        for name in ("w13", "w2", "b13", "b2"):
            if name not in self.names:
                views.append(None)
                continue
            tensor = self.home(name) if part == "home" else self.slots(name)
            views.append(tensor[local_index] if self.group.stacked else tensor)
        return tuple(views)


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
