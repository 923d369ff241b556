"""Shared test inputs: fresh random data for every check, never zeros."""
from __future__ import annotations

import torch

from flatep import EPConfig
from flatep.routing import adversarial_topk, skewed_topk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TRITON_BACKENDS = ["torch", "triton"]


def make_inputs(config: EPConfig, tokens: int, routing: str | float, dtype: torch.dtype, seed: int = 0):
    """``x [R, s, H]``, ``topk_ids [R, s, K]``, ``topk_weights [R, s, K]``, ``w13``, ``w2`` on DEVICE."""
    generator = torch.Generator().manual_seed(seed)
    ranks, experts, top_k = config.ranks, config.experts, config.top_k
    if isinstance(routing, str):
        ids = adversarial_topk(routing, ranks, experts, top_k, tokens)
    else:
        ids = skewed_topk(ranks, experts, top_k, tokens, routing, seed=seed)
    x = torch.randn(ranks, tokens, config.hidden, generator=generator)
    weights = torch.rand(ranks, tokens, top_k, generator=generator) + 0.1
    w13 = torch.randn(experts, 2 * config.intermediate, config.hidden, generator=generator) * config.hidden**-0.5
    w2 = torch.randn(experts, config.hidden, config.intermediate, generator=generator) * config.intermediate**-0.5
    to = dict(device=DEVICE)
    return x.to(dtype=dtype, **to), ids.to(**to), weights.to(**to), w13.to(dtype=dtype, **to), w2.to(dtype=dtype, **to)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf."""
    out, reference = out.double(), reference.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - reference).norm() / reference.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-5
