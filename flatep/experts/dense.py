"""A dense, single-device MoE: the function an EP layer must compute."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def dense_moe(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * W2_e (silu(Wg_e x_t) * (Wu_e x_t))`` with ``e = topk_ids[t,k]``, in fp32.

    Args:
        x: ``[..., H]`` tokens (any leading shape).
        topk_ids: ``[..., K]`` int expert ids (``< 0`` = padded entry, contributes nothing).
        topk_weights: ``[..., K]`` route weights.
        w13: ``[E, 2I, H]``; w2: ``[E, H, I]``.

    Returns:
        ``[..., H]`` float32.
    """
    hidden = x.shape[-1]
    intermediate = w2.shape[-1]
    tokens = x.reshape(-1, hidden).float()
    ids = topk_ids.reshape(tokens.shape[0], -1).long()
    weights = topk_weights.reshape(tokens.shape[0], -1).float()
    out = torch.zeros_like(tokens)
    for expert in ids[ids >= 0].unique().tolist():
        token, slot = (ids == expert).nonzero(as_tuple=True)
        projected = tokens[token] @ w13[expert].float().T
        activated = F.silu(projected[:, :intermediate]) * projected[:, intermediate:]
        out.index_add_(0, token, (activated @ w2[expert].float().T) * weights[token, slot].unsqueeze(-1))
    return out.view(*x.shape[:-1], hidden)
