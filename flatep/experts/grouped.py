"""Grouped SwiGLU experts over a receive shard: ``torch._grouped_mm`` with ``offs = offsets``."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped_matmul(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[i] = rows[i] @ weights[g(i)].T`` for the group ``g(i)`` holding row ``i``.

    Args:
        rows: ``[M, in]``.
        weights: ``[G, out, in]`` (vLLM layout; passed transposed, no copy).
        offsets: ``[G]`` int32 inclusive end row of each group; rows past ``offsets[-1]`` are
            left unwritten.
    """
    if rows.is_cuda and rows.dtype != torch.bfloat16:
        # The CUDA grouped GEMM is bf16-only: fall back to one matmul per group (host sync; for checks).
        out = torch.empty(rows.shape[0], weights.shape[1], dtype=rows.dtype, device=rows.device)
        start = 0
        for group, end in enumerate(offsets.tolist()):
            out[start:end] = rows[start:end] @ weights[group].T
            start = end
        return out
    return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=offsets)


def grouped_swiglu(
    shard: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """The experts of one rank over its receive shard.

    ``y = (silu(x W_gate^T) * (x W_up^T) * route_weight) W_2^T`` per row, with the weights of the
    row's group; activations in fp32, GEMMs in the shard's dtype.

    Args:
        shard: ``[rows, H]`` received rows (padding rows zero).
        route_weights: ``[rows]`` fp32 route weight of each row (padding rows zero; rows past the
            last group may hold stale values and are ignored).
        w13: ``[2*epn, 2I, H]`` gate rows then up rows of each group's expert.
        w2: ``[2*epn, H, I]``.
        offsets: ``[2*epn]`` int32 inclusive padded end row of each group.

    Returns:
        ``[rows, H]`` in the shard's dtype; rows past ``offsets[-1]`` are undefined.
    """
    intermediate = w2.shape[-1]
    hidden_states = _grouped_matmul(shard, w13, offsets)
    gate = hidden_states[:, :intermediate].float()
    up = hidden_states[:, intermediate:].float()
    weights = torch.nan_to_num(route_weights, nan=0.0, posinf=0.0, neginf=0.0).unsqueeze(-1)
    activated = (F.silu(gate) * up * weights).to(shard.dtype)
    return _grouped_matmul(activated, w2, offsets)
