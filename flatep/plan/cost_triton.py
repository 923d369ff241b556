"""The cost model of ``policy="auto"`` in Triton, bit-equal to :func:`flatep.plan.cost.predict`.

:func:`flatep.plan.cost.predict` is a few dozen small torch operations: at decode sizes their
launches cost more than the arithmetic. :func:`predict_triton` evaluates the same integer formula
in two launches: programs ``(candidate, block of experts)`` load ``[BLOCK_E, BLOCK_R]`` (experts x
ranks) of the allocation and the histogram, take the prefix sums over ranks that place each rank's
source interval and destination chunk of an expert (:func:`flatep.plan.cost.local_entries`) and
store per-rank partial sums; one program per candidate then adds its blocks and applies the push
and link terms. Every term is an integer in femtoseconds or bytes, so the result is the torch one
bit for bit, and a CUDA graph can capture the launches.

:func:`choose_triton` then takes ``auto``'s choice (the first candidate with the least busiest-rank
time, as :func:`flatep.plan.auto.choose`) and gathers the chosen candidate's tables in one more
launch, where ``argmin`` and ``index_select`` took two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.plan.cost import CostConstants, Prediction

# A program takes at most this many (expert, rank) pairs: small blocks spread the experts over many
# programs (one program per candidate walking all experts took 13 us at Kimi-K2 and 24 us at Kimi-K3
# on the H200, most of auto's planning overhead over classic's).
_BLOCK_ELEMENTS = 512
# The partial sums each block leaves per rank: gemm, received, lent, local, computed, own.
_SUMS = 6


# Integer arguments are never specialised (a constant of 1 would become a constexpr) and are
# widened to int64 before any product: femtosecond constants overflow int32.
_CONSTANTS = ("row_fs", "weight_fs", "group_fs", "push_fs", "weight_link_fs", "row_link_fs", "weight_bytes")


@triton.jit(do_not_specialize=_CONSTANTS)
def _predict_block_kernel(
    hist_ptr, alloc_ptr, alloc_stride, partial_ptr, experts, epn, row_fs, weight_fs, group_fs,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, TILE_ROWS: tl.constexpr, SUMS: tl.constexpr,
):
    """Program ``(c, b)``: per-rank sums of candidate ``c`` over experts block ``b`` into
    ``partial[c, b]`` (``[SUMS, BLOCK_R]`` int64: gemm, received, lent, local, computed, own). Row counts stay int32 (``R*s*K < 2**31``);
    only femtosecond terms are int64."""
    candidate, block = tl.program_id(0), tl.program_id(1)
    row_fs, weight_fs, group_fs = row_fs.to(tl.int64), weight_fs.to(tl.int64), group_fs.to(tl.int64)
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < RANKS
    expert = block * BLOCK_E + tl.arange(0, BLOCK_E)
    mask = (expert < experts)[:, None] & rank_mask[None, :]
    # rows[e, d]: rows of expert e on rank d; counts[e, r]: entries of expert e from rank r.
    alloc_base = alloc_ptr + candidate.to(tl.int64) * alloc_stride
    rows = tl.load(alloc_base + expert[:, None] * RANKS + rank[None, :], mask=mask, other=0).to(tl.int32)
    counts = tl.load(hist_ptr + rank[None, :] * experts + expert[:, None], mask=mask, other=0).to(tl.int32)
    tiles = (rows + (TILE_ROWS - 1)) // TILE_ROWS
    compute = tl.maximum(tiles.to(tl.int64) * (TILE_ROWS * row_fs), weight_fs)
    gemm = tl.sum(tl.where(rows > 0, compute + group_fs, 0), axis=0)
    home = expert // epn
    foreign = ((rows > 0) & (home[:, None] != rank[None, :])).to(tl.int32)
    received = tl.sum(foreign, axis=0)
    receivers = tl.sum(foreign, axis=1)  # [BLOCK_E] ranks each expert is lent to
    lent = tl.sum(tl.where(home[:, None] == rank[None, :], receivers[:, None], 0), axis=0)
    # Entries of an expert ordered by source rank, cut into chunks by destination rank.
    source_end = tl.cumsum(counts, axis=1)
    chunk_end = tl.cumsum(rows, axis=1)
    overlap = tl.minimum(source_end, chunk_end) - tl.maximum(source_end - counts, chunk_end - rows)
    local = tl.sum(tl.maximum(overlap, 0), axis=0)
    out = partial_ptr + ((candidate * tl.num_programs(1) + block) * SUMS).to(tl.int64) * BLOCK_R + rank
    tl.store(out + 0 * BLOCK_R, gemm)
    tl.store(out + 1 * BLOCK_R, received.to(tl.int64))
    tl.store(out + 2 * BLOCK_R, lent.to(tl.int64))
    tl.store(out + 3 * BLOCK_R, local.to(tl.int64))
    tl.store(out + 4 * BLOCK_R, tl.sum(rows, axis=0).to(tl.int64))
    tl.store(out + 5 * BLOCK_R, tl.sum(counts, axis=0).to(tl.int64))


@triton.jit(do_not_specialize=_CONSTANTS)
def _predict_finish_kernel(
    partial_ptr, blocks, rank_fs_ptr, layer_fs_ptr, moved_ptr, bytes_ptr, push_fs, weight_link_fs, row_link_fs,
    weight_bytes, RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, SUMS: tl.constexpr,
):
    """Program ``c``: sums candidate ``c``'s blocks and applies the push and link terms."""
    candidate = tl.program_id(0)
    push_fs, weight_link_fs, row_link_fs = push_fs.to(tl.int64), weight_link_fs.to(tl.int64), row_link_fs.to(tl.int64)
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < RANKS
    # The SUMS kinds padded to 8 lanes (tl.arange needs a power of two).
    sums = tl.zeros([BLOCK_B, 8, BLOCK_R], dtype=tl.int64)
    kind = tl.arange(0, 8)
    for first in range(0, blocks, BLOCK_B):
        block = first + tl.arange(0, BLOCK_B)
        where = ((candidate * blocks + block) * SUMS).to(tl.int64)[:, None, None] * BLOCK_R + kind[None, :, None] * BLOCK_R
        inside = (block < blocks)[:, None, None] & (kind < SUMS)[None, :, None] & rank_mask[None, None, :]
        sums += tl.load(partial_ptr + where + rank[None, None, :], mask=inside, other=0)
    total = tl.sum(sums, axis=0)  # [8, BLOCK_R]
    gemm = tl.sum(tl.where(kind[:, None] == 0, total, 0), axis=0)
    received = tl.sum(tl.where(kind[:, None] == 1, total, 0), axis=0)
    lent = tl.sum(tl.where(kind[:, None] == 2, total, 0), axis=0)
    local = tl.sum(tl.where(kind[:, None] == 3, total, 0), axis=0)
    computed = tl.sum(tl.where(kind[:, None] == 4, total, 0), axis=0)
    own = tl.sum(tl.where(kind[:, None] == 5, total, 0), axis=0)
    moved = tl.sum(tl.where(rank_mask, received, 0), axis=0)
    push = tl.maximum(received, lent) * weight_link_fs + tl.where(moved > 0, push_fs, 0)
    link = tl.maximum(own - local, computed - local) * row_link_fs
    rank_fs = gemm + push + link
    tl.store(rank_fs_ptr + candidate * RANKS + rank, rank_fs, mask=rank_mask)
    tl.store(layer_fs_ptr + candidate, tl.max(tl.where(rank_mask, rank_fs, -1), axis=0))
    tl.store(moved_ptr + candidate, moved)
    tl.store(bytes_ptr + candidate, moved * weight_bytes.to(tl.int64))


def predict_triton(tokens_per_expert: torch.Tensor, alloc: torch.Tensor, constants: CostConstants) -> Prediction:
    """:func:`flatep.plan.cost.predict` in two launches (bit-equal; on the GPU or the interpreter).

    The first launch spreads each candidate's experts over blocks of programs (per-rank partial
    sums), the second adds a candidate's blocks and applies the push and link terms.

    Args:
        tokens_per_expert: ``[R, E]`` int32/int64 gathered histogram.
        alloc: ``[C, E, R]`` int32/int64 allocation of each candidate, on the same device; each
            candidate's ``[E, R]`` contiguous, candidates at any stride (e.g. rows of a table buffer).
        constants: from :meth:`flatep.CostProfile.constants`.

    Returns:
        The :class:`~flatep.plan.cost.Prediction` (int64 tensors on ``alloc.device``).
    """
    if alloc.dim() != 3 or tokens_per_expert.dim() != 2 or tuple(alloc.shape[1:]) != tuple(tokens_per_expert.shape[::-1]):
        raise ValueError(
            f"alloc must be [C, E, R] and tokens_per_expert [R, E] of the same E and R, got "
            f"{list(alloc.shape)} and {list(tokens_per_expert.shape)}"
        )
    if tokens_per_expert.device != alloc.device:
        raise ValueError(f"tokens_per_expert must be on {alloc.device} like alloc, got {tokens_per_expert.device}")
    candidates, experts, ranks = alloc.shape
    if alloc.stride(1) != ranks or alloc.stride(2) != 1:
        alloc = alloc.contiguous()
    block_r = triton.next_power_of_2(ranks)
    block_e = max(1, min(triton.next_power_of_2(experts), _BLOCK_ELEMENTS // block_r))
    blocks = triton.cdiv(experts, block_e)
    device = alloc.device
    partial = torch.empty(candidates, blocks, _SUMS, block_r, dtype=torch.int64, device=device)
    rank_fs = torch.empty(candidates, ranks, dtype=torch.int64, device=device)
    layer_fs = torch.empty(candidates, dtype=torch.int64, device=device)
    moved = torch.empty(candidates, dtype=torch.int64, device=device)
    moved_bytes = torch.empty(candidates, dtype=torch.int64, device=device)
    _predict_block_kernel[(candidates, blocks)](
        tokens_per_expert.contiguous(), alloc, alloc.stride(0), partial, experts, experts // ranks,
        constants.row_fs, constants.weight_fs, constants.group_fs,
        RANKS=ranks, BLOCK_R=block_r, BLOCK_E=block_e, TILE_ROWS=constants.tile_rows, SUMS=_SUMS, num_warps=4,
    )
    _predict_finish_kernel[(candidates,)](
        partial, blocks, rank_fs, layer_fs, moved, moved_bytes, constants.push_fs,
        constants.weight_bytes * constants.byte_fs, constants.row_bytes * constants.byte_fs, constants.weight_bytes,
        RANKS=ranks, BLOCK_R=block_r, BLOCK_B=max(1, min(triton.next_power_of_2(blocks), 4096 // (8 * block_r))),
        SUMS=_SUMS, num_warps=4,
    )
    return Prediction(rank_fs=rank_fs, layer_fs=layer_fs, experts_moved=moved, bytes_moved=moved_bytes)


@triton.jit
def _choose_kernel(
    layer_fs_ptr, moved_ptr, tables_ptr, chosen_ptr, choice_ptr, table_size, margin_ppm,
    CANDIDATES: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK: tl.constexpr,
):
    """Every program finds the choice (``CANDIDATES`` values: cheaper than waiting for one program
    to publish it) and copies its ``BLOCK`` words of the chosen row of ``tables``; program 0 stores
    the choice."""
    candidate = tl.arange(0, BLOCK_C)
    real = candidate < CANDIDATES
    # Two reductions, not one over (time, index) packed into an int64: times reach a few times
    # 2**60 fs (the model's link-term cap), and scaling them by BLOCK_C would overflow.
    time = tl.load(layer_fs_ptr + candidate, mask=real, other=0)
    penalty = (tl.load(layer_fs_ptr) // 1000000) * margin_ppm
    moved = tl.load(moved_ptr + candidate, mask=real, other=0)
    time = time + tl.where(moved > 0, penalty, 0)
    least = tl.min(tl.where(real, time, 2**63 - 1), axis=0)
    best = tl.min(tl.where(real & (time == least), candidate, BLOCK_C), axis=0).to(tl.int64)
    if tl.program_id(0) == 0:
        tl.store(choice_ptr, best)
    word = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = word < table_size
    tl.store(chosen_ptr + word, tl.load(tables_ptr + best * table_size + word, mask=inside), mask=inside)


def choose_triton(
    layer_fs: torch.Tensor, experts_moved: torch.Tensor, tables: torch.Tensor, margin_ppm: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``auto``'s choice and the chosen row of ``tables``, in one launch (no host sync).

    Args:
        layer_fs: ``[C]`` int64 predicted busiest-rank time of each candidate (``Prediction.layer_fs``).
        experts_moved: ``[C]`` int64 experts each candidate moves (``Prediction.experts_moved``).
        tables: ``[C, S]`` int32, contiguous: each candidate's tables, on the same device.
        margin_ppm: the decision margin in millionths of candidate 0's (classic's) time.

    Returns:
        ``(choice [] int64, chosen [S] int32)``: the first candidate with the least score
        (:func:`flatep.plan.auto.choose`, the same integers) and a copy of its row of ``tables``.
    """
    for name, values in (("layer_fs", layer_fs), ("experts_moved", experts_moved)):
        if values.dim() != 1 or values.dtype != torch.int64 or not values.is_contiguous():
            raise ValueError(f"{name} must be a contiguous [C] int64 tensor, got {values.dtype} {list(values.shape)}")
    if experts_moved.shape != layer_fs.shape or experts_moved.device != layer_fs.device:
        raise ValueError(f"experts_moved must be [C={layer_fs.shape[0]}] on {layer_fs.device} like layer_fs, "
                         f"got {list(experts_moved.shape)} on {experts_moved.device}")
    if isinstance(margin_ppm, bool) or not isinstance(margin_ppm, int) or not 0 <= margin_ppm < 10**6:
        raise ValueError(f"margin_ppm must be an integer in [0, 1000000), got {margin_ppm!r}")
    if tables.dim() != 2 or tables.shape[0] != layer_fs.shape[0] or not tables.is_contiguous():
        raise ValueError(f"tables must be a contiguous [C={layer_fs.shape[0]}, S] tensor, got {list(tables.shape)}")
    if tables.device != layer_fs.device:
        raise ValueError(f"tables must be on {layer_fs.device} like layer_fs, got {tables.device}")
    candidates, size = tables.shape
    choice = torch.empty((), dtype=torch.int64, device=tables.device)
    chosen = torch.empty(size, dtype=tables.dtype, device=tables.device)
    block = min(4096, triton.next_power_of_2(max(size, 1)))
    _choose_kernel[(max(1, triton.cdiv(size, block)),)](
        layer_fs, experts_moved, tables, chosen, choice, size, margin_ppm, CANDIDATES=candidates, BLOCK_C=triton.next_power_of_2(candidates),
        BLOCK=block, num_warps=4,
    )
    return choice, chosen
