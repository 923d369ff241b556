"""Combine: each token gathers its K rows from the shards and sums them in fp32 (unweighted).

The experts have already multiplied each row by its route weight, so combine is a plain sum. The
grid is 1-D and its programs walk (rank, token block) items with a grid-stride loop, so a capped
grid (``programs``) sums every token exactly as an uncapped one does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import column_block, comm_grid, token_block


@triton.jit
def _combine_kernel(
    out_ptr, dest_rank_ptr, dest_row_ptr, shard_ptr, shard_peers_ptr,
    tokens, blocks, work, out_rank_stride, entry_rank_stride,
    H: tl.constexpr, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_T tokens), all on grid axis 0 (axis 1 stops at 65,535
    # programs); a grid-stride loop lets a capped grid cover every item.
    for step in range(tl.program_id(0), work, tl.num_programs(0)):
        local, token, token_mask, entry_base = token_block(step, blocks, tokens, entry_rank_stride, K, BLOCK_T)
        out_rows = out_ptr + local * out_rank_stride + token * H
        for start in range(0, H, BLOCK_H):
            column = start + tl.arange(0, BLOCK_H)
            column_mask = column < H
            total = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
            for k in tl.static_range(K):
                dest = tl.load(dest_rank_ptr + entry_base + k, mask=token_mask, other=-1)
                row = tl.load(dest_row_ptr + entry_base + k, mask=token_mask, other=0)
                live = token_mask & (dest >= 0)
                source = tl.load(shard_peers_ptr + dest, mask=live, other=0) + row.to(tl.int64) * H
                values = tl.load(shard_ptr + source[:, None] + column[None, :], mask=live[:, None] & column_mask[None, :], other=0.0)
                total += values.to(tl.float32)
            tl.store(out_rows[:, None] + column[None, :], total.to(out_ptr.dtype.element_ty), mask=token_mask[:, None] & column_mask[None, :])


def combine_grid(ranks_here: int, tokens: int, block_t: int = 1, programs: int | None = None) -> tuple[int]:
    """Grid of the combine kernel: 1-D, one program per (rank driven, block of ``block_t`` tokens), at most ``programs``.

    Raises:
        ValueError: if the launch would exceed the kernels' work-item limit (:func:`comm_grid`).
    """
    return comm_grid(ranks_here * triton.cdiv(tokens, block_t), programs, "token blocks")


def combine_triton(
    out: torch.Tensor,
    dest_rank: torch.Tensor,
    dest_row: torch.Tensor,
    shard: torch.Tensor,
    shard_peers: torch.Tensor,
    block_t: int = 1,
    block_h: int | None = None,
    num_warps: int = 4,
    programs: int | None = None,
) -> None:
    """``out[r, t] = sum_k shard[dest_rank[r,t,k]][dest_row[r,t,k]]``, accumulated in fp32.

    Args:
        out: ``[n, s, H]`` output of the ``n`` ranks this process drives (written; padded tokens
            get zeros).
        dest_rank, dest_row: ``[n, s, K]`` int32 from the plan.
        shard: base of this process's shard buffer (``[.., rows, H]``).
        shard_peers: ``[R] int64`` element offsets of every rank's shard from ``shard``'s base.
        block_t, block_h, num_warps: tuning (see ``python -m flatep.bench.kernels``). The defaults
            (one token per program, 2 KiB column chunks, 4 warps) were the best or within 3% of it
            on the H200 for Kimi-K2 and Kimi-K3 at s=1024 and 4096
            (``bench/results/2026-12-02-h200-b/kernels-*.log``): more tokens per program hold
            ``block_t*block_h`` fp32 sums in registers and spill.
        programs: at most this many programs (``None``: one per token block), to leave SMs to
            work running beside combine; results do not depend on it.

    Raises:
        ValueError: for a launch beyond the kernel's limits (:func:`combine_grid`), before it runs.
    """
    ranks_here, tokens, hidden = out.shape
    top_k = dest_rank.shape[-1]
    grid = combine_grid(ranks_here, tokens, block_t, programs)
    block_h = block_h or column_block(hidden, shard.element_size())
    _combine_kernel[grid](
        out, dest_rank, dest_row, shard, shard_peers,
        tokens, triton.cdiv(tokens, block_t), ranks_here * triton.cdiv(tokens, block_t), tokens * hidden, tokens * top_k,
        H=hidden, K=top_k, BLOCK_T=block_t, BLOCK_H=block_h, num_warps=num_warps,
    )


def combine_torch(dest_rank: torch.Tensor, dest_row: torch.Tensor, shards: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Plain-torch combine on stacked shards: ``[R, s, H]`` in ``out_dtype``.

    Args:
        dest_rank, dest_row: ``[R, s, K]`` int32 (``-1`` = padded entry, contributes nothing).
        shards: ``[R, rows, H]``.
    """
    valid = dest_rank >= 0
    rows = shards[dest_rank.clamp_min(0).long(), dest_row.clamp_min(0).long()].float()
    rows = torch.where(valid.unsqueeze(-1), rows, 0.0)  # unplanned rows may hold garbage, even NaN
    return rows.sum(2).to(out_dtype)
