"""torch.distributed collectives: the plan's semantics where ranks cannot address each other's memory.

This is the path across nodes (NCCL) and on CPU (gloo). It moves exactly what the local and NVLink
transports move, with messages instead of peer stores:

* histograms by ``all_gather``;
* dispatch by one ``all_to_all_single``: each rank sends its entries sorted by (destination rank,
  destination row), every row packed with its fp32 route weight; the receiver writes each row of
  the ``uint8`` payload to its row of the shard (padding rows are left unwritten, as by the
  dispatch kernel: :mod:`flatep.kernels.dispatch`);
* combine by the reverse ``all_to_all_single`` and a sum in fp32 over ``k = 0..K-1`` in the same
  order as the combine kernel, so outputs are bit-equal to the local transport's;
* the weight push by point-to-point messages from each owner to each receiver's slot.

For the backward (:mod:`flatep.backward`), :meth:`CollectiveGroup.gather_entries` returns per-entry
values from the shard rows without summing, and :meth:`CollectiveGroup.return_slot_gradients`
sends borrowed experts' gradients back to their owners (the push reversed).

No destination row travels: both sides derive the order of the rows from the plan alone (the
sender sorts by destination row; the receiver knows from the gathered histogram which source
rank each of its real rows comes from), so combine needs nothing but the plan and the shard.

Host synchronisation: ``all_to_all_single`` takes its split sizes as Python lists, so dispatch and
combine each read the per-rank row counts (derived from the plan) back to the host once, and the
push reads the slot table. This transport therefore cannot be captured in a CUDA graph; its
collectives already order every exchange, so :meth:`CollectiveGroup.barrier` has nothing to do.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from flatep.plan.types import Layout, RankPlan
from flatep.transport.base import Group, join_process_group


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


class CollectiveGroup(Group):
    """One EP rank per process over a ``torch.distributed`` process group (NCCL or gloo).

    Args:
        process_group: the EP ranks (default: the whole world).
        device: where this rank computes (default: the current CUDA device if the group's backend
            is NCCL, else CPU); must be one the backend can all-to-all on.
        eager_check: see :attr:`Group.eager_check`.
    """

    stacked = False
    # NCCL issues the push's point-to-point messages and dispatch's all-to-all on one communicator:
    # from two streams, ranks could issue them in different orders and deadlock.
    push_on_side_stream = False
    peer_addressable = False  # rows move by all-to-all (dispatch, combine below)

    def __init__(
        self, process_group: dist.ProcessGroup | None = None, device: torch.device | str | None = None, eager_check: bool = True
    ) -> None:
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
    ) -> None:
        """Send every entry's row and route weight to its row of its destination's shard.

        Args:
            x: ``[s, H]`` this rank's tokens (bf16 or fp32, contiguous).
            topk_weights: ``[s, K]`` fp32 route weights.
            plan: this rank's plan.
            shard: ``[shard_rows, H]`` this rank's receive shard (written: real rows only).
            shard_weights: ``[shard_rows]`` fp32 route weight of each shard row (written likewise).
        """
        order, send_counts = send_order(plan, self.world)
        rows, receive_counts = receive_order(plan, self.rank)
        send_split, receive_split = self._splits(send_counts, receive_counts)
        sent = order[: sum(send_split)]
        top_k = topk_weights.shape[-1]
        row_bytes = x.shape[-1] * x.element_size()
        # One message per peer: [fp32 route weight | row], so one all-to-all moves both.
        payload = torch.empty(sent.numel(), 4 + row_bytes, dtype=torch.uint8, device=self.device)
        payload[:, :4] = topk_weights.reshape(-1)[sent].view(torch.uint8).view(-1, 4)
        payload[:, 4:] = x[sent // top_k].view(torch.uint8)
        received = torch.empty(sum(receive_split), 4 + row_bytes, dtype=torch.uint8, device=self.device)
        dist.all_to_all_single(received, payload, receive_split, send_split, group=self.process_group)
        targets = rows[: received.shape[0]]
        shard_weights[targets] = received[:, :4].contiguous().view(torch.float32).view(-1)
        shard[targets] = received[:, 4:].view(x.dtype)

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

    def combine(self, shard: torch.Tensor, plan: RankPlan, out_dtype: torch.dtype) -> torch.Tensor:
        """Return every entry's expert output to its source and sum each token's K rows in fp32.

        Args:
            shard: ``[shard_rows, H]`` this rank's shard after the experts ran.
            plan: this rank's plan (the one dispatch used).
            out_dtype: dtype of the result.

        Returns:
            ``[s, H]`` in ``out_dtype``; padded tokens get zeros.
        """
        returned, source = self._return_entries(shard, plan)
        total = torch.zeros(source.shape[0], shard.shape[-1], dtype=torch.float32, device=self.device)
        for k in range(source.shape[1]):  # k order and fp32 accumulation of the combine kernel: bit-equal results
            total += returned[source[:, k]].float()
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
        returned, source = self._return_entries(values.contiguous(), plan)
        return returned[source]

    def push_experts(
        self, home: torch.Tensor, slots: torch.Tensor, slot_experts: torch.Tensor, backend: str = "auto",
        programs: int | None = None,
    ) -> None:
        """Send each borrowed expert from its owner into the receiver's slot (one projection).

        Args:
            home: this rank's home pool ``[epn, *expert_shape]``.
            slots: this rank's slots, shaped like ``home``.
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot); read on the host.
            backend, programs: ignored (no kernel runs here); accepted for the common interface.
        """
        epn = slot_experts.shape[1]
        operations = []
        for receiver, borrowed in enumerate(slot_experts.tolist()):
            for slot, expert in enumerate(borrowed):
                if expert < 0:
                    continue
                owner = expert // epn  # never the receiver: the planner lends only across ranks
                if owner == self.rank:
                    peer = dist.get_global_rank(self.process_group, receiver)
                    operations.append(dist.P2POp(dist.isend, home[expert % epn], peer, self.process_group, slot))
                elif receiver == self.rank:
                    peer = dist.get_global_rank(self.process_group, owner)
                    operations.append(dist.P2POp(dist.irecv, slots[slot], peer, self.process_group, slot))
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
