"""The plan of one step: what every rank needs to move rows and weights."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch

from flatep.config import EPConfig, rows_per_expert

if TYPE_CHECKING:
    from flatep.plan.auto import AutoChoice


# Two independent position-weighted sums modulo the prime 2**31 - 1: every term stays below 2**62
# and a sum of up to 2**32 terms below 2**63, so int64 never overflows. Changing one id, or swapping
# two different ids, always changes both sums (the position weights are distinct modulo the prime).
_PRIME = 2**31 - 1
_MIXERS = ((48271, 12345), (69621, 40503))


def ids_fingerprint(topk_ids: torch.Tensor) -> torch.Tensor:
    """A cheap hash of each rank's ids, computed on their device without host synchronisation.

    Args:
        topk_ids: ``[n, s, K]`` (``n`` ranks) or ``[s, K]`` integer ids (any values, ``-1`` included).

    Returns:
        ``[n, 2]`` int64 (``n = 1`` for ``[s, K]``): equal for equal ids; different whenever one
        id differs or two different ids trade places (and with probability about ``2**-62``
        otherwise).
    """
    ranks = 1 if topk_ids.dim() == 2 else topk_ids.shape[0]
    flat = topk_ids.reshape(ranks, -1).long().add(1).remainder(_PRIME)
    position = torch.arange(flat.shape[-1], device=flat.device, dtype=torch.int64)
    sums = [(flat * (position * a + b).remainder(_PRIME)).remainder(_PRIME).sum(-1) for a, b in _MIXERS]
    return torch.stack(sums, dim=-1)


@dataclass(eq=False)
class MadeFor:
    """What a plan from :func:`flatep.plan_step` was made for, so a step can refuse a plan made for other ids.

    Attributes:
        config: the group sizes it was planned with.
        policy: the balancing policy.
        tokens: ``s``, tokens per rank of the step.
        counts: real tokens per rank as given to the planner (``None``: ``s`` everywhere).
        fingerprint: :func:`ids_fingerprint` of the ids it was planned from, ``[n, 2]`` int64 on
            their device (``n`` = ranks this process drives).
        packed_rows: whether its step dispatches packed fp8 rows (``dispatch_dtype``); the
            ranks of a per-process group agreed on it while planning.
        dtype: the activation dtype it was planned for (``None``: not given to the planner);
            the ranks of a per-process group agreed on it while planning.
    """

    config: EPConfig
    policy: str
    tokens: int
    counts: tuple[int, ...] | int | None
    fingerprint: torch.Tensor
    packed_rows: bool = False
    dtype: torch.dtype | None = None


@dataclass(repr=False)
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
        padding: ``[R, 2*epn, 2]`` ``(first row, count)`` of the rows that pad each group to a
            multiple of ``align`` (dispatch never writes them: they hold whatever the buffer held,
            NaN included); ``(0, 0)`` when none.
        received: ``[R]`` real rows each rank computes (``cap[d]`` under ``exact``).
        group_start: ``[R, E]`` first row of expert ``e``'s group on rank ``d``, ``-1`` if absent.
        made_for: what :func:`flatep.plan_step` made the plan for (``None`` from the planner
            functions themselves); a step checks it against its ids.
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
    made_for: MadeFor | None = field(default=None, kw_only=True, repr=False, compare=False)

    @property
    def ranks(self) -> int:
        """``R``, the ranks of the group."""
        return self.tokens_per_expert.shape[0]

    def rows_per_expert(self, top_k: int) -> int:
        """:func:`flatep.config.rows_per_expert` of this step (``ceil(T*K/E)``)."""
        return rows_per_expert(self.total_tokens, top_k, self.tokens_per_expert.shape[1])

    def padded_rows(self) -> torch.Tensor:
        """``[R] int32``: rows each rank's experts compute (its real rows plus group padding)."""
        if not self.slot_base:
            return self.offsets[:, -1]
        epn = self.slot_experts.shape[1]
        return self.offsets[:, epn - 1] + self.offsets[:, -1] - self.slot_base

    def active_groups(self) -> torch.Tensor:
        """``[R] int64``: groups (home experts and borrowed slots) holding rows on each rank: the
        experts whose weights its GEMMs read."""
        epn = self.slot_experts.shape[1]
        starts = torch.zeros_like(self.offsets)
        starts[:, 1:] = self.offsets[:, :-1]
        if self.slot_base:
            starts[:, epn] = self.slot_base
        return (self.offsets > starts).sum(1)

    def donors(self) -> torch.Tensor:
        """``[R] int32``: the rank that lends rank ``d`` its borrowed experts, ``-1`` if none."""
        epn = self.slot_experts.shape[1]
        first = self.slot_experts[:, 0]
        return torch.where(first >= 0, first // epn, torch.full_like(first, -1))

    def summary(self) -> str:
        """A few lines for people: policy, ranks, rows per rank and the experts each rank borrows (host sync)."""
        rows = self.received.tolist()
        mean = sum(rows) / max(len(rows), 1)
        imbalance = max(rows) / mean - 1 if mean else 0.0
        lines = [
            f"{type(self).__name__}(policy={self.policy!r}, ranks={self.ranks}, experts={self.tokens_per_expert.shape[1]}, "
            f"total_tokens={self.total_tokens}, shard_rows={self.shard_rows}"
            + (f", rank={self.rank}" if hasattr(self, "rank") else "")
            + (f", s={self.made_for.tokens}" if self.made_for is not None else "")
            + ")",
            f"  rows per rank: {rows} (busiest {imbalance:+.1%} vs mean)",
        ]
        borrowed = {rank: [e for e in experts if e >= 0] for rank, experts in enumerate(self.slot_experts.tolist())}
        lent = {rank: experts for rank, experts in borrowed.items() if experts}
        lines.append(f"  borrowed experts by rank: {lent}" if lent else "  borrowed experts: none")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return self.summary()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor field by name (for comparisons and serialisation)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}


@dataclass(repr=False)
class Plan(Layout):
    """The plan of a whole group (virtual ranks): layout plus every entry's destination.

    How a token crosses the link once per destination rank (``carrier``, ``send_order``; see
    :attr:`flatep.EPConfig.dedup`): the *carrier* of an entry is the token's first entry, in ``k``
    order, bound for the same rank (under ``dedup=False``, the entry itself). Dispatch sends only
    carriers' rows, and with each entry a link (its carrier's row, the next row of its run); the
    destination copies each carrier row into the rows of the entries it carries. Combine sums, on
    the destination, each carrier's run (ascending ``k``, fp32, rounded once to the rows' dtype)
    into the carrier's row, and each token adds its carriers' partial sums in ``send_order``
    (ascending destination rank, fp32). Every transport does these sums in this order, so their
    outputs are bit-identical.

    Attributes:
        dest_rank: ``[R, s, K]`` rank whose shard receives entry ``(r, t, k)``; ``-1`` for tokens
            beyond ``tokens[r]`` in per-rank mode.
        dest_row: ``[R, s, K]`` row of that entry inside the destination shard; ``-1`` likewise.
        carrier: ``[R, s, K]`` the ``k`` of entry ``(r, t, k)``'s carrier (``k`` itself for
            carriers, the only entries whose rows cross the link); ``-1`` for unplanned entries.
        send_order: ``[R, s, K]`` each token's planned entries (their ``k``) sorted by destination
            rank, then ``k``; ``-1`` after them. The entries of one carrier are consecutive, the
            carrier first (its *run*).
        dedup: whether ``carrier`` deduplicates (:attr:`flatep.EPConfig.dedup` of the planner's
            config); ``False``: every entry carries itself, and the destination has nothing to
            copy or sum.
    """

    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    carrier: torch.Tensor
    send_order: torch.Tensor
    dedup: bool = field(kw_only=True)


@dataclass(repr=False)
class RankPlan(Layout):
    """One rank's plan (one process per rank): the shared layout plus its own entries.

    Attributes:
        rank: the rank this plan belongs to.
        dest_rank: ``[s, K]`` destination rank of each of this rank's entries (``-1`` padded).
        dest_row: ``[s, K]`` row inside the destination shard (``-1`` padded).
        carrier, send_order: ``[s, K]``, as in :class:`Plan`.
        dedup: as in :class:`Plan`.
    """

    rank: int
    dest_rank: torch.Tensor
    dest_row: torch.Tensor
    carrier: torch.Tensor
    send_order: torch.Tensor
    dedup: bool = field(kw_only=True)
