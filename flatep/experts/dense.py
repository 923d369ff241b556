"""A dense, single-device MoE: the function an EP layer must compute."""
from __future__ import annotations

import torch

from flatep.experts.grouped import Activation, swiglu


def dense_moe(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Activation = swiglu,
) -> torch.Tensor:
    """``out[t] = sum_k w[t,k] * (W2_e act(Wg_e x_t + bg_e, Wu_e x_t + bu_e) + b2_e)`` with ``e = topk_ids[t,k]``, in fp32.

    Args:
        x: ``[..., H]`` tokens (any leading shape).
        topk_ids: ``[..., K]`` int expert ids (``< 0`` = padded entry, contributes nothing).
        topk_weights: ``[..., K]`` route weights.
        w13: ``[E, 2I, H]`` gate rows then up rows; w2: ``[E, H, I]``.
        b13: optional ``[E, 2I]`` gate then up bias; b2: optional ``[E, H]`` down bias.
        activation: ``act(gate, up)`` (default ``silu(gate) * up``).

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
        if b13 is not None:
            projected = projected + b13[expert].float()
        expert_out = activation(projected[:, :intermediate], projected[:, intermediate:]) @ w2[expert].float().T
        if b2 is not None:
            expert_out = expert_out + b2[expert].float()
        out.index_add_(0, token, expert_out * weights[token, slot].unsqueeze(-1))
    return out.view(*x.shape[:-1], hidden)
