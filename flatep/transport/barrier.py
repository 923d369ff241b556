"""A cross-rank barrier kernel: system-scope release/acquire flags, self-resetting, with a timeout.

Every rank holds a symmetric ``int32 [2, R]`` flag table; column ``p`` of a row is written only by
rank ``p``. Barrier number ``n`` (counted by a per-process device counter) uses row ``n & 1`` and
writes the value ``1`` on even rounds of that row and ``0`` on odd ones (row ``n & 1`` sees values
``1, 0, 1, 0, ...`` for ``n >> 1 = 0, 1, 2, ...``), so each row returns to zero by itself: no launch
ever clears it, which is what lets a CUDA graph replay barriers forever. Two rows keep a fast rank
that has already left barrier ``n`` from disturbing the row a slow rank still waits on: the fast
rank cannot reach barrier ``n + 2`` (same row) before every rank has arrived at ``n + 1``.

One program of one warp does it all: it sets its column in every peer's row with a system-scope
release exchange (prior kernels' peer writes become visible to whoever acquires the flag), then
polls its own row with system-scope acquire reads. Unlike MoonEP's barrier there is no in-kernel
grid sync: FlatEP puts barriers between kernel launches, so stream order covers the other CTAs.

Per-peer flags (rather than one arrival counter) name the ranks that did not arrive: after the
time budget the kernel ORs a ``1`` into ``missing[p]`` for every peer ``p`` still absent and
returns instead of hanging; the host raises from that mask (:meth:`NVLinkGroup.check`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _now():
    # %globaltimer: nanoseconds, shared by every SM; a portable inline-asm read (no Triton extra module).
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _elapsed(start, polls, TIMED: tl.constexpr):
    if TIMED:
        return _now() - start
    else:
        return polls


@triton.jit
def _barrier_kernel(
    flags_ptr, flag_peers_ptr, state_ptr, missing_ptr, rank, budget,
    RANKS: tl.constexpr, BLOCK: tl.constexpr, TIMED: tl.constexpr,
):
    peer = tl.arange(0, BLOCK)
    live = peer < RANKS
    state = tl.load(state_ptr)
    row = state & 1
    arrived = 1 - ((state >> 1) & 1)
    tl.store(state_ptr, state + 1)
    # Arrive: my column of row `row` in every peer's table (the peer table holds my own offset, 0, too).
    column = tl.load(flag_peers_ptr + peer, mask=live, other=0) + row * RANKS + rank
    tl.atomic_xchg(flags_ptr + column, tl.zeros([BLOCK], tl.int32) + arrived, mask=live, sem="release", scope="sys")
    # Wait for every peer's column in my own row.
    mine = flags_ptr + row * RANKS + peer
    start = tl.zeros([], tl.int64)
    if TIMED:
        start = _now()
    polls = tl.zeros([], tl.int64)
    elapsed = tl.zeros([], tl.int64)
    # Only scalars cross loop iterations (a carried mask trips Triton 3.6's layout passes).
    absent = tl.sum(live.to(tl.int32), 0)
    while (absent > 0) & (elapsed < budget):
        seen = tl.atomic_add(mine, 0, mask=live, sem="acquire", scope="sys")
        absent = tl.sum((live & (seen != arrived)).to(tl.int32), 0)
        polls += 1
        elapsed = _elapsed(start, polls, TIMED)
    # One more read names the absent peers (one that arrived meanwhile is not missing after all).
    seen = tl.atomic_add(mine, 0, mask=live, sem="acquire", scope="sys")
    waiting = live & (seen != arrived)
    previous = tl.load(missing_ptr + peer, mask=live, other=0)
    tl.store(missing_ptr + peer, previous | waiting.to(tl.int32), mask=live)


def cross_rank_barrier(
    flags: torch.Tensor,
    flag_peers: torch.Tensor,
    state: torch.Tensor,
    missing: torch.Tensor,
    rank: int,
    timeout_s: float,
) -> None:
    """Launch one barrier on the current stream (asynchronous: nothing is read back here).

    Args:
        flags: this process's copy of the symmetric flag table, ``int32 [2, R]``, zero-initialised
            on every rank before the first barrier.
        flag_peers: ``[R] int64`` element offsets of every rank's ``flags`` from this one.
        state: ``int32 [1]`` barriers launched so far by this process (on ``flags``'s device).
        missing: ``int32 [R]``; the kernel ORs ``1`` into ``missing[p]`` for every rank ``p`` that
            had not arrived when the time budget ran out (sticky: never cleared here).
        rank: this process's rank in the group.
        timeout_s: time budget, measured on the GPU's global timer. The CPU interpreter (used only to
            test the protocol) has no device clock: there the budget counts polls,
            ``max(1, int(timeout_s * 1000))`` of them.
    """
    ranks = flags.shape[-1]
    if tuple(flags.shape) != (2, ranks) or flags.dtype != torch.int32:
        raise ValueError(f"flags must be int32 [2, R], got {flags.dtype} {list(flags.shape)}")
    if not 0 <= rank < ranks:
        raise ValueError(f"rank must be in [0, {ranks}), got {rank}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    timed = flags.is_cuda
    budget = int(timeout_s * 1e9) if timed else max(1, int(timeout_s * 1000))
    _barrier_kernel[(1,)](
        flags, flag_peers, state, missing, rank, budget,
        RANKS=ranks, BLOCK=max(32, triton.next_power_of_2(ranks)), TIMED=timed, num_warps=1,
    )
