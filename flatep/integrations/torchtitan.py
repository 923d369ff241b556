"""FlatEP as the expert-parallel routed experts of torchtitan MoE models.

:func:`apply_flatep` switches a torchtitan MoE model (Qwen3-MoE, DeepSeek-V3, or any model built
from torchtitan's ``MoE`` module with ``GroupedExperts``) to FlatEP, in place.

The seam is torchtitan's ``RoutedExperts``: ``MoE.forward`` runs its router (and its bookkeeping of
tokens per expert), then calls ``routed_experts(x, topk_scores, topk_expert_ids, counts)``, whose
token dispatcher and ``GroupedExperts`` sort (or all-to-all) the tokens, compute the experts and
scatter the weighted results back; then it adds the shared experts. Only that call is replaced, by
a :class:`FlatEPRoutedExperts` that runs :func:`flatep.ep_moe` over an EP group: the router, its
scores (softmax or sigmoid, group-limited routing, ``route_norm``, ``route_scale``, the
load-balancing ``expert_bias_E``) and the shared experts stay torchtitan's code.

The expert weights stay torchtitan's parameters, under their own names
(``...moe.routed_experts.inner_experts.w1_EFD``, ``w2_EDF``, ``w3_EFD``): optimizers, checkpoints and
``init_states`` see the model they saw before. FlatEP's ``w13 [E, 2F, D]`` is their concatenation
``[w1; w3]`` along the hidden rows, made in every forward (a differentiable copy, so gradients reach
``w1_EFD`` and ``w3_EFD``); ``w2_EDF [E, D, F]`` is FlatEP's ``w2`` as it is.

Rounding: torchtitan's ``GroupedExperts`` casts tokens and expert weights to bfloat16 whatever the
model's dtype, runs the three GEMMs and the SiLU gate in bfloat16, and weights each expert's output
by its route score in fp32 before summing the ``K`` products in the model's dtype. With the default
``expert_dtype=torch.bfloat16`` FlatEP does the same (its ``native`` precision, rows summed in the
model's dtype), so a forward gives torchtitan's outputs up to the GEMMs' own summation order.
``expert_dtype=None`` computes the experts in the model's dtype instead (fp32 end to end for an fp32
model). The backward is FlatEP's (:mod:`flatep.backward`): fp32 for every expert, whatever the dtype.

Transports:

- local (``flatep.init_group("local", ranks=R)``): one process holds the whole model; each MoE call's
  ``T = B * L`` tokens are split into ``R`` virtual ranks of ``s = ceil(T / R)`` tokens (the last
  ranks padded; padding is left out of the plan).
- collective (``flatep.init_group("collective")``, one process per rank over torch.distributed):
  every rank runs the whole model on its own batch and keeps only its ``E / R`` home experts (rank
  ``r``: experts ``[r*E/R, (r+1)*E/R)``); the other parameters are replicated, and averaging their
  gradients over the ranks (data parallelism, e.g. DDP) is the training loop's job, as it is for
  any data-parallel model. Call :func:`apply_flatep` before building the optimizer there: it
  replaces the expert parameters by this rank's slices.

torchtitan is imported only inside this module (``pip install flatep[torchtitan]``).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatep.config import EPConfig, check_policy
from flatep.experts.pool import ExpertPool
from flatep.layer import ep_moe, plan_step, requiring_grad
from flatep.plan.cost import CostProfile, check_cost
from flatep.transport.base import Group


def _torchtitan_moe_classes() -> tuple[type, type]:
    """torchtitan's ``(RoutedExperts, GroupedExperts)`` classes."""
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts

    return RoutedExperts, GroupedExperts


class FlatEPRoutedExperts(nn.Module):
    """Expert-parallel drop-in for torchtitan's ``RoutedExperts`` (token dispatcher + ``GroupedExperts``).

    ``forward(x_BLD [B, L, D], topk_scores_BLK [B, L, K] fp32, topk_expert_ids_BLK [B, L, K] int64,
    num_local_tokens_per_expert_E [E]) -> [B, L, D]`` in ``x_BLD``'s dtype (float32 or bfloat16):
    torchtitan's calling convention, ``out[t] = sum_k scores[t, k] * expert_{ids[t, k]}(x[t])``.

    Attributes:
        inner_experts: torchtitan's ``GroupedExperts`` module, kept as the holder of the expert
            parameters ``w1_EFD [n, F, D]`` (gate), ``w3_EFD [n, F, D]`` (up), ``w2_EDF [n, D, F]``
            (down), ``n`` = all ``E`` experts on the local transport, this rank's ``E / R`` on the
            collective one. Its own forward is not called.
        config: the group's sizes; ``capacity`` (tokens per rank) grows to the next power of two
            when a call needs more.
        group, policy, backend, cost: as for :func:`flatep.ep_moe`.
        expert_dtype: dtype of the expert GEMMs (``None``: the tokens' dtype).
    """

    def __init__(
        self,
        routed_experts: nn.Module,
        group: Group,
        policy: str,
        *,
        expert_dtype: torch.dtype | None,
        capacity: int,
        align: int,
        tolerance: float,
        backend: str,
        cost: CostProfile | None,
    ) -> None:
        super().__init__()
        inner = routed_experts.inner_experts
        experts, intermediate, hidden = inner.w1_EFD.shape
        self.config = EPConfig(
            ranks=group.world, experts=experts, top_k=routed_experts.token_dispatcher.top_k, hidden=hidden,
            intermediate=intermediate, capacity=capacity, align=align, tolerance=tolerance,
        )
        if not group.stacked:
            # This rank trains its home experts only: keep their slices, drop the rest.
            home = slice(group.first_rank * self.config.experts_per_rank, (group.first_rank + 1) * self.config.experts_per_rank)
            for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
                setattr(inner, name, nn.Parameter(getattr(inner, name).detach()[home].clone()))
        self.inner_experts = inner
        self.group, self.policy, self.backend, self.expert_dtype = group, policy, backend, expert_dtype
        self.cost = cost
        self._pool: ExpertPool | None = None
        self._pool_versions: tuple[int, ...] = ()

    def extra_repr(self) -> str:
        config = self.config
        return (
            f"experts={config.experts}, ranks={config.ranks}, top_k={config.top_k}, dim={config.hidden}, "
            f"hidden_dim={config.intermediate}, policy={self.policy!r}, expert_dtype={self.expert_dtype}"
        )

    def _weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w13 [n, 2F, D], w2 [n, D, F])`` in ``dtype``, differentiable back to the parameters."""
        inner = self.inner_experts
        return torch.cat([inner.w1_EFD, inner.w3_EFD], dim=1).to(dtype), inner.w2_EDF.to(dtype)

    def _expert_pool(self, dtype: torch.dtype) -> ExpertPool:
        """The experts' pool for a step without gradients, rebuilt only when a weight or ``dtype`` changed."""
        inner = self.inner_experts
        parameters = (inner.w1_EFD, inner.w2_EDF, inner.w3_EFD)
        versions = (*(p._version for p in parameters), *(p.data_ptr() for p in parameters), dtype)
        if self._pool is None or versions != self._pool_versions:
            w13, w2 = self._weights(dtype)
            self._pool = ExpertPool(self.config, self.group, dtype)
            self._pool.load_home(w13.detach(), w2.detach())
            self._pool_versions = versions
        return self._pool

    def _cost(self, dtype: torch.dtype) -> CostProfile | None:
        """``auto``'s cost profile, with the bytes one expert of ``dtype`` really has unless it says."""
        if self.policy != "auto":
            return self.cost
        cost = self.cost or CostProfile.default()
        if cost.expert_bytes is not None:
            return cost
        config = self.config
        return cost.with_expert_bytes(3 * config.hidden * config.intermediate * torch.finfo(dtype).bits // 8)

    def forward(
        self,
        x_BLD: torch.Tensor,
        topk_scores_BLK: torch.Tensor,
        topk_expert_ids_BLK: torch.Tensor,
        num_local_tokens_per_expert_E: torch.Tensor,
    ) -> torch.Tensor:
        """Route this call's tokens through :func:`flatep.ep_moe`; shapes as in the class docstring.

        ``num_local_tokens_per_expert_E`` is not needed: FlatEP's planner counts the whole group's
        tokens per expert itself.
        """
        del num_local_tokens_per_expert_E
        batch, length, hidden = x_BLD.shape
        top_k = self.config.top_k
        dtype = self.expert_dtype or x_BLD.dtype
        x = x_BLD.reshape(-1, hidden).to(dtype)
        ids = topk_expert_ids_BLK.reshape(-1, top_k)
        scores = topk_scores_BLK.reshape(-1, top_k).float()
        tokens = x.shape[0]
        if self.group.stacked:
            step = -(-tokens // self.group.world)
            padded = self.group.world * step
            counts: list[int] | int = [min(max(tokens - rank * step, 0), step) for rank in range(self.group.world)]
            shape = (self.group.world, step)
        else:
            # Ranks exchange rows of one common size: the largest token count of the group.
            everyone = self.group.all_gather(torch.tensor([tokens], dtype=torch.int64, device=self.group.device))
            step = padded = int(everyone.max())
            counts, shape = tokens, (step,)
        x = F.pad(x, (0, 0, 0, padded - tokens)).view(*shape, hidden)
        ids = F.pad(ids, (0, 0, 0, padded - tokens), value=-1).view(*shape, top_k)
        scores = F.pad(scores, (0, 0, 0, padded - tokens)).view(*shape, top_k)
        if step > self.config.capacity:
            self.config = self.config.replace(capacity=1 << (step - 1).bit_length())
        plan = plan_step(ids, self.config, self.group, self.policy, tokens=counts, dtype=dtype, cost=self._cost(dtype))
        # torchtitan weights each expert output by its score in fp32 and sums the K products in the
        # model's dtype: FlatEP's native precision with the model's dtype in combine does the same.
        options = dict(group=self.group, config=self.config, policy=self.policy, plan=plan, precision="native",
                       combine_dtype=x_BLD.dtype, backend=self.backend)
        inner = self.inner_experts
        if requiring_grad(x=x_BLD, scores=topk_scores_BLK, **dict(inner.named_parameters())):
            w13, w2 = self._weights(dtype)
            out = ep_moe(x, ids, scores, w13, w2, **options)
        else:
            out = ep_moe(x, ids, scores, pool=self._expert_pool(dtype), **options)
        return out.reshape(padded, hidden)[:tokens].view(batch, length, hidden)


def apply_flatep(
    model: nn.Module,
    group: Group,
    policy: str = "exact",
    *,
    expert_dtype: torch.dtype | None = torch.bfloat16,
    capacity: int = 64,
    align: int | None = None,
    tolerance: float = 0.0,
    backend: str = "auto",
    cost: CostProfile | None = None,
) -> list[str]:
    """Switch every torchtitan MoE layer of ``model`` to FlatEP's expert parallelism, in place.

    Each ``RoutedExperts`` module (token dispatcher + ``GroupedExperts``) is replaced by a
    :class:`FlatEPRoutedExperts` that keeps its expert parameters; routers and shared experts stay.
    Call it on the plain (not yet parallelised: no DTensor parameters) model, before building the
    optimizer.

    Args:
        model: a torchtitan model whose MoE layers are torchtitan's ``MoE`` with ``GroupedExperts``
            (Qwen3-MoE, DeepSeek-V3, ...), float32 or bfloat16, on ``group.device``; ``R`` must
            divide the expert count.
        group: from :func:`flatep.init_group` (``local`` or ``collective`` to train).
        policy: ``exact`` (flat per-rank load), ``bounded``, ``none`` (classic EP) or ``auto`` (the
            cheapest by the cost model), as for :func:`flatep.ep_moe`.
        expert_dtype: dtype of the expert GEMMs: ``torch.bfloat16`` (default) as torchtitan's
            ``GroupedExperts`` computes, or ``None`` for the model's dtype.
        capacity: initial tokens per rank per MoE call; grows by itself when a call passes more.
        align: rows each expert's group is padded to (default 128 on CUDA for the grouped GEMM's
            tiles, 8 elsewhere).
        tolerance: rank imbalance ``exact`` lets pass without moving expert weights.
        backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.ep_moe`).
        cost: the :class:`flatep.CostProfile` of ``policy="auto"`` (default: the generic one, with
            this model's expert bytes).

    Returns:
        The names of the replaced modules (``layers.0.moe.routed_experts``, ...).

    Raises:
        ValueError: no MoE layer, experts that are not plain ``GroupedExperts`` (e.g. low-precision
            converters, which change the expert function), DTensor (already parallelised) parameters,
            a model on another device than the group, sizes FlatEP cannot split.
    """
    check_policy(policy)
    check_cost(policy, cost)
    if expert_dtype not in (None, torch.bfloat16, torch.float32):
        raise ValueError(f"expert_dtype must be torch.bfloat16, torch.float32 or None, got {expert_dtype}")
    from torch.distributed.tensor import DTensor

    routed_type, grouped_type = _torchtitan_moe_classes()
    targets = [name for name, module in model.named_modules() if isinstance(module, routed_type)]
    if not targets:
        raise ValueError(f"found no torchtitan RoutedExperts (MoE layer) in {type(model).__name__}")
    if align is None:
        align = 128 if group.device.type == "cuda" else 8
    for name in targets:
        routed = model.get_submodule(name)
        inner = routed.inner_experts
        if type(inner) is not grouped_type:
            raise ValueError(f"{name}.inner_experts is {type(inner).__name__}, not torchtitan's GroupedExperts: "
                             "FlatEP computes GroupedExperts' SwiGLU experts only")
        if any(isinstance(p, DTensor) for p in inner.parameters()):
            raise ValueError(f"{name}: its experts are DTensors (already parallelised): apply FlatEP to the plain model")
        if inner.w1_EFD.device != group.device:
            raise ValueError(f"{name}: the experts are on {inner.w1_EFD.device}, the group on {group.device}")
        parent, _, child = name.rpartition(".")
        replacement = FlatEPRoutedExperts(
            routed, group, policy, expert_dtype=expert_dtype, capacity=capacity, align=align, tolerance=tolerance,
            backend=backend, cost=cost,
        )
        setattr(model.get_submodule(parent), child, replacement)
    return targets
