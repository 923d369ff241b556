"""Synthetic routings: lognormal expert popularity, maxvio, sigma bisection, adversarial cases.

All generators return ``topk_ids [R, s, K] int32`` for a whole group (the layout of the
virtual-rank transport); rank ``r``'s part is ``topk_ids[r]``.
"""
from __future__ import annotations

import math

import torch

ADVERSARIAL = ("local", "next", "one", "duplicate")
SHARED_SEED = 1234


def _generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def skewed_topk(
    ranks: int,
    experts: int,
    top_k: int,
    tokens: int,
    sigma: float,
    seed: int = SHARED_SEED,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Top-k ids with lognormal expert popularity.

    Popularity ``p_e = exp(N(0, sigma))`` is drawn from ``seed``, shared by all ranks, so hot
    experts line up across ranks. Each rank ``r`` draws, from its own seed ``seed + 1 + r``,
    ``K`` distinct experts per token with probability proportional to ``p`` (sampling without
    replacement, via the Gumbel top-k trick). ``sigma = 0`` gives a deterministic balanced routing:
    entry ``i`` of the group (rank-major, then token, then k) goes to ``perm[i mod E]`` for a
    shared random permutation ``perm``, so every expert gets ``floor`` or ``ceil`` of the mean.
    The random draws are made on ``device`` (fast on a GPU); a seed gives the same routing on the
    same kind of device, not across CPU and GPU.

    Returns:
        ``[ranks, tokens, top_k] int32`` on ``device``.
    """
    if sigma < 0 or not math.isfinite(sigma):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    if top_k > experts:
        raise ValueError(f"top_k must be <= experts ({experts}), got {top_k}")
    if tokens < 1 or ranks < 1:
        raise ValueError(f"tokens and ranks must be >= 1, got tokens={tokens}, ranks={ranks}")
    device = torch.device(device)
    shared = _generator(seed, device)
    if sigma == 0:
        perm = torch.randperm(experts, generator=shared, device=device)
        entry = torch.arange(ranks * tokens * top_k, device=device)
        ids = perm[entry % experts].view(ranks, tokens, top_k)
    else:
        log_popularity = torch.randn(experts, generator=shared, dtype=torch.float64, device=device) * sigma
        ids = torch.empty(ranks, tokens, top_k, dtype=torch.int64, device=device)
        for rank in range(ranks):
            generator = _generator(seed + 1 + rank, device)
            uniform = torch.rand(tokens, experts, generator=generator, dtype=torch.float64, device=device)
            gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
            ids[rank] = torch.topk(log_popularity + gumbel, top_k, dim=1).indices
    return ids.to(torch.int32)


def adversarial_topk(
    kind: str, ranks: int, experts: int, top_k: int, tokens: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Worst-case routings.

    Kinds:
        ``local``: every token of rank ``r`` picks rank ``r``'s own experts (cycling through them,
        so ids repeat within a token when ``K > E/R``).
        ``next``: every token of rank ``r`` picks the experts of rank ``(r+1) mod R``.
        ``one``: every entry of every rank picks expert 0 (all K ids of a token equal).
        ``duplicate``: all K ids of a token name the same expert of the next rank.

    Returns:
        ``[ranks, tokens, top_k] int32`` on ``device``.
    """
    if kind not in ADVERSARIAL:
        raise ValueError(f"kind must be one of {ADVERSARIAL}, got {kind!r}")
    if experts % ranks:
        raise ValueError(f"experts must be divisible by ranks ({ranks}), got {experts}")
    epn = experts // ranks
    rank = torch.arange(ranks).view(ranks, 1, 1)
    token = torch.arange(tokens).view(1, tokens, 1)
    k = torch.arange(top_k).view(1, 1, top_k)
    if kind == "local":
        ids = rank * epn + (token + k) % epn
    elif kind == "next":
        ids = (rank + 1) % ranks * epn + (token + k) % epn
    elif kind == "one":
        ids = torch.zeros(ranks, tokens, top_k, dtype=torch.int64)
    else:
        ids = ((rank + 1) % ranks * epn + token % epn).expand(ranks, tokens, top_k)
    return ids.expand(ranks, tokens, top_k).to(device=device, dtype=torch.int32).contiguous()


def expert_histogram(topk_ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Tokens per expert over every entry of ``topk_ids`` (any shape); ids < 0 are ignored.

    Returns:
        ``[experts] int64``.
    """
    flat = topk_ids.reshape(-1).long()
    flat = flat[flat >= 0]
    return torch.bincount(flat, minlength=experts)


def maxvio(topk_ids: torch.Tensor, experts: int) -> float:
    """Router imbalance ``max_e(T_e / mean T) - 1`` over all ranks (0 = balanced).

    Args:
        topk_ids: ids of any shape (``[R, s, K]`` for a group); ids < 0 are ignored.
        experts: ``E``; the mean is taken over all ``E`` experts.
    """
    histogram = expert_histogram(topk_ids, experts).double()
    total = histogram.sum()
    if total == 0:
        raise ValueError("topk_ids holds no valid entry (all ids < 0)")
    return float(histogram.max() / (total / experts) - 1)


def sigma_for_maxvio(
    target: float,
    ranks: int,
    experts: int,
    top_k: int,
    tokens: int,
    seed: int = SHARED_SEED,
    steps: int = 60,
    device: torch.device | str = "cpu",
) -> tuple[float, float]:
    """Sigma whose routing (from :func:`skewed_topk` with the same seed) reaches ``target`` maxvio.

    Bisection on a log scale between 1e-5 and 10 (geometric midpoint), stopping when
    ``|maxvio - target| <= max(0.02*target, 0.005)``, else keeping the closest. ``target = 0`` returns
    sigma 0 (the balanced routing). If even the smallest sigma overshoots (the sampling noise floor),
    that sigma is returned. ``device`` is where routings are drawn (see :func:`skewed_topk`).

    Returns:
        ``(sigma, maxvio reached)``.
    """
    if target < 0:
        raise ValueError(f"target must be >= 0, got {target}")
    if target == 0:
        return 0.0, maxvio(skewed_topk(ranks, experts, top_k, tokens, 0.0, seed, device), experts)

    def reached(sigma: float) -> float:
        return maxvio(skewed_topk(ranks, experts, top_k, tokens, sigma, seed, device), experts)

    low, high = 1e-5, 10.0
    best = (low, reached(low))
    if best[1] >= target:
        return best
    tolerance = max(0.02 * target, 0.005)
    for _ in range(steps):
        middle = math.sqrt(low * high)
        value = reached(middle)
        if abs(value - target) < abs(best[1] - target):
            best = (middle, value)
        if abs(value - target) <= tolerance:
            break
        if value < target:
            low = middle
        else:
            high = middle
    return best
