"""The cost model of ``policy="auto"`` in one Triton launch, bit-equal to :func:`flatep.plan.cost.predict`.

:func:`flatep.plan.cost.predict` is a few dozen small torch operations: at decode sizes their
launches cost more than the arithmetic. :func:`predict_triton` evaluates the same integer formula
with one program per candidate: the program walks the experts in blocks of ``[BLOCK_E, BLOCK_R]``
(experts x ranks), takes the prefix sums over ranks that place each rank's source interval and
destination chunk of an expert (:func:`flatep.plan.cost.local_entries`) inside the block, and keeps
per-rank int64 sums in registers. Every term is an integer in femtoseconds or bytes, so the result
is the torch one bit for bit, and a CUDA graph can capture the launch.

:func:`choose_triton` then takes ``auto``'s choice (the first candidate with the least busiest-rank
time, as :func:`flatep.plan.auto.choose`) and gathers the chosen candidate's tables in one more
launch, where ``argmin`` and ``index_select`` took two.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.plan.cost import CostConstants, Prediction

_TILE_ELEMENTS = 4096  # a block holds at most this many (expert, rank) pairs


# Integer arguments are never specialised (a constant of 1 would become a constexpr) and are
# widened to int64 before any product: femtosecond constants overflow int32.
_CONSTANTS = ("tile_rows", "row_fs", "weight_fs", "group_fs", "push_fs", "weight_link_fs", "row_link_fs", "weight_bytes")


@triton.jit(do_not_specialize=_CONSTANTS)
def _predict_kernel(
    hist_ptr, alloc_ptr, alloc_stride, rank_fs_ptr, layer_fs_ptr, moved_ptr, bytes_ptr,
    experts, epn, tile_rows, row_fs, weight_fs, group_fs, push_fs, weight_link_fs, row_link_fs, weight_bytes,
    RANKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr,
):
    candidate = tl.program_id(0)
    tile_rows, row_fs, weight_fs = tile_rows.to(tl.int64), row_fs.to(tl.int64), weight_fs.to(tl.int64)
    group_fs, push_fs = group_fs.to(tl.int64), push_fs.to(tl.int64)
    weight_link_fs, row_link_fs = weight_link_fs.to(tl.int64), row_link_fs.to(tl.int64)
    rank = tl.arange(0, BLOCK_R)
    rank_mask = rank < RANKS
    gemm = tl.zeros([BLOCK_R], dtype=tl.int64)
    received = tl.zeros([BLOCK_R], dtype=tl.int64)
    lent = tl.zeros([BLOCK_R], dtype=tl.int64)
    local = tl.zeros([BLOCK_R], dtype=tl.int64)
    computed = tl.zeros([BLOCK_R], dtype=tl.int64)
    own = tl.zeros([BLOCK_R], dtype=tl.int64)
    alloc_base = alloc_ptr + candidate.to(tl.int64) * alloc_stride
    for first in range(0, experts, BLOCK_E):
        expert = first + tl.arange(0, BLOCK_E)
        mask = (expert < experts)[:, None] & rank_mask[None, :]
        # rows[e, d]: rows of expert e on rank d; counts[e, r]: entries of expert e from rank r.
        rows = tl.load(alloc_base + expert[:, None] * RANKS + rank[None, :], mask=mask, other=0).to(tl.int64)
        counts = tl.load(hist_ptr + rank[None, :] * experts + expert[:, None], mask=mask, other=0).to(tl.int64)
        tiles = (rows + tile_rows - 1) // tile_rows
        compute = tl.maximum(tiles * (tile_rows * row_fs), weight_fs)
        gemm += tl.sum(tl.where(rows > 0, compute + group_fs, 0), axis=0)
        home = expert // epn
        foreign = (rows > 0) & (home[:, None] != rank[None, :])
        received += tl.sum(foreign.to(tl.int64), axis=0)
        receivers = tl.sum(foreign.to(tl.int64), axis=1)  # [BLOCK_E] ranks each expert is lent to
        lent += tl.sum(tl.where(home[:, None] == rank[None, :], receivers[:, None], 0), axis=0)
        # Entries of an expert ordered by source rank, cut into chunks by destination rank.
        source_end = tl.cumsum(counts, axis=1)
        chunk_end = tl.cumsum(rows, axis=1)
        overlap = tl.minimum(source_end, chunk_end) - tl.maximum(source_end - counts, chunk_end - rows)
        local += tl.sum(tl.maximum(overlap, 0), axis=0)
        computed += tl.sum(rows, axis=0)
        own += tl.sum(counts, axis=0)
    moved = tl.sum(tl.where(rank_mask, received, 0), axis=0)
    push = tl.maximum(received, lent) * weight_link_fs + tl.where(moved > 0, push_fs, 0)
    link = tl.maximum(own - local, computed - local) * row_link_fs
    rank_fs = gemm + push + link
    tl.store(rank_fs_ptr + candidate * RANKS + rank, rank_fs, mask=rank_mask)
    tl.store(layer_fs_ptr + candidate, tl.max(tl.where(rank_mask, rank_fs, -1), axis=0))
    tl.store(moved_ptr + candidate, moved)
    tl.store(bytes_ptr + candidate, moved * weight_bytes.to(tl.int64))


def predict_triton(tokens_per_expert: torch.Tensor, alloc: torch.Tensor, constants: CostConstants) -> Prediction:
    """:func:`flatep.plan.cost.predict` in one launch (bit-equal; on the GPU or the interpreter).

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
    block_e = max(1, min(triton.next_power_of_2(experts), _TILE_ELEMENTS // block_r))
    device = alloc.device
    rank_fs = torch.empty(candidates, ranks, dtype=torch.int64, device=device)
    layer_fs = torch.empty(candidates, dtype=torch.int64, device=device)
    moved = torch.empty(candidates, dtype=torch.int64, device=device)
    moved_bytes = torch.empty(candidates, dtype=torch.int64, device=device)
    _predict_kernel[(candidates,)](
        tokens_per_expert.contiguous(), alloc, alloc.stride(0), rank_fs, layer_fs, moved, moved_bytes,
        experts, experts // ranks, constants.tile_rows, constants.row_fs, constants.weight_fs, constants.group_fs,
        constants.push_fs, constants.weight_bytes * constants.byte_fs, constants.row_bytes * constants.byte_fs,
        constants.weight_bytes, RANKS=ranks, BLOCK_R=block_r, BLOCK_E=block_e, num_warps=4,
    )
    return Prediction(rank_fs=rank_fs, layer_fs=layer_fs, experts_moved=moved, bytes_moved=moved_bytes)


@triton.jit
def _choose_kernel(
    layer_fs_ptr, tables_ptr, chosen_ptr, choice_ptr, table_size,
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
    least = tl.min(tl.where(real, time, 2**63 - 1), axis=0)
    best = tl.min(tl.where(real & (time == least), candidate, BLOCK_C), axis=0).to(tl.int64)
    if tl.program_id(0) == 0:
        tl.store(choice_ptr, best)
    word = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = word < table_size
    tl.store(chosen_ptr + word, tl.load(tables_ptr + best * table_size + word, mask=inside), mask=inside)


def choose_triton(layer_fs: torch.Tensor, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``auto``'s choice and the chosen row of ``tables``, in one launch (no host sync).

    Args:
        layer_fs: ``[C]`` int64 predicted busiest-rank time of each candidate (``Prediction.layer_fs``).
        tables: ``[C, S]`` int32, contiguous: each candidate's tables, on the same device.

    Returns:
        ``(choice [] int64, chosen [S] int32)``: the first candidate with the least time
        (:func:`flatep.plan.auto.choose`) and a copy of its row of ``tables``.
    """
    if layer_fs.dim() != 1 or layer_fs.dtype != torch.int64 or not layer_fs.is_contiguous():
        raise ValueError(f"layer_fs must be a contiguous [C] int64 tensor, got {layer_fs.dtype} {list(layer_fs.shape)}")
    if tables.dim() != 2 or tables.shape[0] != layer_fs.shape[0] or not tables.is_contiguous():
        raise ValueError(f"tables must be a contiguous [C={layer_fs.shape[0]}, S] tensor, got {list(tables.shape)}")
    if tables.device != layer_fs.device:
        raise ValueError(f"tables must be on {layer_fs.device} like layer_fs, got {tables.device}")
    candidates, size = tables.shape
    choice = torch.empty((), dtype=torch.int64, device=tables.device)
    chosen = torch.empty(size, dtype=tables.dtype, device=tables.device)
    block = min(4096, triton.next_power_of_2(max(size, 1)))
    _choose_kernel[(max(1, triton.cdiv(size, block)),)](
        layer_fs, tables, chosen, choice, size, CANDIDATES=candidates, BLOCK_C=triton.next_power_of_2(candidates),
        BLOCK=block, num_warps=4,
    )
    return choice, chosen
