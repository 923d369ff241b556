"""The sync-free GPU planner: Triton kernels bit-equal to the reference planner.

:func:`make_plan_triton` plans a whole group of virtual ranks (rank = a grid axis);
:func:`count_rank_triton` counts one rank's entries before the histogram exchange (one process
per GPU: the row it contributes, and the stable ranks it keeps), and :func:`plan_rank_triton`
plans that rank from the gathered ``[R, E]`` histogram. Each output equals the one of
:func:`flatep.plan.make_plan` / :func:`flatep.plan.plan_rank` bit for bit
(``tests/plan/test_triton.py``).

Nothing here reads a device tensor on the host: every shape follows from the config and ``s``,
work is split into a few launches of fixed grids, and a call can be captured in a CUDA graph.
The kernels (MoonEP's planner, Kimi-K3 technical report §5.2.1, made sync-free):

* **count** (one program per segment of up to 8 tiles of ``TILE`` entries of a rank): the stable
  rank of each entry among the equal ids of its segment (per tile a compare matrix, ties by flat
  ``(t, k)`` index, plus the running count of the segment's earlier tiles) and the segment's
  dense expert histogram, one row per segment. From ``SORTED_COUNT_ENTRIES`` entries per rank a
  segment is sorted instead: ranks are places in runs of equal ids, counts the runs' lengths.
* **scan** (one program per slice of experts and rank): exclusive prefix of those rows over the
  segments of a rank, so that row ``b`` holds the entries of each expert in segments ``< b``; the
  totals are the rank's histogram. Skipped when a rank's entries fit in one segment.
* **layout** (one program per rank ``d``): the global tables. Every program sums the gathered
  histogram, repeats the step-A balancer (a handful of rounds over ``R`` balances), runs the
  step-B split of its own experts (donor role: writes its rows of ``alloc``) and repeats the split
  of its donor, if any, to learn which experts it borrows (receiver role), then lays out its shard
  (step C). Repeating the tiny serial parts in every program is what lets one launch do all of it
  without waiting on others.
* **staged layout**, for ``R > 32`` ranks, where that repetition costs ``O(R)`` per program and
  ``O(R^2)`` over the grid: the same tables in four launches that do each part once, the scan
  over source ranks (``before`` and the global counts), step A (one program), step B (one program
  per donor) and step C (one program per rank, reading what it borrows from ``alloc``).
* **destination** (one program per block of tokens): global position of each entry (entries of
  its expert on lower source ranks + earlier segments + rank in segment), binary search over the
  cumulative allocation ``acum[e, :]`` for the destination, the row inside that destination's
  group, and then, as a token's entries are all in the program, its carriers and send order.

On Hopper and later GPUs the layout and destination launches use programmatic dependent launch
(:data:`PDL_LAUNCHES`): in a CUDA graph their programs are placed while the previous kernel runs
and wait on the device for its results.

A rank counts in two launches (one when its entries fit in one segment) before the exchange and
plans in two after it (layout, destination); the group planner uses four (three). The staged
layout adds three launches to either. Ties break toward the smallest index everywhere, as in the
reference. Limits: ``R <= 256``, ``E <= 2048``, ``R*s*K < 2**31`` (entry indices are int32).

Data checks that need the device's data are not made here (they would synchronise): ids of real
tokens outside ``[0, E)`` are not counted and are planned as ``-1`` (the reference raises
instead), and ``plan_rank_triton`` trusts that the gathered histogram matches the local ids. The
kernels take ``T*K`` (and the group padding that follows from it) from the histogram, never from
the host: a step whose ranks hold different numbers of real tokens plans without reading the
group's total back. Callers that need those checks run the reference planner or check on the
device. Shapes, dtypes, devices and host integers are validated before any kernel runs.
"""
from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.runtime.interpreter import InterpretedFunction

from flatep.config import TOLERANCE_SCALE as _TOLERANCE_SCALE
from flatep.config import MIN_STEP_ALIGN as _MIN_STEP_ALIGN
from flatep.config import EPConfig, check_policy
from flatep.plan.auto import AutoChoice, candidates_for, choose, slot_rows
from flatep.plan.cost import CostProfile, check_cost
from flatep.plan.cost_triton import choose_triton, predict_triton
from flatep.plan.reference import _check_ids, _token_counts
from flatep.plan.types import Plan, RankPlan

# Policy codes of the layout kernel's POLICY.
_POLICY_CODES = {"none": 0, "exact": 1, "bounded": 2}
TOLERANCE_SCALE: tl.constexpr = tl.constexpr(_TOLERANCE_SCALE)
MIN_STEP_ALIGN: tl.constexpr = tl.constexpr(_MIN_STEP_ALIGN)
MAX_RANKS = 256
MAX_EXPERTS = 2048
# Up to this many ranks every layout program sums the [R, E] histogram and repeats step A and its
# donor's split itself (O(R) work per program, fewest launches); beyond it the staged layout does
# each once, in separate launches, instead of O(R^2) work over the grid.
_FUSED_MAX_RANKS = 32
# Columns of the compare matrix handled at once: [TILE, 32] int32 keeps ~32 values per thread.
_COMPARE_CHUNK = 32
# Experts per program of the scan: 8 int32 = one 32-byte sector per row, and E/8 programs.
_SCAN_EXPERTS = 8
_SCAN_ROWS = 1024
# The count kernel's segments: about this many per rank at large steps, each at most this many
# tiles long (the tiles of a segment run one after another in one program).
_SEGMENTS_PER_RANK = 512
_MAX_SEGMENT_TILES = 8
# From this many entries per rank (s*K) the count sorts each segment of _SORTED_SEGMENT entries
# (_LONG_SORTED_SEGMENT from _LONG_SORTED_ENTRIES) instead of walking its tiles. Measured on the
# H200, whole per-rank planning (count + plan): Kimi-K3 at s = 1024 (16384 entries), 14.2 us
# sorting 256-entry segments against 14.6 us walking; at s = 2048, 14.8 against 17.0 us; at
# s = 8192, 19.5 us with 512-entry segments, 19.9 with 256, 25.9 walking; at s <= 512 walking is
# as fast or faster (Kimi-K2 s = 512: 13.0 against 13.1 us).
SORTED_COUNT_ENTRIES = 16384
_SORTED_SEGMENT = 256
_LONG_SORTED_ENTRIES = 131072
_LONG_SORTED_SEGMENT = 512
# Warps of the layout programs (their serial rounds are chains of reductions: fewer warps make
# each reduction cheaper) and of the count programs.
_LAYOUT_WARPS = 4
_COUNT_WARPS = 4
_SCAN_WARPS = 4
# The destination kernel's programs: up to 64 tokens and this many pairs (k, k') each. Measured on
# the H200 (destination launch of one rank): Kimi-K3, s = 8192, 5.6 us with 2048 pairs (8 tokens)
# against 6.2 us with 4096 and 14.7 us with 1024; Kimi-K3, s = 128, 2.7 against 3.4 us; Kimi-K2,
# s = 8192, 3.7 against 4.3 us.
_DESTINATION_PAIRS = 2048
_DESTINATION_WARPS = 4


def _pow2(value: int) -> int:
    return triton.next_power_of_2(max(int(value), 1))


def _tile_size(entries: int) -> int:
    """Entries per tile (one compare matrix) of the count kernel for ``entries = s*K`` per rank.

    The compare matrix costs ``TILE`` operations per entry; at large steps segments of several
    tiles keep the dense histogram rows (``E`` words per segment) few instead of larger tiles.
    Measured on the H200 (count + plan of one rank, Kimi-K3, s = 8192): 64-entry tiles in
    segments of 4 took 25.6 us, 128-entry tiles 27.4-30 us, 256-entry tiles 42 us and more.
    """
    return max(16, min(64, _pow2(entries)))


# ----------------------------------------------------------------------------------------------
# Device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _follow_previous_launch(PDL: tl.constexpr):
    """With ``PDL`` (programmatic dependent launch, see :data:`PDL_LAUNCHES`): wait until the
    previous launch has finished and its writes are visible, then let the next launch start.

    A kernel launched this way may start while the previous one still runs, so every planner
    kernel calls this before it touches memory that launch could write (first thing, except the
    destination kernel's loads of ids and ranks). Letting the next launch start only after the
    wait keeps at most two launches in flight: a kernel past its wait knows that every launch
    before the previous one has finished. Without ``PDL`` it does nothing.
    """
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _token_limit(tokens_ptr, token_limit, slab, PER_RANK: tl.constexpr):
    """Real tokens of slab ``slab``: ``tokens[slab]`` in per-rank mode, else the scalar."""
    if PER_RANK:
        return tl.load(tokens_ptr + slab)
    else:
        return token_limit


@triton.jit
def _tile_keys(ids_ptr, start, n_entries, token_limit, top_k, experts, SIZE: tl.constexpr):
    """Flat indices ``i``, comparison keys and validity of entries ``[start, start + SIZE)``.

    A valid entry (``i < n_entries``, token ``i // K < token_limit``, id in ``[0, E)``) has its id
    as key; any other gets the unique negative key ``-1 - i``, so it equals nothing but itself.
    """
    index = start + tl.arange(0, SIZE)
    inside = index < n_entries
    ids = tl.load(ids_ptr + index, mask=inside, other=-1)
    valid = inside & (index // top_k < token_limit) & (ids >= 0) & (ids < experts)
    key = tl.where(valid, ids, -1 - index).to(tl.int32)
    return index, key, valid


@triton.jit
def _rank_in_tile(ids_ptr, start, n_entries, token_limit, top_k, experts, TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Per entry of a tile: ``earlier`` equal keys before it (its stable rank) and ``same`` in all."""
    index, key, valid = _tile_keys(ids_ptr, start, n_entries, token_limit, top_k, experts, TILE)
    earlier = tl.zeros([TILE], tl.int32)
    same = tl.zeros([TILE], tl.int32)
    for chunk in tl.static_range(TILE // CHUNK):
        # Reloading the column keys (an L1 hit) is how Triton gets them in the other axis.
        other, other_key, _ = _tile_keys(ids_ptr, start + chunk * CHUNK, n_entries, token_limit, top_k, experts, CHUNK)
        equal = key[:, None] == other_key[None, :]
        earlier += tl.sum((equal & (other[None, :] < index[:, None])).to(tl.int32), axis=1)
        same += tl.sum(equal.to(tl.int32), axis=1)
    return index, key, valid, earlier, same


@triton.jit
def _count_segment(
    ids_ptr, counts_ptr, ranks_ptr, segment, n_entries, token_limit, top_k, experts,
    TILE: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    """Stable rank of each entry of ``segment`` (``TILES`` tiles of ``TILE`` entries, in order)
    among the equal ids of the segment (into ``ranks_ptr``) and the segment's dense histogram.

    ``ids_ptr``/``ranks_ptr`` point at one rank's flat entries, ``counts_ptr`` at that rank's
    ``[segments, E]`` rows. The row is the running count while the tiles go by: an entry's rank is
    the row's count of its expert (earlier tiles) plus its rank in its tile, and the last entry of
    each expert in the tile writes the new count. Segments longer than one tile keep the rows (and
    the scan over them) short at large steps.
    """
    # int64: the segment rows of a rank hold segments*E words, past 2**31 for long steps at large E.
    row = counts_ptr + segment.to(tl.int64) * experts
    expert = tl.arange(0, BLOCK_E)
    tl.store(row + expert, tl.zeros([BLOCK_E], tl.int32), mask=expert < experts)
    for tile in range(TILES):
        # Every thread's writes to the row (the zeros, the last tile's counts) land before any reads it.
        tl.debug_barrier()
        index, key, valid, earlier, same = _rank_in_tile(
            ids_ptr, (segment * TILES + tile) * TILE, n_entries, token_limit, top_k, experts, TILE, CHUNK
        )
        before = tl.load(row + key, mask=valid, other=0)
        tl.store(ranks_ptr + index, before + earlier, mask=valid)
        # Every thread has read the row before the last entry of each expert updates it.
        tl.debug_barrier()
        tl.store(row + key, before + same, mask=valid & (earlier == same - 1))


@triton.jit
def _run_length(key_a, count_a, key_b, count_b):
    """Scan step over sorted keys: entries of the run of ``key_b`` up to and including ``b``."""
    return key_b, tl.where(key_a == key_b, count_a + count_b, count_b)


@triton.jit
def _count_sorted_segment(
    ids_ptr, counts_ptr, ranks_ptr, segment, n_entries, token_limit, top_k, experts,
    SEGMENT: tl.constexpr, LOG_SEGMENT: tl.constexpr, BINS: tl.constexpr,
):
    """:func:`_count_segment` by sorting: the same ranks and histogram row of ``SEGMENT`` entries.

    Sorting ``key * SEGMENT + position`` orders the entries by expert, ties by flat index, so an
    entry's rank among the equal ids before it is its place in its run of equal keys (a segmented
    scan over the sorted keys), and the same scan run backwards gives, at a run's first entry, the
    run's length: the expert's count in the row. Invalid entries take key ``E`` and are not
    stored; ``BINS >= E``. (The backward scan replaced ``tl.histogram``: on the H200 at Kimi-K3,
    s = 8192, the count launch took 4.7 us instead of 9.0 us.)
    """
    position = tl.arange(0, SEGMENT)
    index = segment * SEGMENT + position
    inside = index < n_entries
    ids = tl.load(ids_ptr + index, mask=inside, other=-1)
    valid = inside & (index // top_k < token_limit) & (ids >= 0) & (ids < experts)
    key = tl.where(valid, ids, experts).to(tl.int32)
    row = counts_ptr + segment.to(tl.int64) * experts
    bins = tl.arange(0, BINS)
    tl.store(row + bins, tl.zeros([BINS], tl.int32), mask=bins < experts)
    ordered = tl.sort(key * SEGMENT + position)
    ordered_key = ordered >> LOG_SEGMENT
    ones = tl.full([SEGMENT], 1, tl.int32)
    _, run = tl.associative_scan((ordered_key, ones), 0, _run_length)
    _, run_length = tl.associative_scan((ordered_key, ones), 0, _run_length, reverse=True)
    counted = ordered_key < experts
    tl.store(ranks_ptr + segment * SEGMENT + (ordered & (SEGMENT - 1)), run - 1, mask=counted)
    # Every thread's zeros land before any run's count.
    tl.debug_barrier()
    tl.store(row + ordered_key, run_length, mask=counted & (run == 1))


@triton.jit
def _split_donor(
    remaining, quota, me, max_steps,
    TAKES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
):
    """Step B for one donor: its hottest remaining expert fills the receiver with most quota left.

    ``remaining [BLOCK_EPN]``: the donor's expert counts (``-1`` beyond ``epn``); ``quota
    [BLOCK_R]``: rows it owes each receiver (``-1`` beyond ``R``). Returns the counts left at home,
    ``mine [BLOCK_EPN]`` (what receiver ``me`` took from each expert) and, with ``TAKES`` (donor
    role), ``takes [BLOCK_EPN, BLOCK_R]``, every take (each pair is taken at most once; zeros
    without ``TAKES``). Without ``TAKES`` (receiver role) the loop stops as soon as ``me`` is
    served. The takes stay in registers and the caller stores them once: a store per step was on
    the loop's critical path. Arg-maxima pack ``(value, reversed index)`` into one int64 so that a
    single reduction breaks ties toward the smallest index.
    """
    lane_r = tl.arange(0, BLOCK_R)
    lane_j = tl.arange(0, BLOCK_EPN)
    mine = tl.zeros([BLOCK_EPN], tl.int32)
    takes = tl.zeros([BLOCK_EPN, BLOCK_R], tl.int32)
    top_quota = tl.max(quota.to(tl.int64) * BLOCK_R + (BLOCK_R - 1 - lane_r), axis=0)
    owed = (top_quota // BLOCK_R).to(tl.int32)
    steps = 0
    waiting = 1
    if not TAKES:
        waiting = tl.sum(tl.where(lane_r == me, quota, 0), axis=0)
    # Each step empties a quota or an expert, so a consistent histogram stops within epn + R - 1
    # steps; max_steps only bounds the loop when the histogram is inconsistent.
    while (owed > 0) & (steps < max_steps) & (waiting > 0):
        receiver = (BLOCK_R - 1 - top_quota % BLOCK_R).to(tl.int32)
        top_expert = tl.max(remaining.to(tl.int64) * BLOCK_EPN + (BLOCK_EPN - 1 - lane_j), axis=0)
        local = (BLOCK_EPN - 1 - top_expert % BLOCK_EPN).to(tl.int32)
        take = tl.minimum((top_expert // BLOCK_EPN).to(tl.int32), owed)
        remaining = tl.where(lane_j == local, remaining - take, remaining)
        quota = tl.where(lane_r == receiver, quota - take, quota)
        if TAKES:
            takes = tl.where((lane_j[:, None] == local) & (lane_r[None, :] == receiver), take, takes)
        mine = tl.where((lane_j == local) & (receiver == me), mine + take, mine)
        if not TAKES:
            waiting -= tl.where(receiver == me, take, 0)
        top_quota = tl.max(quota.to(tl.int64) * BLOCK_R + (BLOCK_R - 1 - lane_r), axis=0)
        owed = (top_quota // BLOCK_R).to(tl.int32)
        steps += 1
    return remaining, mine, takes


@triton.jit
def _home_grid(experts_per_rank, RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr):
    """The ``[home rank, local expert]`` view of the E experts: lanes, masks and expert ids."""
    lane_r = tl.arange(0, BLOCK_R)
    lane_j = tl.arange(0, BLOCK_EPN)
    in_r = lane_r < RANKS
    in_j = lane_j < experts_per_rank
    in_grid = in_r[:, None] & in_j[None, :]
    expert = lane_r[:, None] * experts_per_rank + lane_j[None, :]
    return lane_r, lane_j, in_r, in_j, in_grid, expert


@triton.jit
def _step_sizes(count, experts, max_align):
    """``T*K`` and the step's group padding from the global counts ``[BLOCK_R, BLOCK_EPN]``.

    The padding is :meth:`flatep.EPConfig.step_align` of ``T`` (``max_align`` = ``config.align``):
    the power of two at or above ``ceil(T*K/E)``, within ``[min(16, align), align]``. Taking ``T``
    from the gathered histogram, never from the host, lets a step whose ranks hold different
    numbers of real tokens plan without reading the group's total back.
    """
    entries = tl.sum(tl.sum(count, axis=1), axis=0)
    below = tl.maximum((entries + experts - 1) // experts, 1) - 1
    for shift in tl.static_range(5):
        below |= below >> (1 << shift)
    return entries, tl.minimum(max_align, tl.maximum(tl.minimum(MIN_STEP_ALIGN, max_align), below + 1))


@triton.jit
def _step_a(
    count, total_entries, tol_fixed,
    RANKS: tl.constexpr, POLICY, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
):
    """Step A from the global counts ``[BLOCK_R, BLOCK_EPN]`` (home rank, local expert).

    Returns ``donor_of [BLOCK_R]`` (each receiver's donor, ``-1`` for none) and ``quota_in
    [BLOCK_R]`` (the rows it receives). ``tol_fixed`` is the config's tolerance in fixed point:
    the bound of :func:`flatep.config.rows_bound` is computed from ``total_entries`` here.
    """
    lane_r = tl.arange(0, BLOCK_R)
    in_r = lane_r < RANKS
    donor_of = tl.full([BLOCK_R], -1, tl.int32)
    quota_in = tl.zeros([BLOCK_R], tl.int32)
    if POLICY != 0:
        # The bound in int64 (the product reaches 2**61), clamped to T*K before it narrows
        # to int32: no load exceeds T*K, so every comparison below gives the same answer.
        entries = tl.zeros([], tl.int64) + total_entries
        limit = tl.minimum(entries * (TOLERANCE_SCALE + tol_fixed) // (RANKS * TOLERANCE_SCALE), entries)
        limit = limit.to(tl.int32)
        load = tl.sum(count, axis=1)
        busiest = tl.max(tl.where(in_r, load, 0), axis=0)
        if POLICY == 1:
            # exact: every rank's share of T*K, unless the busiest rank stays within the limit.
            capacity = total_entries // RANKS + (lane_r < total_entries % RANKS).to(tl.int32)
            balance = tl.where(busiest > limit, load - capacity, 0)
        else:
            # bounded: ranks above b drop to b, their surplus X water-fills the least loaded
            # ranks up to the largest level L <= b with fill(L) <= X, and what is left goes +1
            # to the ranks at level L, smallest index first (flatep.plan.policy.bounded_targets).
            bound = tl.maximum(limit, (total_entries + RANKS - 1) // RANKS)
            surplus = tl.sum(tl.where(in_r & (load > bound), load - bound, 0).to(tl.int64), axis=0)
            low = tl.zeros([], tl.int32)
            high = bound
            while low < high:
                middle = low + (high - low + 1) // 2
                fill = tl.sum(tl.where(in_r, tl.maximum(middle - load, 0), 0).to(tl.int64), axis=0)
                fits = fill <= surplus
                low = tl.where(fits, middle, low)
                high = tl.where(fits, high, middle - 1)
            level = low
            target = tl.where(load > bound, bound, tl.maximum(load, level))
            left = surplus - tl.sum(tl.where(in_r, tl.maximum(level - load, 0), 0).to(tl.int64), axis=0)
            at_level = in_r & (target == level) & (level < bound)
            order = tl.cumsum(at_level.to(tl.int32), axis=0)
            target = tl.where(at_level & (order <= left), target + 1, target)
            balance = tl.where(in_r, load - target, 0)
        # Pair the most overloaded rank with the most underloaded one (smallest index on ties)
        # and move the receiver's whole deficit; each receiver is filled once.
        # Balances are packed as (balance + 2**32, index) into int64 keys (|balance| < 2**31), so
        # one reduction gives both the extreme value and its smallest index.
        top = tl.max(tl.where(in_r, (balance.to(tl.int64) + 2**32) * BLOCK_R + (BLOCK_R - 1 - lane_r), -1), axis=0)
        rounds = 0
        while (top // BLOCK_R > 2**32) & (rounds < RANKS):
            donor = (BLOCK_R - 1 - top % BLOCK_R).to(tl.int32)
            bottom = tl.min(tl.where(in_r, (balance.to(tl.int64) + 2**32) * BLOCK_R + lane_r, 2**62), axis=0)
            receiver = (bottom % BLOCK_R).to(tl.int32)
            low = (bottom // BLOCK_R - 2**32).to(tl.int32)
            balance = tl.where(lane_r == donor, balance + low, balance)
            balance = tl.where(lane_r == receiver, 0, balance)
            donor_of = tl.where(lane_r == receiver, donor, donor_of)
            quota_in = tl.where(lane_r == receiver, -low, quota_in)
            top = tl.max(tl.where(in_r, (balance.to(tl.int64) + 2**32) * BLOCK_R + (BLOCK_R - 1 - lane_r), -1), axis=0)
            rounds += 1
    return donor_of, quota_in


@triton.jit
def _donor_split(
    d, count, donor_of, quota_in, alloc_ptr, experts_per_rank,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
):
    """Step B, donor role: rows ``alloc[e, :]`` of ``d``'s home experts (what moves where).

    Stores those rows and returns the rows each home expert keeps ``[BLOCK_EPN]``, the rows
    themselves ``[BLOCK_EPN, BLOCK_R]`` and their mask.
    """
    lane_r, lane_j, in_r, in_j, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    own = tl.sum(tl.where(lane_r[:, None] == d, count, 0), axis=0)
    own_quota = tl.where(in_r, tl.where(donor_of == d, quota_in, 0), -1)
    home, _, takes = _split_donor(
        tl.where(in_j, own, -1), own_quota, d, experts_per_rank + RANKS, True, BLOCK_R, BLOCK_EPN,
    )
    home = tl.where(in_j, home, 0)
    # A donor never takes for itself (its own quota is 0), so its column holds what stays home.
    alloc_rows = tl.where(lane_r[None, :] == d, home[:, None], takes)
    block = alloc_ptr + (d * experts_per_rank + lane_j[:, None]) * RANKS + lane_r[None, :]
    in_block = in_j[:, None] & in_r[None, :]
    tl.store(block, alloc_rows, mask=in_block)
    return home, alloc_rows, in_block


@triton.jit
def _shard_layout(
    d, home, mine, my_donor, experts, experts_per_rank, align,
    slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr, group_start_ptr,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
):
    """Step C for rank ``d`` from the rows it keeps (``home``) and borrows from ``my_donor`` (``mine``).

    Groups = home experts, then borrowed experts ascending (all from one donor), each padded to a
    multiple of ``align``; offsets are inclusive ends, empty groups take no rows.
    """
    lane_r, lane_j, in_r, in_j, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    groups = 2 * experts_per_rank
    home_padded = (home + align - 1) // align * align
    home_end = tl.cumsum(home_padded, axis=0)
    home_start = home_end - home_padded
    home_rows = tl.sum(home_padded, axis=0)
    borrowed = mine > 0
    slot = tl.cumsum(borrowed.to(tl.int32), axis=0) - 1
    n_slots = tl.sum(borrowed.to(tl.int32), axis=0)
    slot_padded = (mine + align - 1) // align * align
    slot_end = home_rows + tl.cumsum(slot_padded, axis=0)
    slot_start = slot_end - slot_padded
    used_rows = home_rows + tl.sum(slot_padded, axis=0)
    foreign_id = my_donor * experts_per_rank + lane_j
    empty_slot = in_j & (lane_j >= n_slots)

    group = d * groups + lane_j
    tl.store(offsets_ptr + group, home_end, mask=in_j)
    tl.store(groups_ptr + group, d * experts_per_rank + lane_j, mask=in_j)
    home_pads = home_padded > home
    tl.store(padding_ptr + 2 * group, tl.where(home_pads, home_start + home, 0), mask=in_j)
    tl.store(padding_ptr + 2 * group + 1, tl.where(home_pads, home_padded - home, 0), mask=in_j)

    slot_group = d * groups + experts_per_rank + slot
    tl.store(offsets_ptr + slot_group, slot_end, mask=borrowed)
    tl.store(groups_ptr + slot_group, foreign_id, mask=borrowed)
    tl.store(slots_ptr + d * experts_per_rank + slot, foreign_id, mask=borrowed)
    slot_pads = slot_padded > mine
    tl.store(padding_ptr + 2 * slot_group, tl.where(slot_pads, slot_start + mine, 0), mask=borrowed)
    tl.store(padding_ptr + 2 * slot_group + 1, tl.where(slot_pads, slot_padded - mine, 0), mask=borrowed)

    empty_group = d * groups + experts_per_rank + lane_j
    tl.store(offsets_ptr + empty_group, tl.zeros([BLOCK_EPN], tl.int32) + used_rows, mask=empty_slot)
    tl.store(groups_ptr + empty_group, tl.full([BLOCK_EPN], -1, tl.int32), mask=empty_slot)
    tl.store(slots_ptr + d * experts_per_rank + lane_j, tl.full([BLOCK_EPN], -1, tl.int32), mask=empty_slot)
    tl.store(padding_ptr + 2 * empty_group, tl.zeros([BLOCK_EPN], tl.int32), mask=empty_slot)
    tl.store(padding_ptr + 2 * empty_group + 1, tl.zeros([BLOCK_EPN], tl.int32), mask=empty_slot)

    tl.store(received_ptr + d, tl.sum(home, axis=0) + tl.sum(mine, axis=0))
    start = tl.where(
        (lane_r[:, None] == d) & (home > 0)[None, :],
        home_start[None, :],
        tl.where((lane_r[:, None] == my_donor) & borrowed[None, :], slot_start[None, :], -1),
    )
    tl.store(group_start_ptr + d * experts + expert, start, mask=in_grid)


@triton.jit
def _layout(
    d, hist_ptr, tol_fixed, experts, experts_per_rank, max_align,
    alloc_ptr, acum_ptr, before_ptr, slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr,
    group_start_ptr,
    RANKS: tl.constexpr, POLICY, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
):
    """Program ``d`` of the fused layout (``R <= _FUSED_MAX_RANKS``): every table row of rank ``d``.

    Writes ``alloc[e, :]`` and ``acum[e, :]`` for ``d``'s home experts, ``before[d, :]`` (entries
    of each expert on source ranks ``< d``) and rank ``d``'s rows of the slot and group tables,
    offsets, padding, received and group_start (steps A-C of :mod:`flatep.plan.policy`). The
    program sums the histogram (``T*K`` and the group padding follow from it) and repeats step A
    and its donor's split itself: ``O(R)`` work that is cheap for a few ranks and saves the
    launches of the staged layout.
    """
    lane_r, lane_j, in_r, in_j, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    count = tl.zeros([BLOCK_R, BLOCK_EPN], tl.int32)
    before = tl.zeros([BLOCK_R, BLOCK_EPN], tl.int32)
    # Unrolled, so that the R loads are in flight together rather than one latency each.
    for source in tl.static_range(RANKS):
        row = tl.load(hist_ptr + source * experts + expert, mask=in_grid, other=0)
        count += row
        before += tl.where(source < d, row, 0)
    tl.store(before_ptr + d * experts + expert, before, mask=in_grid)

    entries, align = _step_sizes(count, experts, max_align)
    donor_of, quota_in = _step_a(count, entries, tol_fixed, RANKS, POLICY, BLOCK_R, BLOCK_EPN)
    home, alloc_rows, in_block = _donor_split(
        d, count, donor_of, quota_in, alloc_ptr, experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN,
    )

    # Step B, receiver role: repeat the split of d's donor (if any) to learn what d borrows.
    my_donor = tl.sum(tl.where(lane_r == d, donor_of, 0), axis=0)
    donor_quota = tl.where(in_r, tl.where((donor_of == my_donor) & (my_donor >= 0), quota_in, 0), -1)
    donor_count = tl.sum(tl.where(lane_r[:, None] == my_donor, count, 0), axis=0)
    _, mine, _ = _split_donor(
        tl.where(in_j, donor_count, -1), donor_quota, d, experts_per_rank + RANKS, False, BLOCK_R, BLOCK_EPN,
    )
    mine = tl.where(in_j, mine, 0)
    _shard_layout(
        d, home, mine, my_donor, experts, experts_per_rank, align,
        slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr, group_start_ptr, RANKS, BLOCK_R, BLOCK_EPN,
    )
    acum_block = acum_ptr + (d * experts_per_rank + lane_j[:, None]) * RANKS + lane_r[None, :]
    tl.store(acum_block, tl.cumsum(alloc_rows, axis=1), mask=in_block)


# ----------------------------------------------------------------------------------------------
# Kernels (one per launch)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _count_kernel(
    ids_ptr, counts_ptr, ranks_ptr, tokens_ptr, token_limit, n_entries, n_segments, top_k, experts,
    TILE: tl.constexpr, TILES: tl.constexpr, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, PER_RANK: tl.constexpr,
    SORTED: tl.constexpr, LOG_SEGMENT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Segment ``program_id(0)`` of slab ``program_id(1)`` (a rank's entries); ``SORTED``: by sorting."""
    _follow_previous_launch(PDL)
    slab = tl.program_id(1)
    ids_ptr += slab * n_entries
    counts_ptr += slab.to(tl.int64) * n_segments * experts
    ranks_ptr += slab * n_entries
    token_limit = _token_limit(tokens_ptr, token_limit, slab, PER_RANK)
    if SORTED:
        _count_sorted_segment(ids_ptr, counts_ptr, ranks_ptr, tl.program_id(0), n_entries, token_limit, top_k, experts,
                              TILE * TILES, LOG_SEGMENT, BLOCK_E)
    else:
        _count_segment(ids_ptr, counts_ptr, ranks_ptr, tl.program_id(0), n_entries, token_limit, top_k, experts,
                       TILE, TILES, CHUNK, BLOCK_E)


@triton.jit
def _scan_kernel(
    counts_ptr, prefix_ptr, hist_ptr, n_rows, experts,
    ROWS: tl.constexpr, BLOCK_EC: tl.constexpr, WRITE_HIST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Rows ``[n_rows, E]`` of slab ``program_id(1)`` -> their exclusive prefix over rows into
    ``prefix_ptr`` (``counts_ptr`` itself for the segment rows, in place); totals -> ``hist[slab]``.

    Slabs are a rank's segment rows (per-segment histograms) or, for the staged layout, the gathered
    ``[R, E]`` histogram as one slab (entries of each expert on lower source ranks, and ``count``).
    """
    _follow_previous_launch(PDL)
    rank = tl.program_id(1).to(tl.int64)
    expert = tl.program_id(0) * BLOCK_EC + tl.arange(0, BLOCK_EC)
    in_e = expert < experts
    carry = tl.zeros([BLOCK_EC], tl.int32)
    for first in range(0, n_rows, ROWS):
        row = first + tl.arange(0, ROWS)
        mask = (row < n_rows)[:, None] & in_e[None, :]
        offset = (rank * n_rows + row)[:, None] * experts + expert[None, :]
        value = tl.load(counts_ptr + offset, mask=mask, other=0)
        tl.store(prefix_ptr + offset, tl.cumsum(value, axis=0) - value + carry[None, :], mask=mask)
        carry += tl.sum(value, axis=0)
    if WRITE_HIST:
        tl.store(hist_ptr + rank * experts + expert, carry, mask=in_e)


@triton.jit
def _layout_kernel(
    hist_ptr, tol_fixed, experts, experts_per_rank, max_align,
    alloc_ptr, acum_ptr, before_ptr, slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr,
    group_start_ptr, candidates_ptr, table_stride,
    RANKS: tl.constexpr, POLICY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
    CANDIDATES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Group planner: the layout, one program per rank (``program_id(0)``).

    With ``CANDIDATES > 1`` (``auto``), ``program_id(1)`` is a candidate: its policy code and
    tolerance are read from ``candidates [C, 2] int32`` and its tables lie ``table_stride``
    elements after the previous candidate's, so every candidate is planned in one launch.
    """
    _follow_previous_launch(PDL)
    if CANDIDATES > 1:
        candidate = tl.program_id(1)
        policy = tl.load(candidates_ptr + 2 * candidate)
        tolerance = tl.load(candidates_ptr + 2 * candidate + 1)
        shift = candidate.to(tl.int64) * table_stride
        _layout(
            tl.program_id(0), hist_ptr, tolerance, experts, experts_per_rank, max_align,
            alloc_ptr + shift, acum_ptr + shift, before_ptr + shift, slots_ptr + shift, groups_ptr + shift,
            offsets_ptr + shift, padding_ptr + shift, received_ptr + shift, group_start_ptr + shift,
            RANKS, policy, BLOCK_R, BLOCK_EPN,
        )
    else:
        _layout(
            tl.program_id(0), hist_ptr, tol_fixed, experts, experts_per_rank, max_align,
            alloc_ptr, acum_ptr, before_ptr, slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr,
            group_start_ptr, RANKS, POLICY, BLOCK_R, BLOCK_EPN,
        )


@triton.jit
def _balance_kernel(
    count_ptr, tol_fixed, experts, experts_per_rank, quotas_ptr,
    RANKS: tl.constexpr, POLICY: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Staged layout, one program: step A from ``count [E]`` into ``quotas [2, R]`` (donor of each
    receiver or ``-1``, then the rows it receives)."""
    _follow_previous_launch(PDL)
    lane_r, _, in_r, _, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    count = tl.load(count_ptr + expert, mask=in_grid, other=0)
    entries = tl.sum(tl.sum(count, axis=1), axis=0)
    donor_of, quota_in = _step_a(count, entries, tol_fixed, RANKS, POLICY, BLOCK_R, BLOCK_EPN)
    tl.store(quotas_ptr + lane_r, donor_of, mask=in_r)
    tl.store(quotas_ptr + RANKS + lane_r, quota_in, mask=in_r)


@triton.jit
def _split_kernel(
    count_ptr, quotas_ptr, alloc_ptr, acum_ptr, experts_per_rank,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Staged layout, one program per donor rank: step B, its rows of ``alloc`` and ``acum``."""
    _follow_previous_launch(PDL)
    d = tl.program_id(0)
    lane_r, lane_j, in_r, _, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    count = tl.load(count_ptr + expert, mask=in_grid, other=0)
    donor_of = tl.load(quotas_ptr + lane_r, mask=in_r, other=-1)
    quota_in = tl.load(quotas_ptr + RANKS + lane_r, mask=in_r, other=0)
    _, alloc_rows, in_block = _donor_split(d, count, donor_of, quota_in, alloc_ptr, experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    acum_block = acum_ptr + (d * experts_per_rank + lane_j[:, None]) * RANKS + lane_r[None, :]
    tl.store(acum_block, tl.cumsum(alloc_rows, axis=1), mask=in_block)


@triton.jit
def _shard_kernel(
    count_ptr, alloc_ptr, quotas_ptr, experts, experts_per_rank, max_align,
    slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr, group_start_ptr,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_EPN: tl.constexpr,
    PDL: tl.constexpr,
):
    """Staged layout, one program per rank ``d``: step C from the finished ``alloc``.

    What ``d`` keeps is column ``d`` of its home rows, what it borrows column ``d`` of its donor's.
    """
    _follow_previous_launch(PDL)
    d = tl.program_id(0)
    _, lane_j, _, in_j, in_grid, expert = _home_grid(experts_per_rank, RANKS, BLOCK_R, BLOCK_EPN)
    _, align = _step_sizes(tl.load(count_ptr + expert, mask=in_grid, other=0), experts, max_align)
    my_donor = tl.load(quotas_ptr + d)
    home = tl.load(alloc_ptr + (d * experts_per_rank + lane_j) * RANKS + d, mask=in_j, other=0)
    donor_expert = my_donor * experts_per_rank + lane_j
    mine = tl.load(alloc_ptr + donor_expert * RANKS + d, mask=in_j & (donor_expert >= 0), other=0)
    _shard_layout(
        d, home, mine, my_donor, experts, experts_per_rank, align,
        slots_ptr, groups_ptr, offsets_ptr, padding_ptr, received_ptr, group_start_ptr, RANKS, BLOCK_R, BLOCK_EPN,
    )

@triton.jit
def _destination_kernel(
    ids_ptr, counts_ptr, ranks_ptr, before_ptr, acum_ptr, group_start_ptr, dest_rank_ptr, dest_row_ptr,
    carrier_ptr, order_ptr, tokens_ptr, token_limit, first_rank, n_tokens, n_segments, experts, ranks,
    K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_R: tl.constexpr,
    LOG_R: tl.constexpr, SCANNED: tl.constexpr, PER_RANK: tl.constexpr, DEDUP: tl.constexpr,
    PDL: tl.constexpr,
):
    """Destination rank and row of every entry of ``BLOCK_T`` tokens (``program_id(0)``) of slab
    ``program_id(1)``, then those tokens' carriers and send order (the reference's
    :func:`~flatep.plan.reference.dedup_tables`): one launch for both, as a token's entries are all here.

    Slab ``j`` holds the entries of source rank ``first_rank + j``. ``ranks`` holds each valid
    entry's rank in its count segment of ``SEGMENT`` entries (from the count kernel; ``ranks`` may be
    ``dest_row`` itself, each entry is read before it is written). With ``SCANNED``, ``counts`` holds
    per segment the entries of each expert in earlier segments; without, a slab is a single segment.
    Carriers and send order are pairwise over each token's ``K`` entries (``[BLOCK_T, K, K]``): an
    entry's carrier is the smallest ``k'`` with its destination (its own ``k`` without ``DEDUP``); its
    send position is the number of planned entries before it in (destination, ``k``) order.
    """
    slab = tl.program_id(1)
    source = first_rank + slab
    n_entries = n_tokens * K
    ids_ptr += slab * n_entries
    ranks_ptr += slab * n_entries
    dest_rank_ptr += slab * n_entries
    dest_row_ptr += slab * n_entries
    carrier_ptr += slab * n_entries
    order_ptr += slab * n_entries
    counts_ptr += slab.to(tl.int64) * n_segments * experts
    token = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    inside = (token < n_tokens)[:, None] & (k < K)[None, :]
    index = token[:, None] * K + k[None, :]  # [BLOCK_T, BLOCK_K]
    ids = tl.load(ids_ptr + index, mask=inside, other=-1)
    limit = _token_limit(tokens_ptr, token_limit, slab, PER_RANK)
    valid = inside & (token < limit)[:, None] & (ids >= 0) & (ids < experts)
    expert = tl.where(valid, ids, 0).to(tl.int32)
    position = tl.load(ranks_ptr + index, mask=valid, other=0)
    # The ids and ranks are loaded before the wait: the previous launch is always a layout (or
    # auto's choice), which writes neither, and it let this one start only past its own wait (or
    # once done), when the count that wrote the ranks had finished.
    _follow_previous_launch(PDL)
    position += tl.load(before_ptr + source * experts + expert, mask=valid, other=0)
    if SCANNED:
        position += tl.load(counts_ptr + (index // SEGMENT).to(tl.int64) * experts + expert, mask=valid, other=0)
    # Number of destinations whose cumulative allocation is <= position (binary lifting over the
    # non-decreasing acum[e, :]): the first d with acum[e, d] > position.
    dest = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for level in tl.static_range(LOG_R):
        step = BLOCK_R >> (level + 1)
        probe = dest + step - 1
        ok = valid & (probe < ranks)
        bound = tl.load(acum_ptr + expert * ranks + probe, mask=ok, other=0)
        dest = tl.where(ok & (bound <= position), dest + step, dest)
    dest = tl.minimum(dest, ranks - 1)
    chunk_start = tl.load(acum_ptr + expert * ranks + dest - 1, mask=valid & (dest > 0), other=0)
    row = tl.load(group_start_ptr + dest * experts + expert, mask=valid, other=0) + position - chunk_start
    dest = tl.where(valid, dest, -1)
    tl.store(dest_rank_ptr + index, dest, mask=inside)
    tl.store(dest_row_ptr + index, tl.where(valid, row, -1), mask=inside)

    mine, other = dest[:, :, None], dest[:, None, :]  # entry k on axis 1, entry k' on axis 2
    k_other = k[None, None, :]
    if DEDUP:
        carrier = tl.min(tl.where((mine == other) & valid[:, None, :], k_other, BLOCK_K), axis=2)
    else:
        carrier = tl.zeros([BLOCK_T, BLOCK_K], tl.int32) + k[None, :]
    tl.store(carrier_ptr + index, tl.where(valid, carrier, -1), mask=inside)
    before = valid[:, None, :] & ((other < mine) | ((other == mine) & (k_other < k[None, :, None])))
    order = tl.sum(before.to(tl.int32), axis=2)
    count = tl.sum(valid.to(tl.int32), axis=1)
    tl.store(order_ptr + token[:, None] * K + order, tl.zeros([BLOCK_T, BLOCK_K], tl.int32) + k[None, :],
             mask=inside & valid)
    tl.store(order_ptr + index, tl.full([BLOCK_T, BLOCK_K], -1, tl.int32), mask=inside & (k[None, :] >= count[:, None]))


def _launch_destinations(
    ids: torch.Tensor, segment_prefix: torch.Tensor, entry_ranks: torch.Tensor, tables: "_Tables",
    dest_row: torch.Tensor, token_limits: torch.Tensor, token_limit: int, first_rank: int, segments: int,
    config: EPConfig, meta: dict[str, int], per_rank: bool,
) -> dict[str, object]:
    """The plan's entry tables of ``ids [n, s, K]`` (or ``[s, K]``), one launch: ``dest_rank``,
    ``dest_row`` (written into ``dest_row``, which may hold ``entry_ranks``), ``carrier``,
    ``send_order`` and ``dedup``."""
    top_k = config.top_k
    step = ids.shape[-2]
    slabs = ids.numel() // (step * top_k)
    block_k = _pow2(top_k)
    block_t = max(1, min(64, _DESTINATION_PAIRS // (block_k * block_k)))
    dest_rank, carrier, send_order = (torch.empty_like(dest_row) for _ in range(3))
    _destination_kernel[(triton.cdiv(step, block_t), slabs)](
        ids, segment_prefix, entry_ranks, tables.before, tables.acum, tables.group_start, dest_rank, dest_row,
        carrier, send_order, token_limits, token_limit, first_rank, step, segments, config.experts, config.ranks,
        K=top_k, BLOCK_K=block_k, BLOCK_T=block_t, SEGMENT=meta["TILE"] * meta["TILES"], **_search_meta(config.ranks),
        SCANNED=segments > 1, PER_RANK=per_rank, DEDUP=config.dedup, num_warps=_DESTINATION_WARPS,
        **_launch_options(ids.device, "destination"),
    )
    return dict(dest_rank=dest_rank, dest_row=dest_row, carrier=carrier, send_order=send_order, dedup=config.dedup)


# ----------------------------------------------------------------------------------------------
# Host wrappers
# ----------------------------------------------------------------------------------------------

_INTERPRETED = isinstance(_layout_kernel, InterpretedFunction)


# The planner launches made with programmatic dependent launch where the GPU has it (compute
# capability 9.0 and later): inside a CUDA graph such a kernel's programs are placed while the
# previous kernel runs. Launches are named by LAUNCHES: "count", "scan" (the count's), "layout" (every
# layout kernel) and "destination". Measured on the H200 (whole per-rank planning, Kimi-K3 / Kimi-K2, R = 8, twice):
# layout and destination only, 18.1-18.2 / 13.9 us at s = 8192 and 11.5-11.6 / 11.0-11.1 us at
# s = 128; none, 19.8 / 15.8 and 13.2-13.3 / 12.7-12.9 us; all four, 19.3-19.6 / 15.1 and
# 11.2-11.7 / 10.8-11.3 us (a count placed early slows the large steps); without the count's,
# 18.1-18.4 / 14.2-14.5 and 11.7-11.9 / 11.3-11.4 us.
LAUNCHES = ("count", "scan", "layout", "destination")
PDL_LAUNCHES = frozenset({"layout", "destination"})


@functools.cache
def _has_pdl(device: torch.device) -> bool:
    return not _INTERPRETED and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def _launch_options(device: torch.device, launch: str) -> dict[str, bool]:
    """The ``PDL`` flag and Triton's ``launch_pdl`` option for ``launch`` (one of :data:`LAUNCHES`) on ``device``."""
    if launch in PDL_LAUNCHES and _has_pdl(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def _check_device(tensor: torch.Tensor, name: str) -> None:
    if not _INTERPRETED and tensor.device.type != "cuda":
        raise ValueError(
            f"{name} must be on a CUDA device (or run with TRITON_INTERPRET=1 set before importing "
            f"flatep.plan.triton), got {tensor.device}"
        )


def supports_triton_planner(config: EPConfig) -> bool:
    """Whether the Triton planner handles ``config`` (``R <= 256``, ``E <= 2048``)."""
    return config.ranks <= MAX_RANKS and config.experts <= MAX_EXPERTS


def _check_config(config: EPConfig) -> None:
    if config.ranks > MAX_RANKS:
        raise ValueError(f"config.ranks must be <= {MAX_RANKS} for the Triton planner, got {config.ranks}")
    if config.experts > MAX_EXPERTS:
        raise ValueError(f"config.experts must be <= {MAX_EXPERTS} for the Triton planner, got {config.experts}")


def _host_int(value: object, name: str) -> int:
    """``value`` as a Python int; a tensor is refused, since reading it could synchronise."""
    if isinstance(value, torch.Tensor) or isinstance(value, bool):
        raise ValueError(f"{name} must be a host integer, got {type(value).__name__}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be a host integer, got {value!r}") from None


def _check_entries(config: EPConfig, step: int) -> None:
    if config.ranks * step * config.top_k >= 2**31:
        raise ValueError(f"topk_ids: R*s*K must be < 2**31 for int32 indexing, got {config.ranks * step * config.top_k}")


class _Tables:
    """The layout's output tensors plus the scratch the destination kernel reads.

    Every table is a view into one flat int32 buffer (``storage``), so that ``auto`` can keep one
    set of tables per candidate as the rows of one ``[C, size]`` tensor and gather the chosen
    candidate's with a single ``index_select``.
    """

    def __init__(self, config: EPConfig, device: torch.device | None = None, storage: torch.Tensor | None = None) -> None:
        if storage is None:
            storage = torch.empty(self.size(config), dtype=torch.int32, device=device)
        self.storage = storage
        for name, shape, start in self._places(config):
            setattr(self, name, storage[start:start + math.prod(shape)].view(shape))

    @staticmethod
    def _places(config: EPConfig) -> list[tuple[str, tuple[int, ...], int]]:
        """``(name, shape, first element)`` of every table; each starts 16-byte aligned."""
        ranks, experts, epn = config.ranks, config.experts, config.experts_per_rank
        shapes = (
            ("alloc", (experts, ranks)), ("acum", (experts, ranks)), ("before", (ranks, experts)),
            ("slot_experts", (ranks, epn)), ("group_experts", (ranks, 2 * epn)), ("offsets", (ranks, 2 * epn)),
            ("padding", (ranks, 2 * epn, 2)), ("received", (ranks,)), ("group_start", (ranks, experts)),
        )
        places, start = [], 0
        for name, shape in shapes:
            places.append((name, shape, start))
            start += -(-math.prod(shape) // 4) * 4
        return places

    @classmethod
    def size(cls, config: EPConfig) -> int:
        """int32 elements of the flat buffer."""
        name, shape, start = cls._places(config)[-1]
        return start + -(-math.prod(shape) // 4) * 4

    def args(self) -> tuple[torch.Tensor, ...]:
        """Kernel arguments in the order of :func:`_layout`."""
        return (
            self.alloc, self.acum, self.before, self.slot_experts, self.group_experts, self.offsets,
            self.padding, self.received, self.group_start,
        )

    def layout_fields(self) -> dict[str, torch.Tensor]:
        return {
            "alloc": self.alloc,
            "slot_experts": self.slot_experts,
            "group_experts": self.group_experts,
            "offsets": self.offsets,
            "padding": self.padding,
            "received": self.received,
            "group_start": self.group_start,
        }


_CANDIDATE_CODES: dict[tuple[torch.device, tuple[tuple[int, int], ...]], torch.Tensor] = {}


def _candidate_codes(codes: tuple[tuple[int, int], ...], device: torch.device) -> torch.Tensor:
    """``[C, 2] int32`` (policy code, tolerance in fixed point) of auto's candidates on ``device``.

    Made once per device and kept. Made while a CUDA graph is being captured, it is copied from
    pinned host memory (a copy the graph replays) and not kept: the graph's memory pool owns it.
    """
    key = (device, codes)
    if key in _CANDIDATE_CODES:
        return _CANDIDATE_CODES[key]
    host = torch.tensor(codes, dtype=torch.int32)
    if device.type != "cuda":
        _CANDIDATE_CODES[key] = host.to(device)
        return _CANDIDATE_CODES[key]
    if torch.cuda.is_current_stream_capturing():
        pinned = _PINNED_CODES.setdefault(codes, host.pin_memory())  # the graph's copy reads it at every replay
        return pinned.to(device, non_blocking=True)
    _CANDIDATE_CODES[key] = host.to(device)
    return _CANDIDATE_CODES[key]


_PINNED_CODES: dict[tuple[tuple[int, int], ...], torch.Tensor] = {}


def _auto_tables(
    hist: torch.Tensor, total_tokens: int, config: EPConfig, cost: CostProfile | None
) -> tuple[_Tables, AutoChoice, dict[str, object]]:
    """``auto``'s layout: every candidate's tables, the model's choice, the chosen tables gathered.

    Only the layout is planned per candidate (a launch of ``R`` programs each, fewer candidates
    when :func:`flatep.plan.auto.candidates_for` prunes them); the count, scan and destination
    kernels, which touch every entry, run once, on the chosen tables. The model is two launches
    (:func:`flatep.plan.cost_triton.predict_triton`), the choice and the gather of the chosen
    tables another (:func:`flatep.plan.cost_triton.choose_triton`); nothing is read on the host.

    Returns:
        The chosen tables, the :class:`~flatep.plan.auto.AutoChoice`, and the plan fields of an
        auto plan (``policy``, ``shard_rows``, ``slot_rows``, ``auto``).
    """
    cost = CostProfile.default() if cost is None else cost
    candidates = candidates_for(config, cost, total_tokens)
    storage = torch.empty(len(candidates), _Tables.size(config), dtype=torch.int32, device=hist.device)
    if config.ranks <= _FUSED_MAX_RANKS and len(candidates) > 1:
        # One launch of R x C programs: the candidates' serial rounds run side by side.
        codes = tuple((_POLICY_CODES[c.policy], c.config(config).tolerance_fixed) for c in candidates)
        _launch_layout(hist, config, "exact", _Tables(config, storage=storage[0]), candidates=_candidate_codes(codes, hist.device))
    else:
        for index, candidate in enumerate(candidates):
            tables = _Tables(config, storage=storage[index])
            _launch_layout(hist, candidate.config(config), candidate.policy, tables)
    alloc_start = _Tables._places(config)[0][2]
    alloc = storage[:, alloc_start:alloc_start + config.experts * config.ranks].view(len(candidates), config.experts, config.ranks)
    constants = cost.constants(config, total_tokens=total_tokens)
    prediction = predict_triton(hist, alloc, constants)
    if len(candidates) == 1:
        choice, chosen = choose(prediction), storage[0]
    else:
        choice, chosen = choose_triton(prediction.layer_fs, prediction.experts_moved, storage, constants.margin_ppm)
    auto = AutoChoice(candidates=candidates, choice=choice, prediction=prediction, margin_ppm=constants.margin_ppm)
    fields = dict(policy="auto", shard_rows=config.step_rows(total_tokens, "auto"), slot_rows=slot_rows(config, total_tokens), auto=auto)
    return _Tables(config, storage=chosen), auto, fields


def _layout_meta(config: EPConfig, policy: str) -> dict[str, int | bool]:
    return {
        "RANKS": config.ranks,
        "POLICY": _POLICY_CODES[policy],
        "BLOCK_R": _pow2(config.ranks),
        "BLOCK_EPN": _pow2(config.experts_per_rank),
    }


def _launch_layout(
    hist: torch.Tensor, config: EPConfig, policy: str, tables: _Tables, candidates: torch.Tensor | None = None,
) -> None:
    """Fill ``tables`` from the gathered histogram ``hist [R, E] int32`` (which gives ``T*K`` too).

    Up to ``_FUSED_MAX_RANKS`` ranks: one launch of the fused layout. Beyond: four launches, each
    serial part done once: the prefix of ``hist`` over source ranks (``before`` and the global
    ``count``), step A in one program, step B per donor, step C per rank.

    ``candidates`` (fused layout only): ``[C, 2] int32`` (policy code, tolerance in fixed point)
    of ``C`` plans made in the same launch; ``tables`` is then the first of ``C`` consecutive
    table buffers (``policy`` and ``config.tolerance`` are not used).
    """
    meta = _layout_meta(config, policy)
    if config.ranks <= _FUSED_MAX_RANKS:
        count = 1 if candidates is None else candidates.shape[0]
        _layout_kernel[(config.ranks, count)](
            hist, config.tolerance_fixed, config.experts, config.experts_per_rank, config.align,
            *tables.args(), hist if candidates is None else candidates, _Tables.size(config), **meta, CANDIDATES=count,
            num_warps=_LAYOUT_WARPS, **_launch_options(hist.device, "layout"),
        )
        return
    if candidates is not None:
        raise ValueError(f"candidates are planned in one launch up to {_FUSED_MAX_RANKS} ranks, got R={config.ranks}")
    blocks = {name: meta[name] for name in ("RANKS", "BLOCK_R", "BLOCK_EPN")}
    count = torch.empty(config.experts, dtype=torch.int32, device=hist.device)
    quotas = torch.empty(2, config.ranks, dtype=torch.int32, device=hist.device)
    _scan_kernel[(triton.cdiv(config.experts, _SCAN_EXPERTS), 1)](
        hist, tables.before, count, config.ranks, config.experts,
        ROWS=min(_pow2(config.ranks), _SCAN_ROWS), BLOCK_EC=_SCAN_EXPERTS, WRITE_HIST=True, num_warps=_SCAN_WARPS,
        **_launch_options(hist.device, "layout"),
    )
    _balance_kernel[(1,)](
        count, config.tolerance_fixed, config.experts, config.experts_per_rank, quotas, **meta, num_warps=_LAYOUT_WARPS,
        **_launch_options(hist.device, "layout"),
    )
    _split_kernel[(config.ranks,)](count, quotas, tables.alloc, tables.acum, config.experts_per_rank, **blocks, num_warps=_LAYOUT_WARPS,
                                   **_launch_options(hist.device, "layout"))
    _shard_kernel[(config.ranks,)](
        count, tables.alloc, quotas, config.experts, config.experts_per_rank, config.align,
        tables.slot_experts, tables.group_experts, tables.offsets, tables.padding, tables.received,
        tables.group_start, **blocks, num_warps=_LAYOUT_WARPS, **_launch_options(hist.device, "layout"),
    )


def _search_meta(ranks: int) -> dict[str, int]:
    block = _pow2(ranks)
    return {"BLOCK_R": block, "LOG_R": block.bit_length() - 1}


def _count_meta(entries: int, experts: int) -> dict[str, int]:
    """Tiles of the count kernel for ``entries = s*K`` per rank: ``TILE`` entries per compare
    matrix, ``TILES`` tiles per segment (one program), so that a rank has about
    ``_SEGMENTS_PER_RANK`` segments (fewer for small steps, whose segments are single tiles); from
    :data:`SORTED_COUNT_ENTRIES` entries, sorted segments of ``_SORTED_SEGMENT`` entries (longer ones
    from ``_LONG_SORTED_ENTRIES``). ``BLOCK_E`` covers a histogram row of ``E`` experts."""
    tile = _tile_size(entries)
    common = {"TILE": tile, "CHUNK": min(tile, _COMPARE_CHUNK), "BLOCK_E": _pow2(experts)}
    if entries >= SORTED_COUNT_ENTRIES:
        segment = _LONG_SORTED_SEGMENT if entries >= _LONG_SORTED_ENTRIES else _SORTED_SEGMENT
        return {**common, "TILES": segment // tile, "SORTED": True, "LOG_SEGMENT": segment.bit_length() - 1}
    tiles = min(_MAX_SEGMENT_TILES, _pow2(triton.cdiv(entries, tile * _SEGMENTS_PER_RANK)))
    return {**common, "TILES": tiles, "SORTED": False, "LOG_SEGMENT": 0}


def _segments(entries: int, meta: dict[str, int]) -> int:
    return triton.cdiv(entries, meta["TILE"] * meta["TILES"])


@dataclass(frozen=True)
class RankCounts:
    """One rank's entries counted on the GPU: the histogram row it contributes to the exchange,
    and what :func:`plan_rank_triton` needs of the ids afterwards (so it does not count again).

    Made by :func:`count_rank_triton` before the histogram exchange; pass it as
    ``plan_rank_triton(..., counts=...)`` with the same ``topk_ids`` and ``tokens``.

    Attributes:
        tokens_per_expert: ``[E] int32``, this rank's real entries per expert.
        entry_ranks: ``[s, K] int32``, per valid entry the entries of its expert before it in its
            segment of the flat ``(t, k)`` order (undefined for other entries).
        segment_prefix: ``[segments, E] int32``, per segment the entries of each expert in earlier
            segments (a single segment holds its own counts instead: nothing comes before it, and
            the planner does not read them).
        tokens: the real tokens counted (rows ``t >= tokens`` are padding).
        ids_address: ``data_ptr()`` of the ids tensor counted (a host integer: the planner refuses
            counts of another tensor without reading the device; the same buffer refilled for a
            new step, as a CUDA graph replays it, is the caller's to count again).
    """

    tokens_per_expert: torch.Tensor
    entry_ranks: torch.Tensor
    segment_prefix: torch.Tensor
    tokens: int
    ids_address: int

    def check_for(self, topk_ids: torch.Tensor, experts: int, tokens: int) -> None:
        """Raise unless these counts were made from ``topk_ids`` itself, for ``E`` and ``tokens``."""
        if tuple(self.entry_ranks.shape) != tuple(topk_ids.shape) or self.entry_ranks.device != topk_ids.device:
            raise ValueError(f"counts were made for ids of shape {list(self.entry_ranks.shape)} on "
                             f"{self.entry_ranks.device}, got topk_ids {list(topk_ids.shape)} on {topk_ids.device}")
        if self.ids_address != topk_ids.data_ptr():
            raise ValueError("counts were made from another topk_ids tensor: pass the ids they counted")
        if self.tokens_per_expert.shape[0] != experts:
            raise ValueError(f"counts were made for E={self.tokens_per_expert.shape[0]}, got config.experts={experts}")
        if self.tokens != tokens:
            raise ValueError(f"counts were made for tokens={self.tokens}, got tokens={tokens}")


def count_rank_triton(topk_ids: torch.Tensor, experts: int, tokens: int | None = None) -> RankCounts:
    """Count this rank's entries: the histogram row it contributes to the exchange, plus the
    stable ranks :func:`plan_rank_triton` uses afterwards (two launches, no host synchronisation).

    Args:
        topk_ids: ``[s, K]`` int32 or int64 expert ids on the GPU.
        experts: ``E``.
        tokens: real tokens (default ``s``); rows ``t >= tokens`` are padding and not counted.

    Returns:
        The :class:`RankCounts`; its ``tokens_per_expert`` is ``[E] int32`` on ``topk_ids.device``.
        Ids outside ``[0, E)`` are not counted (not checked).
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a [s, K] tensor, got {getattr(topk_ids, 'shape', type(topk_ids))}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(experts, int) or isinstance(experts, bool) or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"experts must be an int in [1, {MAX_EXPERTS}], got {experts!r}")
    step, top_k = topk_ids.shape
    if step < 1 or top_k < 1:
        raise ValueError(f"topk_ids must have s >= 1 and K >= 1, got {list(topk_ids.shape)}")
    if step * top_k >= 2**31:
        raise ValueError(f"topk_ids: s*K must be < 2**31 for int32 indexing, got {step * top_k}")
    limit = step if tokens is None else _host_int(tokens, "tokens")
    if not 0 <= limit <= step:
        raise ValueError(f"tokens must be in [0, s={step}], got {tokens}")
    _check_device(topk_ids, "topk_ids")
    ids = topk_ids.contiguous()
    entries = ids.numel()
    meta = _count_meta(entries, experts)
    segments = _segments(entries, meta)
    rows = torch.empty(segments, experts, dtype=torch.int32, device=ids.device)
    entry_ranks = torch.empty(step, top_k, dtype=torch.int32, device=ids.device)
    # ids stands in for the unread per-rank tokens pointer
    _count_kernel[(segments, 1)](ids, rows, entry_ranks, ids, limit, entries, segments, top_k, experts, **meta,
                                 PER_RANK=False, num_warps=_COUNT_WARPS, **_launch_options(ids.device, "count"))
    if segments == 1:  # the one row is the histogram and no segment comes before it
        return RankCounts(rows[0], entry_ranks, rows, limit, topk_ids.data_ptr())
    total = torch.empty(experts, dtype=torch.int32, device=ids.device)
    _scan_kernel[(triton.cdiv(experts, _SCAN_EXPERTS), 1)](
        rows, rows, total, segments, experts,
        ROWS=min(_pow2(segments), _SCAN_ROWS), BLOCK_EC=_SCAN_EXPERTS, WRITE_HIST=True, num_warps=_SCAN_WARPS,
        **_launch_options(ids.device, "scan"),
    )
    return RankCounts(total, entry_ranks, rows, limit, topk_ids.data_ptr())


def make_plan_triton(
    topk_ids: torch.Tensor,
    config: EPConfig,
    policy: str = "exact",
    tokens: Sequence[int] | torch.Tensor | None = None,
    cost: CostProfile | None = None,
) -> Plan:
    """Plan one step of a whole group of virtual ranks on the GPU; equals :func:`flatep.plan.make_plan`.

    Four launches (three when ``s*K`` fits in one segment; three more for ``R > 32``), no host
    synchronisation (graph-capturable when ``tokens`` is None; per-rank
    ``tokens`` are copied to the device, which a graph capture does not allow).

    Args:
        topk_ids: ``[R, s, K]`` int32 (or int64) expert ids of every rank on the GPU;
            ``1 <= s <= capacity``. Ids of real tokens must be in ``[0, E)`` (not checked: others
            are skipped and planned as ``-1``).
        config: group sizes (``R <= 256``, ``E <= 2048``, ``R*s*K < 2**31``); ``R`` and ``K`` must
            match ``topk_ids``.
        policy: ``exact`` (flat), ``bounded`` (at most ``config.bounded_rows(T)`` rows per rank),
            ``none`` (classic EP) or ``auto`` (:mod:`flatep.plan.auto`).
        tokens: optional host ``[R]`` real tokens per rank (a list or CPU tensor); rows beyond are
            padding, ignored and planned as ``-1``.
        cost: the :class:`flatep.CostProfile` of ``auto`` (default: the generic one).

    Returns:
        The :class:`Plan`, int32 tensors on ``topk_ids.device``.
    """
    check_policy(policy)
    check_cost(policy, cost)
    _check_config(config)
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    _check_ids(topk_ids, config, "topk_ids", (config.ranks,))
    if isinstance(tokens, torch.Tensor) and tokens.device.type != "cpu":
        raise ValueError(f"tokens must be a host sequence or CPU tensor (reading {tokens.device} would synchronise)")
    step = topk_ids.shape[1]
    counts = _token_counts(tokens, config.ranks, step)
    _check_entries(config, step)
    _check_device(topk_ids, "topk_ids")
    device = topk_ids.device
    ranks, experts = config.ranks, config.experts
    ids = topk_ids.contiguous()
    entries = step * config.top_k
    meta = _count_meta(entries, experts)
    segments = _segments(entries, meta)
    # Per-rank token counts go to the device (a small host-to-device copy); the common case of
    # full ranks passes s as a scalar instead (and ids as an unread pointer), which keeps the
    # call graph-capturable.
    per_rank = tokens is not None
    token_limits = torch.tensor(counts, dtype=torch.int32, device=device) if per_rank else ids

    scanned = segments > 1
    segment_counts = torch.empty(ranks * segments, experts, dtype=torch.int32, device=device)
    # With one segment per rank its row is the rank's histogram and there is nothing to prefix.
    hist = torch.empty(ranks, experts, dtype=torch.int32, device=device) if scanned else segment_counts
    dest_rank = torch.empty(ranks, step, config.top_k, dtype=torch.int32, device=device)
    dest_row = torch.empty_like(dest_rank)

    _count_kernel[(segments, ranks)](
        ids, segment_counts, dest_row, token_limits, step, entries, segments, config.top_k, experts,
        **meta, PER_RANK=per_rank, num_warps=_COUNT_WARPS, **_launch_options(device, "count"),
    )
    if scanned:
        _scan_kernel[(triton.cdiv(experts, _SCAN_EXPERTS), ranks)](
            segment_counts, segment_counts, hist, segments, experts,
            ROWS=min(_pow2(segments), _SCAN_ROWS), BLOCK_EC=_SCAN_EXPERTS, WRITE_HIST=True, num_warps=_SCAN_WARPS,
            **_launch_options(device, "scan"),
        )
    plan_fields: dict[str, object] = dict(policy=policy, shard_rows=config.step_rows(ranks * step, policy))
    if policy == "auto":
        tables, _, plan_fields = _auto_tables(hist, sum(counts), config, cost)
    else:
        tables = _Tables(config, device)
        _launch_layout(hist, config, policy, tables)
    # dest_row holds the entries' ranks in their segments and is overwritten in place.
    entry_tables = _launch_destinations(ids, segment_counts, dest_row, tables, dest_row, token_limits, step, 0, segments,
                                        config, meta, per_rank)
    return Plan(**plan_fields, total_tokens=sum(counts), tokens_per_expert=hist, **tables.layout_fields(), **entry_tables)


def plan_rank_triton(
    rank: int,
    topk_ids: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    config: EPConfig,
    policy: str = "exact",
    total_tokens: int | None = None,
    tokens: int | None = None,
    cost: CostProfile | None = None,
    counts: RankCounts | None = None,
) -> RankPlan:
    """One rank's plan on its GPU from the gathered histogram; equals :func:`flatep.plan.plan_rank`.

    Two launches after :func:`count_rank_triton` (three more for ``R > 32``), no host
    synchronisation, graph-capturable.

    Args:
        rank: this rank, in ``[0, R)``.
        topk_ids: ``[s, K]`` int32 (or int64) ids of this rank on the GPU.
        tokens_per_expert: ``[R, E]`` int32 (or int64) histogram gathered from every rank (row ``r``
            = ``count_rank_triton(...).tokens_per_expert`` of rank ``r``), on the same device.
            Trusted: it must match every rank's ids (not checked; the reference planner checks).
            The kernels take ``T*K`` from it.
        config: group sizes (``R <= 256``, ``E <= 2048``, ``R*s*K < 2**31``).
        policy: ``exact``, ``bounded``, ``none`` or ``auto``.
        total_tokens: tokens over the group ``T`` (default ``R * s``), a host int. Only host-side
            sizes follow it (``shard_rows``, ``auto``'s candidates and ``slot_rows``, the plan's
            ``total_tokens``); every table is planned from the histogram's own total. So ``None``
            plans a step whose ranks hold fewer real tokens (``tokens``) exactly, with those
            sizes at their bound ``R * s``, and nothing read back to the host.
        tokens: this rank's real tokens (default ``s``); rows beyond are padding, planned as ``-1``.
        cost: the :class:`flatep.CostProfile` of ``auto`` (every rank must pass the same).
        counts: this rank's :class:`RankCounts` of the same ``topk_ids`` and ``tokens``, made
            before the exchange (default: counted here, up to two more launches).

    Returns:
        The :class:`RankPlan`, int32 tensors on ``topk_ids.device``.
    """
    check_policy(policy)
    check_cost(policy, cost)
    _check_config(config)
    if not isinstance(rank, int) or not 0 <= rank < config.ranks:
        raise ValueError(f"rank must be an int in [0, {config.ranks}), got {rank!r}")
    if not isinstance(topk_ids, torch.Tensor):
        raise ValueError(f"topk_ids must be a tensor, got {type(topk_ids).__name__}")
    _check_ids(topk_ids, config, "topk_ids", ())
    if not isinstance(tokens_per_expert, torch.Tensor) or tuple(tokens_per_expert.shape) != (config.ranks, config.experts):
        raise ValueError(
            f"tokens_per_expert must be a tensor of shape [{config.ranks}, {config.experts}], "
            f"got {list(getattr(tokens_per_expert, 'shape', []))}"
        )
    if tokens_per_expert.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"tokens_per_expert must be int32 or int64, got {tokens_per_expert.dtype}")
    if tokens_per_expert.device != topk_ids.device:
        raise ValueError(f"tokens_per_expert must be on {topk_ids.device} like topk_ids, got {tokens_per_expert.device}")
    step = topk_ids.shape[0]
    limit = step if tokens is None else _host_int(tokens, "tokens")
    if not 0 <= limit <= step:
        raise ValueError(f"tokens must be in [0, s={step}], got {tokens}")
    total = config.ranks * step if total_tokens is None else _host_int(total_tokens, "total_tokens")
    if not 1 <= total <= config.ranks * step:
        raise ValueError(f"total_tokens must be in [1, R*s = {config.ranks * step}], got {total_tokens}")
    _check_entries(config, step)
    _check_device(topk_ids, "topk_ids")
    if counts is None:
        counts = count_rank_triton(topk_ids, config.experts, limit)
    elif not isinstance(counts, RankCounts):
        raise ValueError(f"counts must be a RankCounts from count_rank_triton, got {type(counts).__name__}")
    else:
        counts.check_for(topk_ids, config.experts, limit)
    device = topk_ids.device
    ids = topk_ids.contiguous()
    hist = tokens_per_expert.to(torch.int32).contiguous()
    entries = step * config.top_k
    meta = _count_meta(entries, config.experts)
    segments = counts.segment_prefix.shape[0]

    plan_fields: dict[str, object] = dict(policy=policy, shard_rows=config.step_rows(config.ranks * step, policy))
    if policy == "auto":
        tables, _, plan_fields = _auto_tables(hist, total, config, cost)
    else:
        tables = _Tables(config, device)
        _launch_layout(hist, config, policy, tables)
    dest_row = torch.empty(step, config.top_k, dtype=torch.int32, device=device)
    # ids stands in for the unread per-rank tokens pointer
    entry_tables = _launch_destinations(ids, counts.segment_prefix, counts.entry_ranks, tables, dest_row, ids, limit, rank,
                                        segments, config, meta, False)
    return RankPlan(**plan_fields, total_tokens=total, tokens_per_expert=hist, **tables.layout_fields(), rank=rank,
                    **entry_tables)
