"""The plan of one step: what every rank needs to move rows and weights."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from flatep.plan.auto import AutoChoice


@dataclass
class Layout:
    """Tables identical on every rank of the group (a pure function of the gathered histogram).

    Every tensor is int32 on the plan's device.

    Attributes:
        policy: balancing policy that made the plan (``exact``, ``bounded``, ``none`` or ``auto``).
        shard_rows: rows of each receive shard this step may use (depends on ``s`` only).
        total_tokens: tokens over the group ``T``.
        tokens_per_expert: ``[R, E]`` histogram of every rank's ids (row ``r`` = rank ``r``).
        alloc: ``[E, R]`` rows of expert ``e`` computed on rank ``d``.
        slot_experts: ``[R, epn]`` global id of the expert borrowed into each slot of rank ``d``,
            ascending, then ``-1`` for empty slots.
        group_experts: ``[R, 2*epn]`` global id of each group of rank ``d``'s compute view: its home
            experts ascending, then its slots (``-1`` empty).
        offsets: ``[R, 2*epn]`` inclusive padded end row of each group (the ``offs`` of
            ``torch._grouped_mm``); empty groups take no rows.
        padding: ``[R, 2*epn, 2]`` ``(first row, count)`` of the zero rows that pad each group to a
            multiple of ``align``; ``(0, 0)`` when none.
        received: ``[R]`` real rows each rank computes (``cap[d]`` under ``exact``).
        group_start: ``[R, E]`` first row of expert ``e``'s group on rank ``d``, ``-1`` if absent.
        slot_base: ``0`` in the planner's layout, where each rank's slot groups follow its home
            groups; otherwise the row where every shard's slot groups start (see
            :func:`flatep.plan.split.split_slot_rows`), so that home and slot experts run as two
            grouped GEMMs over weights kept apart.
        slot_rows: rows the slot half of the split layout needs; ``0``: as many as ``shard_rows``
            (``auto`` plans size their home half like classic EP and their slot half smaller).
        auto: under policy ``auto``, the candidates, the device-side choice and the cost model's
            predictions (:class:`flatep.plan.auto.AutoChoice`); ``None`` otherwise.
    """

    policy: str
    shard_rows: int
    total_tokens: int
    tokens_per_expert: torch.Tensor
    alloc: torch.Tensor
    slot_experts: torch.Tensor
    group_experts: torch.Tensor
    offsets: torch.Tensor
    padding: torch.Tensor
    received: torch.Tensor
    group_start: torch.Tensor
    slot_base: int = field(default=0, kw_only=True)
    slot_rows: int = field(default=0, kw_only=True)
    auto: "AutoChoice | None" = field(default=None, kw_only=True)

    @property
    def ranks(self) -> int:
        """``R``, the ranks of the group."""
        return self.tokens_per_expert.shape[0]

    def padded_rows(self) -> torch.Tensor:
        """``[R] int32``: rows each rank's experts compute (its real rows plus group padding)."""
        if not self.slot_base:
            return self.offsets[:, -1]
        epn = self.slot_experts.shape[1]
        return self.offsets[:, epn - 1] + self.offsets[:, -1] - self.slot_base

    def donors(self) -> torch.Tensor:
        """``[R] int32``: the rank that lends rank ``d`` its borrowed experts, ``-1`` if none."""
        epn = self.slot_experts.shape[1]
        first = self.slot_experts[:, 0]
        return torch.where(first >= 0, first // epn, torch.full_like(first, -1))

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (for comparisons and serialisation)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


@dataclass
class Plan(Layout):
    """The plan of a whole group (virtual ranks): layout plus every entry's destination.

    Attributes:
        dest_rank: ``[R, s, K]`` rank whose shard receives entry ``(r, t, k)``; ``-1`` for tokens
            beyond ``tokens[r]`` in per-rank mode.
        dest_row: ``[R, s, K]`` row of that entry inside the destination shard; ``-1`` likewise.
    """

    dest_rank: torch.Tensor
    dest_row: torch.Tensor


@dataclass
class RankPlan(Layout):
    """One rank's plan (one process per rank): the shared layout plus its own entries.

    Attributes:
        rank: the rank this plan belongs to.
        dest_rank: ``[s, K]`` destination rank of each of this rank's entries (``-1`` padded).
        dest_row: ``[s, K]`` row inside the destination shard (``-1`` padded).
    """

    rank: int
    dest_rank: torch.Tensor
    dest_row: torch.Tensor
