"""The NVLink transport's own kernels, with peers simulated as slices of one tensor (CPU interpreter or GPU).

Ranks run one after another here, so a rank that arrives before the others times out: that is
exactly what shows which peers the kernel reports missing. Real concurrency is exercised by
``bench/scripts/nvlink_shared_gpu.sh``.
"""
from __future__ import annotations

import pytest
import torch

from flatep.transport.barrier import cross_rank_barrier
from flatep.transport.nvlink import add_slot_gradients_triton, scatter_to_peers
from tests.helpers import DEVICE


class SimulatedRanks:
    """``R`` ranks' barrier state; rank ``r``'s flag table is ``flags[r]`` of one stacked tensor."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.flags = torch.zeros(ranks, 2, ranks, dtype=torch.int32, device=DEVICE)
        self.peers = torch.arange(ranks, dtype=torch.int64, device=DEVICE) * self.flags.stride(0)
        self.state = torch.zeros(ranks, 1, dtype=torch.int32, device=DEVICE)
        self.missing = torch.zeros(ranks, ranks, dtype=torch.int32, device=DEVICE)

    def arrive(self, rank: int) -> list[int]:
        """Run rank ``rank``'s next barrier with a tiny budget; return the ranks it found missing."""
        self.missing[rank].zero_()
        cross_rank_barrier(self.flags[rank], self.peers - self.peers[rank], self.state[rank], self.missing[rank], rank, 0.002)
        return self.missing[rank].nonzero().flatten().tolist()


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_barrier_names_the_ranks_that_have_not_arrived_and_resets_itself(ranks):
    simulated = SimulatedRanks(ranks)
    for round_ in range(5):  # rows alternate and values flip: after 4 rounds all flags are 0 again
        for rank in range(ranks):
            assert simulated.arrive(rank) == list(range(rank + 1, ranks)), (round_, rank)
        if round_ % 4 == 3:
            assert not simulated.flags.any(), "the flag tables must return to zero every four rounds"
    assert simulated.state.flatten().tolist() == [5] * ranks


def test_missing_mask_is_sticky_until_read():
    simulated = SimulatedRanks(2)
    missing = simulated.missing[0]
    cross_rank_barrier(simulated.flags[0], simulated.peers, simulated.state[0], missing, 0, 0.002)
    cross_rank_barrier(simulated.flags[1], simulated.peers - simulated.peers[1], simulated.state[1], simulated.missing[1], 1, 0.002)
    assert missing.tolist() == [0, 1]
    simulated.arrive(1)  # rank 1 runs ahead to its next barrier; rank 0's earlier timeout stays recorded
    assert missing.tolist() == [0, 1]


def test_barrier_rejects_bad_arguments():
    simulated = SimulatedRanks(2)
    with pytest.raises(ValueError, match="flags must be int32"):
        cross_rank_barrier(simulated.flags[0].long(), simulated.peers, simulated.state[0], simulated.missing[0], 0, 1.0)
    with pytest.raises(ValueError, match="rank must be in"):
        cross_rank_barrier(simulated.flags[0], simulated.peers, simulated.state[0], simulated.missing[0], 2, 1.0)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        cross_rank_barrier(simulated.flags[0], simulated.peers, simulated.state[0], simulated.missing[0], 0, 0.0)


@pytest.mark.parametrize("shape, dtype", [((5,), torch.int64), ((3, 7), torch.float32), ((1,), torch.int32)])
def test_scatter_to_peers_writes_row_rank_of_every_copy(shape, dtype):
    ranks = 3
    gathered = torch.full((ranks, ranks, *shape), -1, dtype=dtype, device=DEVICE)  # rank r's buffer: gathered[r]
    peers = torch.arange(ranks, dtype=torch.int64, device=DEVICE) * gathered.stride(0)
    rows = [torch.randint(0, 100, shape, device=DEVICE).to(dtype) for _ in range(ranks)]
    for rank in range(ranks):
        scatter_to_peers(rows[rank], gathered[rank], peers - peers[rank], rank)
    for owner in range(ranks):
        assert torch.equal(gathered[owner], torch.stack(rows))


def test_owners_add_their_borrowed_experts_gradients_in_ascending_receiver_order():
    """Each owner adds, from every receiver's staged slot gradients, those of its own experts: the same fp32
    sums in the same order as the local transport (home first, then receivers ascending), bit for bit."""
    ranks, epn, shape = 4, 3, (5, 7)
    generator = torch.Generator().manual_seed(0)
    # Receivers borrow from one donor each (ascending, then -1); expert 1 of rank 0 is borrowed twice.
    slot_experts = torch.tensor([[4, 5, -1], [0, 1, 2], [1, -1, -1], [-1, -1, -1]], dtype=torch.int32)
    staged = torch.randn(ranks, epn, *shape, generator=generator)
    staged[slot_experts < 0] = float("nan")  # empty slots are never read
    home = torch.randn(ranks, epn, *shape, generator=generator)
    expected = home.clone()
    for receiver in range(ranks):
        for slot, expert in enumerate(slot_experts[receiver].tolist()):
            if expert >= 0:
                expected[expert // epn, expert % epn] += staged[receiver, slot]
    staged, home, slot_experts = staged.to(DEVICE), home.to(DEVICE), slot_experts.to(DEVICE)
    peers = torch.arange(ranks, dtype=torch.int64, device=DEVICE) * staged.stride(0)
    for rank in range(ranks):
        add_slot_gradients_triton(home[rank], staged[rank], peers - peers[rank], slot_experts, rank)
    assert torch.equal(home.cpu(), expected)
