"""torch.distributed collectives: the plan's semantics where ranks cannot address each other's memory.

This is the path across nodes (NCCL) and on CPU (gloo). It moves exactly what the local and NVLink
transports move, with messages instead of peer stores:

* histograms by ``all_gather``;
* dispatch by one ``all_to_all_single`` of bytes, after a small one of counts: each rank sends
  the metadata of its entries sorted by (destination rank, destination row) (the fp32 route
  weight, and with ``plan.dedup`` the entry's link: its carrier's row and the next row of its run),
  then only its carriers' rows (once per token and destination rank, see
  :class:`flatep.plan.types.Plan`); the receiver writes them to its real rows and copies each
  carrier row into the rows it carries (padding rows are left unwritten, as by the dispatch kernel:
  :mod:`flatep.kernels.dispatch`);
* combine: each rank sums its runs (fp32, ascending ``k``), sends one partial sum per (token,
  rank) back by the reverse ``all_to_all_single``, and each token adds its partial sums in fp32 in
  the plan's ``send_order``, the order and arithmetic of the kernels, so outputs are bit-equal to
  the local transport's;
* the weight push by point-to-point messages from each owner to each receiver's slot.

For the backward (:mod:`flatep.backward`), :meth:`CollectiveGroup.gather_entries` returns per-entry
values from the shard rows without summing, and :meth:`CollectiveGroup.return_slot_gradients`
sends borrowed experts' gradients back to their owners (the push reversed).

No destination row of an entry travels: both sides derive the order of the entries from the plan
alone (the sender sorts by destination row; the receiver knows from the gathered histogram which
source rank each of its real rows comes from). Only the links, which depend on the senders' ids,
travel with the entries; combine needs the plan, the shard and those links.

Host synchronisation: ``all_to_all_single`` takes its split sizes as Python lists, so by default
dispatch and combine each read the per-rank row counts (derived from the plan and the links) back to
the host once. With ``static_splits=True`` they read nothing: every peer's part of each message has
a fixed size taken from the step's shape (:func:`static_slots`: every entry's metadata, and one row
per token with ``plan.dedup``, one per entry without), filled on the device, padding included; the
receiver picks its rows out by the plan. More bytes cross the link, the price of a step the host
never waits on. The push of borrowed experts reads the slot table in either mode: how many experts
go from which owner to which receiver is only known on the device, and fixed sizes would have to
provision every pair for all of a rank's slots. The backward's :meth:`CollectiveGroup.gather_entries`
follows ``static_splits`` as dispatch and combine do (``s*K`` entries per peer). So with
``static_splits`` a step that borrows nothing (``policy="none"``), forward and backward, has no host
synchronisation of this transport's own, while borrowing steps read the slot table once per layer
(and again in a backward that returns borrowed experts' weight gradients). The collectives already order every exchange, so
:meth:`CollectiveGroup.barrier` has nothing to do.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from flatep.kernels.combine import run_sums
from flatep.kernels.dispatch import link_values
from flatep.plan.types import Layout, RankPlan
from flatep.transport.base import Group, join_process_group


def _per_peer(parts: list[torch.Tensor], counts: list[list[int]]) -> list[torch.Tensor]:
    """Byte views of ``parts`` (``[n_i, width_i]`` uint8, rows grouped by peer) interleaved peer by peer:
    peer 0's rows of every part, then peer 1's, ...; ``counts[i][peer]`` rows of part ``i`` per peer."""
    pieces, starts = [], [0] * len(parts)
    for peer in range(len(counts[0])):
        for i, part in enumerate(parts):
            pieces.append(part[starts[i] : starts[i] + counts[i][peer]].reshape(-1))
            starts[i] += counts[i][peer]
    return pieces


def _from_peers(received: torch.Tensor, widths: list[int], counts: list[list[int]]) -> list[torch.Tensor]:
    """The inverse of :func:`_per_peer` on a received byte buffer: each part ``[n_i, widths[i]]`` uint8."""
    parts: list[list[torch.Tensor]] = [[] for _ in widths]
    offset = 0
    for peer in range(len(counts[0])):
        for i, width in enumerate(widths):
            size = counts[i][peer] * width
            parts[i].append(received[offset : offset + size].view(-1, width))
            offset += size
    return [torch.cat(part) for part in parts]


def send_order(plan: RankPlan, ranks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order in which this rank sends its entries: by destination rank, then destination row.

    Args:
        plan: this rank's plan (``dest_rank``/``dest_row`` ``[s, K]``, ``-1`` for padded tokens).
        ranks: ``R``.

    Returns:
        ``(order, counts)``: ``order [s*K] int64`` flat entry indices ``t*K + k``, the entries sent
        first (padded entries last); ``counts [R] int64`` entries sent to each rank.
    """
    dest_rank = plan.dest_rank.reshape(-1).long()
    dest_row = plan.dest_row.reshape(-1).long()
    valid = dest_rank >= 0
    key = torch.where(valid, dest_rank * plan.shard_rows + dest_row, ranks * plan.shard_rows)
    order = torch.sort(key).indices  # keys of sent entries are distinct: (rank, row) is unique
    counts = torch.zeros(ranks + 1, dtype=torch.int64, device=key.device)
    counts.scatter_add_(0, torch.where(valid, dest_rank, ranks), torch.ones_like(dest_rank))
    return order, counts[:ranks]


def receive_order(plan: Layout, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of ``rank``'s shard that receive entries, in the order they arrive.

    Row ``j`` of the group of expert ``e`` on rank ``d`` holds the entry at position
    ``chunk_start[e, d] + j`` of ``e``'s global order (source rank, then flat ``(t, k)``), so its
    source rank is the first ``r`` whose cumulative count of ``e`` exceeds that position. Senders
    send by destination row, so rows arrive grouped by source rank, ascending inside each.

    Returns:
        ``(rows, counts)``: ``rows [shard_rows] int64`` row indices, the ``received[rank]`` real
        rows first in arrival order (then the others); ``counts [R] int64`` rows from each rank.
    """
    ranks = plan.ranks
    device = plan.offsets.device
    ends = plan.offsets[rank].long()  # [G] inclusive end row of each group
    row = torch.arange(plan.shard_rows, device=device)
    group = torch.searchsorted(ends, row, right=True).clamp_max(ends.numel() - 1)
    expert = plan.group_experts[rank].long()[group]
    present = expert >= 0
    expert = expert.clamp_min(0)
    alloc = plan.alloc.long()  # [E, R]
    within = row - plan.group_start[rank].long()[expert]
    real = present & (row < ends[-1]) & (within >= 0) & (within < alloc[expert, rank])
    chunk_start = (alloc.cumsum(1) - alloc)[expert, rank]
    position = chunk_start + within
    cumulative = plan.tokens_per_expert.long().cumsum(0)[:, expert]  # [R, shard_rows]
    source = torch.where(real, (cumulative <= position.unsqueeze(0)).sum(0), ranks)
    rows = torch.sort(source * plan.shard_rows + row).indices
    counts = torch.zeros(ranks + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, source, torch.ones_like(source))
    return rows, counts[:ranks]


def static_slots(tokens: int, top_k: int, dedup: bool) -> tuple[int, int]:
    """``(entries, rows)`` each rank's part of a static-split message holds: every entry a rank can
    send to one peer (``s*K``: all of its entries), and every row (``s`` carriers with ``dedup``, one
    per token and destination rank; ``s*K`` without)."""
    return tokens * top_k, tokens if dedup else tokens * top_k


def static_positions(plan: RankPlan, ranks: int) -> tuple[torch.Tensor, ...]:
    """Where each entry of this rank goes in the static-split messages, on the device.

    Returns, each ``[s*K]`` in send order (:func:`send_order`): ``order`` (flat entry indices),
    ``peer`` (destination rank, ``0`` for unplanned entries), ``entry_slot`` (the entry's place among
    those sent to its peer, ``-1`` for unplanned entries) and ``row_slot`` (the place of its row
    among the carrier rows sent to that peer, ``-1`` unless the entry is a carrier).
    """
    top_k = plan.dest_rank.shape[-1]
    order, counts = send_order(plan, ranks)
    dest = plan.dest_rank.reshape(-1).long()[order]
    sent = dest >= 0
    peer = dest.clamp_min(0)
    index = torch.arange(order.numel(), device=order.device)
    entry_slot = torch.where(sent, index - (counts.cumsum(0) - counts)[peer], -1)
    carries = sent & (plan.carrier.reshape(-1).long()[order] == order % top_k)
    # Entries are sorted by destination, so each peer's carriers are consecutive in send order.
    row_slot = torch.where(carries, carrier_slots(carries, peer, ranks), -1)
    return order, peer, entry_slot, row_slot


def carrier_slots(carries: torch.Tensor, peer: torch.Tensor, ranks: int) -> torch.Tensor:
    """``[n] int64``: each carrier's place among the carriers of its peer, for ``n`` items grouped by
    ``peer`` (``[n] int64``, ascending); ``carries`` ``[n] bool`` marks the carriers (the others'
    values are meaningless)."""
    count = carries.long()
    per_peer = torch.zeros(ranks, dtype=torch.int64, device=count.device).scatter_add_(0, peer, count)
    return count.cumsum(0) - count - (per_peer.cumsum(0) - per_peer)[peer]


def arrivals(plan: Layout, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of ``rank``'s shard in arrival order (:func:`receive_order`), with their source.

    Returns ``(rows, real, source, index)``, each ``[shard_rows]``: the shard row, whether an entry
    arrives in it, its source rank (clamped for the others) and its place among that source's entries.
    """
    rows, counts = receive_order(plan, rank)
    ends = counts.cumsum(0)
    position = torch.arange(rows.numel(), device=rows.device)
    source = torch.searchsorted(ends, position, right=True)
    real = source < plan.ranks
    source = source.clamp_max(plan.ranks - 1)
    return rows, real, source, position - (ends - counts)[source]


def refuse_capture(what: str, instead: str) -> None:
    """Raise ``ValueError`` if a CUDA graph is being captured: ``what`` reads sizes on the host,
    which would break the capture; ``instead`` says what to do."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError(f"the collective transport's {what} reads sizes on the host and cannot run inside CUDA-graph "
                         f"capture: {instead}")


class CollectiveGroup(Group):
    """One EP rank per process over a ``torch.distributed`` process group (NCCL or gloo).

    Args:
        process_group: the EP ranks (default: the whole world).
        device: where this rank computes (default: the current CUDA device if the group's backend
            is NCCL, else CPU); must be one the backend can all-to-all on.
        eager_check: see :attr:`Group.eager_check`.
        static_splits: dispatch and combine send fixed-size messages, padding included, so that
            they read nothing back to the host (see the module docstring): about ``R*s`` rows per
            rank and direction with ``EPConfig.dedup``, ``R*s*K`` without it (then ``R`` times the
            bytes of the default), against the ``s*K`` entries' rows of the default.
    """

    stacked = False
    # NCCL issues the push's point-to-point messages and dispatch's all-to-all on one communicator:
    # from two streams, ranks could issue them in different orders and deadlock.
    push_on_side_stream = False
    peer_addressable = False  # rows move by all-to-all (dispatch, combine below)

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, device: torch.device | str | None = None,
        eager_check: bool = True, static_splits: bool = False,
    ) -> None:
        if not isinstance(static_splits, bool):
            raise ValueError(f"static_splits must be True or False, got {static_splits!r}")
        self.static_splits = static_splits
        self._process_group, self.world, self.rank = join_process_group(process_group, "collective")
        self.local_ranks = (self.rank,)
        backend = str(dist.get_backend(self.process_group)).lower()
        if device is None:
            on_gpu = "nccl" in backend and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        needed = "nccl" if self.device.type == "cuda" else "gloo"
        if needed not in backend:
            raise ValueError(
                f"device {self.device} needs a process group with the {needed} backend for all_to_all, got {backend!r}"
            )
        self._start_checks(eager_check)

    def close(self, timeout: float = 60.0) -> None:
        """Collective: wait until every rank has closed (a barrier, at most ``timeout`` seconds on
        gloo, then ``RuntimeError``), then free the buffers and let go of the process group.

        The barrier lets no rank tear down while a peer's last messages are still in flight: a
        gloo process group torn down that way could abort its process at exit (``std::terminate``
        from a gloo worker thread; measured with two CPU processes: 5 of 20 exits without the
        barrier, 0 of 20 with it).
        """
        group = self.__dict__.get("_process_group")
        try:
            if group is not None and "gloo" in str(dist.get_backend(group)).lower():
                dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout))
        finally:
            super().close()

    def symmetric_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A plain local tensor: every rank holds one of the same shape; peers never address it."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def peer_offsets(self, buffer: torch.Tensor) -> torch.Tensor:
        raise ValueError("the collective transport has no peer addresses: its dispatch, combine and push are messages")

    def barrier(self) -> None:
        """Nothing to do: every exchange here is a collective that completes only with its peers' data."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.process_group)
        return torch.stack(parts)

    def _splits(self, sent: torch.Tensor, received: torch.Tensor) -> tuple[list[int], list[int]]:
        """Both split-size lists with one host synchronisation."""
        counts = torch.cat([sent, received]).tolist()
        return counts[: self.world], counts[self.world :]

    def dispatch(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        plan: RankPlan,
        shard: torch.Tensor,
        shard_weights: torch.Tensor,
        links: torch.Tensor,
    ) -> None:
        """Send every entry's route weight (and link), and each carrier's row once, to its destination.

        One all-to-all of bytes: to each peer, the metadata of every entry bound for it (its fp32
        route weight and, with ``plan.dedup``, its link: the rows of its carrier and of the next
        entry of its run), then the rows of its carriers only. The receiver writes them to its
        real rows and copies each carrier row into the rows it carries. Padding rows are left
        unwritten. A small all-to-all first tells each receiver how many carrier rows come.

        Args:
            x: ``[s, H]`` this rank's tokens (bf16 or fp32, contiguous).
            topk_weights: ``[s, K]`` fp32 route weights.
            plan: this rank's plan.
            shard: ``[shard_rows, H]`` this rank's receive shard (written: real rows only).
            shard_weights: ``[shard_rows]`` fp32 route weight of each shard row (written likewise).
            links: ``[shard_rows, 2]`` int32 link table (written with ``plan.dedup``; combine reads it).
        """
        if self.static_splits:
            self._dispatch_static(x, topk_weights, plan, shard, shard_weights, links)
            return
        refuse_capture("dispatch", "make the group with static_splits=True")
        top_k = topk_weights.shape[-1]
        order, send_counts = send_order(plan, self.world)
        rows, receive_counts = receive_order(plan, self.rank)
        carrier = plan.carrier.reshape(-1).long()
        is_carrier = carrier == torch.arange(carrier.numel(), device=self.device) % top_k
        dest = plan.dest_rank.reshape(-1).long()
        carrier_counts = torch.bincount(dest[is_carrier], minlength=self.world)
        incoming = torch.empty_like(carrier_counts)
        dist.all_to_all_single(incoming, carrier_counts, group=self.process_group)
        counts = torch.cat([send_counts, receive_counts, carrier_counts, incoming]).tolist()
        entries_out, entries_in, carriers_out, carriers_in = (counts[i * self.world : (i + 1) * self.world] for i in range(4))
        sent = order[: sum(entries_out)]
        # Metadata of every sent entry, in send order: [fp32 weight | int32 carrier row | int32 next row].
        meta = [topk_weights.reshape(-1)[sent].view(torch.uint8).view(-1, 4)]
        if plan.dedup:
            head, nxt = link_values(plan.dest_row, plan.carrier, plan.send_order)
            meta += [head.reshape(-1)[sent].int().view(torch.uint8).view(-1, 4), nxt.reshape(-1)[sent].int().view(torch.uint8).view(-1, 4)]
        meta = torch.cat(meta, dim=1)
        carriers = sent[is_carrier[sent]]  # still by (destination, row)
        carried = x[carriers // top_k].view(torch.uint8)
        meta_bytes, row_bytes = meta.shape[1], carried.shape[1]
        payload = torch.cat(_per_peer([meta, carried], [entries_out, carriers_out]))
        received = torch.empty(sum(entries_in) * meta_bytes + sum(carriers_in) * row_bytes, dtype=torch.uint8,
                               device=self.device)
        dist.all_to_all_single(
            received, payload, [e * meta_bytes + c * row_bytes for e, c in zip(entries_in, carriers_in)],
            [e * meta_bytes + c * row_bytes for e, c in zip(entries_out, carriers_out)], group=self.process_group,
        )
        meta_in, rows_in = _from_peers(received, [meta_bytes, row_bytes], [entries_in, carriers_in])
        targets = rows[: meta_in.shape[0]]
        shard_weights[targets] = meta_in[:, :4].contiguous().view(torch.float32).view(-1)
        if not plan.dedup:
            shard[targets] = rows_in.view(x.dtype)
            return
        link = meta_in[:, 4:].contiguous().view(torch.int32)  # [entries, 2] (carrier row, next row)
        links[targets] = link
        head = link[:, 0].long()
        own = head == targets  # carriers arrive in the same order as their entries
        shard[targets[own]] = rows_in.view(x.dtype)
        shard[targets[~own]] = shard[head[~own]]  # the local copies: carrier rows are complete above

    def _exchange(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One equal-split all-to-all of ``parts`` (each ``[R, ...]`` uint8, part ``i`` of peer ``p``
        in row ``p``): returns the same shapes, row ``p`` holding what peer ``p`` sent."""
        payload = torch.cat([part.reshape(self.world, -1) for part in parts], dim=1)
        received = torch.empty_like(payload)
        dist.all_to_all_single(received, payload, group=self.process_group)
        pieces = received.split([part[0].numel() for part in parts], dim=1)
        return [piece.reshape(part.shape) for piece, part in zip(pieces, parts)]

    def _send_to_slots(
        self, values: torch.Tensor, peer: torch.Tensor, slot: torch.Tensor, keep: torch.Tensor, slots: int
    ) -> torch.Tensor:
        """One equal-split all-to-all of rows placed by the device: ``values[i]`` (``[n, C]``) goes to
        peer ``peer[i]`` at place ``slot[i]`` of its ``slots``-row part, where ``keep[i]`` (the others
        land in a spare row that is not sent). Returns ``[R, slots, C]`` in ``values``' dtype, part
        ``p`` what peer ``p`` sent this rank; places no row was given hold garbage."""
        outgoing = torch.empty(self.world * slots + 1, values.shape[-1], dtype=values.dtype, device=self.device)
        outgoing[torch.where(keep, peer * slots + slot, self.world * slots)] = values
        (received,) = self._exchange([outgoing[:-1].view(torch.uint8).view(self.world, slots, -1)])
        return received.view(values.dtype).view(self.world, slots, -1)

    def _dispatch_static(
        self, x: torch.Tensor, topk_weights: torch.Tensor, plan: RankPlan, shard: torch.Tensor,
        shard_weights: torch.Tensor, links: torch.Tensor,
    ) -> None:
        """:meth:`dispatch` with fixed-size messages (``static_splits``): no host read."""
        tokens, top_k = topk_weights.shape
        entry_slots, row_slots = static_slots(tokens, top_k, plan.dedup)
        order, peer, entry_slot, row_slot = static_positions(plan, self.world)
        meta = [topk_weights.reshape(-1)[order].view(torch.uint8).view(-1, 4)]
        if plan.dedup:
            head, nxt = link_values(plan.dest_row, plan.carrier, plan.send_order)
            meta += [head.reshape(-1)[order].int().view(torch.uint8).view(-1, 4), nxt.reshape(-1)[order].int().view(torch.uint8).view(-1, 4)]
        meta = torch.cat(meta, dim=1)
        row_bytes = x.shape[-1] * x.element_size()
        # A spare last slot takes every write that has no place (unplanned entries, non-carriers).
        meta_out = torch.empty(self.world * entry_slots + 1, meta.shape[1], dtype=torch.uint8, device=self.device)
        meta_out[torch.where(entry_slot >= 0, peer * entry_slots + entry_slot, self.world * entry_slots)] = meta
        # The token of each row slot (padding slots: token 0), then one gather of the message's rows.
        slot_token = torch.zeros(self.world * row_slots + 1, dtype=torch.int64, device=self.device)
        slot_token[torch.where(row_slot >= 0, peer * row_slots + row_slot, self.world * row_slots)] = order // top_k
        rows_out = x.view(torch.uint8)[slot_token[:-1]]
        meta_in, rows_in = self._exchange([meta_out[:-1].view(self.world, entry_slots, -1),
                                           rows_out.view(self.world, row_slots, row_bytes)])
        targets, real, source, index = arrivals(plan, self.rank)
        arrived = meta_in[source, index.clamp(0, entry_slots - 1)]  # [shard_rows, meta bytes]
        # Every shard row up to the plan's shard_rows is rewritten, the rows no entry reached with
        # their own values: static shapes, at the price of HBM traffic over all of those rows (the
        # worst-case shard under classic EP, up to R times the real rows), not only the real ones.
        weight = arrived[:, :4].contiguous().view(torch.float32).view(-1)
        shard_weights[targets] = torch.where(real, weight, shard_weights[targets])
        if not plan.dedup:
            values = rows_in[source, index.clamp(0, row_slots - 1)].view(x.dtype)
            shard[targets] = torch.where(real.unsqueeze(1), values, shard[targets])
            return
        link = arrived[:, 4:].contiguous().view(torch.int32)  # [shard_rows, 2] (carrier row, next row)
        links[targets] = torch.where(real.unsqueeze(1), link, links[targets])
        head = link[:, 0].long()
        own = real & (head == targets)  # carriers arrive in the same order as their entries
        slot = carrier_slots(own, source, self.world).clamp(0, row_slots - 1)
        shard[targets] = torch.where(own.unsqueeze(1), rows_in[source, slot].view(x.dtype), shard[targets])
        # The local copies: every carrier row is complete above.
        copies = real & ~own
        shard[targets] = torch.where(copies.unsqueeze(1), shard[torch.where(copies, head, targets)], shard[targets])

    def _return_entries(self, shard: torch.Tensor, plan: RankPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Send every shard row back to the entry it came from (the reverse all-to-all of dispatch).

        Args:
            shard: ``[shard_rows, C]`` this rank's rows (any dtype).
            plan: this rank's plan (the one dispatch used).

        Returns:
            ``(returned, source)``: ``returned [sent + 1, C]`` the rows this rank's entries got back
            (in send order), its last row zero; ``source [s, K] int64`` the row of ``returned`` of
            each entry (that zero row for padded entries).
        """
        tokens, top_k = plan.dest_rank.shape
        order, send_counts = send_order(plan, self.world)
        rows, receive_counts = receive_order(plan, self.rank)
        send_split, receive_split = self._splits(send_counts, receive_counts)
        sent = sum(send_split)
        # The extra last row stays zero: padded entries read it, as the kernel's masked loads read 0.
        returned = torch.zeros(sent + 1, shard.shape[-1], dtype=shard.dtype, device=self.device)
        outgoing = shard[rows[: sum(receive_split)]]
        dist.all_to_all_single(returned[:sent], outgoing, send_split, receive_split, group=self.process_group)
        source = torch.full((tokens * top_k,), sent, dtype=torch.int64, device=self.device)
        source[order[:sent]] = torch.arange(sent, device=self.device)
        return returned, source.view(tokens, top_k)

    def combine(self, rows: torch.Tensor, plan: RankPlan, links: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Sum each run here, return one partial sum per (token, rank) to its source, and sum them per token.

        The run sums and the per-token sums are those of the kernels (:mod:`flatep.kernels.combine`):
        fp32 in ascending ``k``, rounded once to ``rows``' dtype; then fp32 in the plan's
        ``send_order``. Outputs are bit-equal to the local transport's.

        Args:
            rows: ``[shard_rows, H]`` this rank's expert outputs (not modified).
            plan: this rank's plan (the one dispatch used); links: the links dispatch wrote.
            out_dtype: dtype of the result.

        Returns:
            ``[s, H]`` in ``out_dtype``; padded tokens get zeros.
        """
        if self.static_splits:
            return self._combine_static(rows, plan, links, out_dtype)
        refuse_capture("combine", "make the group with static_splits=True")
        tokens, top_k = plan.dest_rank.shape
        order, _ = send_order(plan, self.world)
        targets, receive_counts = receive_order(plan, self.rank)
        source = torch.repeat_interleave(torch.arange(self.world, device=self.device), receive_counts)
        real = targets[: source.numel()]  # arrival order: by source rank, then row
        carrier = plan.carrier.reshape(-1).long()
        is_carrier = carrier == torch.arange(carrier.numel(), device=self.device) % top_k
        own = (links[real, 0].long() == real) if plan.dedup else torch.ones_like(real, dtype=torch.bool)
        outgoing_counts = torch.bincount(source[own], minlength=self.world)
        dest = plan.dest_rank.reshape(-1).long()
        returning_counts = torch.bincount(dest[is_carrier], minlength=self.world)
        send_split, receive_split = self._splits(outgoing_counts, returning_counts)
        carriers = real[own]
        partial = run_sums(rows, links, carriers, top_k) if plan.dedup else rows[carriers]
        mine = order[is_carrier[order] & (dest[order] >= 0)]  # this rank's carriers by (destination, row)
        # The extra last row stays zero: entries that are not carriers read it, as the kernel's masked loads read 0.
        returned = torch.zeros(mine.numel() + 1, rows.shape[-1], dtype=rows.dtype, device=self.device)
        dist.all_to_all_single(returned[:-1], partial.contiguous(), receive_split, send_split, group=self.process_group)
        index = torch.full((tokens * top_k,), mine.numel(), dtype=torch.int64, device=self.device)
        index[mine] = torch.arange(mine.numel(), device=self.device)
        index = index.view(tokens, top_k)
        total = torch.zeros(tokens, rows.shape[-1], dtype=torch.float32, device=self.device)
        for i in range(top_k):  # the combine kernel's order (send order) and fp32 accumulation: bit-equal results
            entry = plan.send_order[:, i].long()
            position = index.gather(1, entry.clamp_min(0).unsqueeze(1))[:, 0]
            total += returned[torch.where(entry >= 0, position, mine.numel())].float()
        return total.to(out_dtype)

    def _combine_static(self, rows: torch.Tensor, plan: RankPlan, links: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """:meth:`combine` with fixed-size messages (``static_splits``): no host read, the same sums."""
        tokens, top_k = plan.dest_rank.shape
        hidden = rows.shape[-1]
        _, row_slots = static_slots(tokens, top_k, plan.dedup)
        targets, real, source, index = arrivals(plan, self.rank)
        if plan.dedup:  # each carrier row here sends its run's sum, in the place dispatch gave its row
            own = real & (links[targets, 0].long() == targets)
            slot = carrier_slots(own, source, self.world)
            partial = run_sums(rows, links, torch.where(own, targets, -1), top_k)
        else:
            own, slot, partial = real, index, rows[targets]
        returned = self._send_to_slots(partial, source, slot, own, row_slots)
        order, _, _, row_slot = static_positions(plan, self.world)
        slot_of_entry = torch.empty_like(row_slot)
        slot_of_entry[order] = row_slot
        peer_of_entry = plan.dest_rank.reshape(-1).long().clamp_min(0)
        first_entry = torch.arange(tokens, device=self.device) * top_k
        total = torch.zeros(tokens, hidden, dtype=torch.float32, device=self.device)
        for i in range(top_k):  # the combine kernel's order (send order) and fp32 accumulation: bit-equal results
            entry = first_entry + plan.send_order[:, i].long().clamp_min(0)
            slot = slot_of_entry[entry]
            live = (plan.send_order[:, i] >= 0) & (slot >= 0)
            total += torch.where(live.unsqueeze(1), returned[peer_of_entry[entry], slot.clamp_min(0)].float(), 0.0)
        return total.to(out_dtype)

    def gather_entries(self, values: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        """Return each shard row's values to the entry dispatched to it, one per entry, without summing.

        The same all-to-all as :meth:`combine`; the backward uses it to read each route weight's
        gradient back from the row its entry was dispatched to.

        Args:
            values: ``[shard_rows, C]`` per shard row (any dtype).
            plan: this rank's plan (the one dispatch used).

        Returns:
            ``[s, K, C]`` in ``values``' dtype: entry ``(t, k)`` gets its row's values; padded entries zeros.
        """
        if self.static_splits:
            return self._gather_entries_static(values, plan)
        refuse_capture("gather_entries", "make the group with static_splits=True")
        returned, source = self._return_entries(values.contiguous(), plan)
        return returned[source]

    def _gather_entries_static(self, values: torch.Tensor, plan: RankPlan) -> torch.Tensor:
        """:meth:`gather_entries` with fixed-size messages (``static_splits``): every peer's part holds
        ``s*K`` entries, each arrived row's values going back to the place dispatch gave its entry."""
        tokens, top_k = plan.dest_rank.shape
        entry_slots, _ = static_slots(tokens, top_k, plan.dedup)
        targets, real, source, index = arrivals(plan, self.rank)
        returned = self._send_to_slots(values[targets], source, index, real, entry_slots)
        order, peer, entry_slot, _ = static_positions(plan, self.world)
        gathered = torch.empty(tokens * top_k, values.shape[-1], dtype=values.dtype, device=self.device)
        gathered[order] = torch.where((entry_slot >= 0).unsqueeze(1), returned[peer, entry_slot.clamp_min(0)], 0)
        return gathered.view(tokens, top_k, -1)

    def push_pools(
        self, pools: list[tuple[torch.Tensor, torch.Tensor]], slot_experts: torch.Tensor, backend: str = "auto",
        programs: int | None = None,
    ) -> None:
        """:meth:`push_experts` for every pool of a layer as messages, point to point from each
        owner to each receiver: the slot table read on the host once, all messages in one batch
        (each tagged by its pool and slot); ``backend`` and ``programs`` are ignored (no kernel
        runs here)."""
        refuse_capture("push of borrowed experts", "capture steps that borrow nothing (policy='none') with "
                       "static_splits=True, or run borrowing steps eagerly")
        epn = slot_experts.shape[1]
        operations = []
        for receiver, borrowed in enumerate(slot_experts.tolist()):
            for slot, expert in enumerate(borrowed):
                if expert < 0:
                    continue
                owner = expert // epn  # never the receiver: the planner lends only across ranks
                for index, (home, slots) in enumerate(pools):
                    tag = index * epn + slot
                    if owner == self.rank:
                        peer = dist.get_global_rank(self.process_group, receiver)
                        operations.append(dist.P2POp(dist.isend, home[expert % epn], peer, self.process_group, tag))
                    elif receiver == self.rank:
                        peer = dist.get_global_rank(self.process_group, owner)
                        operations.append(dist.P2POp(dist.irecv, slots[slot], peer, self.process_group, tag))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()

    def return_slot_gradients(
        self, slot_grads: torch.Tensor, slot_experts: torch.Tensor
    ) -> list[tuple[int, int, torch.Tensor]]:
        """The reverse of :meth:`push_experts`: each receiver sends its slots' values (a borrowed
        expert's weight gradient) back to the expert's owner, point to point, tagged by slot.

        Args:
            slot_grads: ``[epn, *shape]`` this rank's value for each of its slots (rows of empty slots unsent).
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot); read on the host.

        Returns:
            What this rank received as the owner: ``(home index, receiver, values [*shape])`` in
            ascending receiver, then slot, order, so the owner can add them in a fixed order.
        """
        epn = slot_experts.shape[1]
        operations, received = [], []
        for receiver, borrowed in enumerate(slot_experts.tolist()):
            for slot, expert in enumerate(borrowed):
                if expert < 0:
                    continue
                owner = expert // epn
                if receiver == self.rank:
                    peer = dist.get_global_rank(self.process_group, owner)
                    values = slot_grads[slot].contiguous()
                    operations.append(dist.P2POp(dist.isend, values, peer, self.process_group, slot))
                elif owner == self.rank:
                    values = torch.empty_like(slot_grads[slot])
                    peer = dist.get_global_rank(self.process_group, receiver)
                    operations.append(dist.P2POp(dist.irecv, values, peer, self.process_group, slot))
                    received.append((expert % epn, receiver, values))
        if operations:
            for request in dist.batch_isend_irecv(operations):
                request.wait()
        return received

    def __repr__(self) -> str:
        return f"CollectiveGroup(rank={self.rank}, world={self.world}, device={self.device})"
