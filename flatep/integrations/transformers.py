"""Expert-parallel routed experts inside Hugging Face transformers models.

:func:`shard_moe` replaces the routed-experts module of every sparse MoE block of a loaded model by a
:class:`FlatEPExperts` that runs :func:`flatep.ep_moe` over an EP group; each rank keeps only its own
experts' weights (plus the borrow slots), and the original expert weights are released.

Routing stays the model's own code. In transformers 5 a sparse block computes
``(top_k_index, top_k_weights)`` with its own router module and then calls
``self.experts(hidden_states, top_k_index, top_k_weights)``; only that ``experts`` module is
replaced, so each family routes exactly as before:

- Qwen3-MoE (``qwen3_moe``): softmax over all experts, top-k, optional renormalisation.
- DeepSeek-V3 and Kimi-K2 (``deepseek_v3``; load Kimi-K2 checkpoints with ``DeepseekV3ForCausalLM``):
  sigmoid scores, score-correction bias, grouped top-k, routed scaling factor. Shared experts and the
  dense first layers stay as they are (replicated on every rank).
- gpt-oss (``gpt_oss``): top-k over router logits, softmax over the selected ones; its experts'
  biases and clamped SwiGLU (:class:`flatep.experts.ClampedSwiGLU`) are reproduced, its interleaved
  gate/up columns are reordered to FlatEP's gate-rows-then-up-rows layout when the pool is built.

Two ways of running, as everywhere in FlatEP:

- local transport (``flatep.init_group("local", ranks=R)``): one process runs the whole model; each
  MoE call's ``T`` tokens are split into ``R`` virtual ranks of ``s = ceil(T/R)`` tokens (the last
  ranks padded, padding excluded from the plan by per-rank token counts).
- per-process transports (one process per rank): every rank runs the whole model on its own batch
  (data-parallel attention) and only the routed experts are sharded. Ranks must call every MoE layer
  the same number of times (e.g. generate the same number of tokens); their token counts may differ.

Transformers is imported only inside this module (``pip install flatep[transformers]``, >= 5.0).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from flatep.config import EPConfig, check_policy
from flatep.plan.cost import CostProfile, check_cost
from flatep.experts.grouped import PRECISIONS, Activation, ClampedSwiGLU, swiglu
from flatep.experts.pool import ExpertPool
from flatep.quant.tensor import QuantizedTensor, check_format
from flatep.kernels.fp8_rows import check_dispatch_dtype
from flatep.layer import ep_moe, plan_step
from flatep.transport.base import Group


@dataclass(frozen=True)
class ExpertWeights:
    """One layer's routed experts in FlatEP's layout (a contiguous slice ``[lo, hi)`` of them).

    Attributes:
        w13: ``[n, 2I, H]`` gate rows then up rows (float, or packed: :class:`flatep.quant.QuantizedTensor`).
        w2: ``[n, H, I]``, like ``w13``.
        b13: ``[n, 2I]`` gate then up bias, or None.
        b2: ``[n, H]`` down bias, or None.
    """

    w13: torch.Tensor | QuantizedTensor
    w2: torch.Tensor | QuantizedTensor
    b13: torch.Tensor | None
    b2: torch.Tensor | None


@dataclass(frozen=True)
class Family:
    """A supported model family.

    Attributes:
        name: for messages.
        model_type: ``config.model_type`` of its transformers models.
        experts_class: name of its fused routed-experts module class in ``transformers.models.<model_type>``.
        convert: ``(experts module, lo, hi) -> ExpertWeights`` of experts ``[lo, hi)``.
        activation: ``(experts module, model config) -> act(gate, up)``.
        fp8_experts: whether transformers' FP8 experts modules of this family (DeepSeek-V3's
            checkpoint layout, :func:`fp8_experts_type`) are taken as they are, in fp8.
    """

    name: str
    model_type: str
    experts_class: str
    convert: Callable[[nn.Module, int, int], ExpertWeights]
    activation: Callable[[nn.Module, object], Activation]
    fp8_experts: bool = False

    def experts_type(self) -> type:
        """The family's experts module class."""
        module = importlib.import_module(f"transformers.models.{self.model_type}.modeling_{self.model_type}")
        return getattr(module, self.experts_class)

    def experts_types(self) -> tuple[type, ...]:
        """Every experts module class :func:`shard_moe` takes in this family's models."""
        fp8 = fp8_experts_type() if self.fp8_experts else None
        return (self.experts_type(),) + ((fp8,) if fp8 is not None else ())


def fp8_experts_type() -> type | None:
    """transformers' fp8 experts module (``FP8Experts``, what ``FineGrainedFP8Config`` checkpoints such
    as DeepSeek-V3's load into on a GPU of compute capability 8.9 or more), or None where this
    transformers has none."""
    try:
        from transformers.integrations.finegrained_fp8 import FP8Experts
    except ImportError:
        return None
    return FP8Experts


def require_transformers_5() -> None:
    """Raise ``ImportError`` unless transformers >= 5 is installed: its sparse blocks call a fused
    experts module as ``experts(hidden_states, top_k_index, top_k_weights)``, the seam FlatEP uses
    (transformers 4 loops over per-expert modules inside each block's forward)."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ImportError(f"flatep.integrations.transformers needs transformers >= 5.0, found {transformers.__version__}")


def _fused_swiglu_weights(experts: nn.Module, lo: int, hi: int) -> ExpertWeights:
    """Qwen3-MoE / DeepSeek-V3: ``gate_up_proj [E, 2I, H]`` (gate rows then up rows), ``down_proj [E, H, I]``."""
    return ExpertWeights(experts.gate_up_proj.detach()[lo:hi], experts.down_proj.detach()[lo:hi], None, None)


def _silu_activation(experts: nn.Module, model_config: object) -> Activation:
    activation = model_config.hidden_act
    if activation not in ("silu", "swish"):
        raise ValueError(f"{type(experts).__name__}: FlatEP runs SiLU-gated experts, got hidden_act={activation!r}")
    return swiglu


def _fp8_swiglu_weights(experts: nn.Module, lo: int, hi: int) -> ExpertWeights:
    """transformers' ``FP8Experts``: ``gate_up_proj [E, 2I, H]`` e4m3 (gate rows then up rows) with
    ``gate_up_proj_scale_inv [E, 2I/128, H/128]`` fp32, ``down_proj [E, H, I]`` likewise: DeepSeek-V3's
    checkpoint layout, which is FlatEP's fp8 format (:mod:`flatep.quant.fp8`), taken as it is.

    Raises:
        ValueError: for settings FlatEP's fp8 experts do not compute (other blocks or scale
            formats, static activation scales, biases, clamped or soft-capped gates).
    """
    settings = dict(
        has_gate=getattr(experts, "has_gate", True), has_bias=getattr(experts, "has_bias", False),
        block_size=tuple(experts.block_size or ()), activation_scheme=experts.activation_scheme,
        values=experts.gate_up_proj.dtype, scales=experts.gate_up_proj_scale_inv.dtype,
        limit=getattr(experts, "limit", None), swiglu_alpha=getattr(experts, "swiglu_alpha", None),
        gate_softcap=getattr(experts, "gate_softcap", None),
    )
    supported = dict(has_gate=True, has_bias=False, block_size=(128, 128), activation_scheme="dynamic",
                     values=torch.float8_e4m3fn, scales=torch.float32, limit=None, swiglu_alpha=None, gate_softcap=None)
    differing = {key: value for key, value in settings.items() if value != supported[key]}
    if differing:
        raise ValueError(f"{type(experts).__name__}: FlatEP's fp8 experts take {supported}; these experts have {differing}")
    w13 = QuantizedTensor("fp8", experts.gate_up_proj.detach()[lo:hi], experts.gate_up_proj_scale_inv.detach()[lo:hi])
    w2 = QuantizedTensor("fp8", experts.down_proj.detach()[lo:hi], experts.down_proj_scale_inv.detach()[lo:hi])
    return ExpertWeights(w13, w2, None, None)


def _gpt_oss_weights(experts: nn.Module, lo: int, hi: int) -> ExpertWeights:
    """gpt-oss: ``gate_up_proj [E, H, 2I]`` with interleaved gate/up columns (gate even, up odd) and
    bias ``[E, 2I]`` likewise; ``down_proj [E, I, H]``, bias ``[E, H]``."""
    gate_up = experts.gate_up_proj.detach()[lo:hi]
    gate_up_bias = experts.gate_up_proj_bias.detach()[lo:hi]
    w13 = torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=-1).transpose(1, 2)
    b13 = torch.cat([gate_up_bias[..., 0::2], gate_up_bias[..., 1::2]], dim=-1)
    w2 = experts.down_proj.detach()[lo:hi].transpose(1, 2)
    return ExpertWeights(w13, w2, b13, experts.down_proj_bias.detach()[lo:hi])


def _gpt_oss_activation(experts: nn.Module, model_config: object) -> Activation:
    return ClampedSwiGLU(alpha=float(experts.alpha), limit=float(experts.limit))


FAMILIES: tuple[Family, ...] = (
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeExperts", _fused_swiglu_weights, _silu_activation, fp8_experts=True),
    Family("DeepSeek-V3 / Kimi-K2", "deepseek_v3", "DeepseekV3Experts", _fused_swiglu_weights, _silu_activation,
           fp8_experts=True),
    Family("gpt-oss", "gpt_oss", "GptOssExperts", _gpt_oss_weights, _gpt_oss_activation),
)


def family_of(model: nn.Module) -> Family:
    """The :class:`Family` of a transformers model, from ``model.config.model_type``.

    Raises:
        ValueError: for any other model, naming the supported families.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    supported = ", ".join(f"{family.name} (model_type {family.model_type!r})" for family in FAMILIES)
    raise ValueError(
        f"shard_moe supports {supported}; got {type(model).__name__} with model_type {model_type!r}"
    )


class FlatEPExperts(nn.Module):
    """Expert-parallel drop-in for a transformers routed-experts module.

    ``forward(hidden_states [T, H], top_k_index [T, K] int, top_k_weights [T, K] float) -> [T, H]``
    in ``hidden_states``' dtype (bfloat16 or float32), the calling convention of transformers 5
    experts modules. ``T`` is this process's tokens of one MoE call.

    Attributes:
        pool: this process's ranks' expert weights (home experts and borrow slots).
        config: the group's sizes; ``capacity`` grows (to a power of two) when a call needs it,
            unless ``fixed_capacity``.
        group, policy, backend, activation, precision, dispatch_dtype: as for :func:`flatep.ep_moe`.
        fixed_capacity: on the per-process transports, every rank pads each call to
            ``config.capacity`` tokens instead of agreeing on the group's largest call (an
            all-gather read on the host): a call then never synchronises with the host for its
            size, so a step can be captured in a CUDA graph; a call with more tokens raises.
        record_routing: keep each call's tokens per expert and rows per rank (see :meth:`maxvio`).
        tokens_per_expert: per recorded call, ``[E]`` tokens routed to each expert over the group.
        received: per recorded call, ``[R]`` real rows each rank computed.
    """

    def __init__(
        self,
        pool: ExpertPool,
        config: EPConfig,
        group: Group,
        policy: str,
        activation: Activation,
        backend: str = "auto",
        record_routing: bool = False,
        precision: str = "native",
        cost: CostProfile | None = None,
        fixed_capacity: bool = False,
        dispatch_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.pool, self.config, self.group, self.policy, self.cost = pool, config, group, policy, cost
        self.activation, self.backend, self.record_routing = activation, backend, record_routing
        self.precision, self.fixed_capacity, self.dispatch_dtype = precision, fixed_capacity, dispatch_dtype
        self.tokens_per_expert: list[torch.Tensor] = []
        self.received: list[torch.Tensor] = []

    def extra_repr(self) -> str:
        config = self.config
        return (
            f"experts={config.experts}, ranks={config.ranks}, top_k={config.top_k}, hidden={config.hidden}, "
            f"intermediate={config.intermediate}, policy={self.policy!r}, precision={self.precision!r}, "
            f"weights={self.pool.weights!r}, biases={self.pool.b13 is not None}"
        )

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """transformers' experts call: ``hidden_states [T, H]``, ``top_k_index [T, K]``, ``top_k_weights [T, K]`` -> ``[T, H]``."""
        if hidden_states.dim() != 2 or top_k_index.shape != (hidden_states.shape[0], self.config.top_k):
            raise ValueError(
                f"expected hidden_states [T, H] and top_k_index [T, K={self.config.top_k}], got "
                f"{list(hidden_states.shape)} and {list(top_k_index.shape)}"
            )
        # transformers weights each row in promote(hidden dtype, route-weight dtype) and rounds once
        # after the sum over k: fp32 route weights (DeepSeek-V3, Kimi-K2) need fp32 rows in combine.
        combine_dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype) if self.precision == "native" else None
        if self.group.stacked:
            return self._forward_virtual_ranks(hidden_states, top_k_index, top_k_weights, combine_dtype)
        return self._forward_this_rank(hidden_states, top_k_index, top_k_weights, combine_dtype)

    def _config_for(self, step: int) -> EPConfig:
        """The config with a capacity of at least ``step`` tokens per rank (buffers are cached by shape)."""
        if step > self.config.capacity:
            self.config = self.config.replace(capacity=1 << (step - 1).bit_length())
        return self.config

    def _forward_virtual_ranks(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, combine_dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Local transport: rank ``r`` takes tokens ``[r*s, (r+1)*s)``; the tail is padding, left out of the plan."""
        tokens, hidden = x.shape
        ranks, top_k = self.group.world, self.config.top_k
        step = -(-tokens // ranks)
        pad = ranks * step - tokens
        counts = [min(max(tokens - rank * step, 0), step) for rank in range(ranks)]
        x = F.pad(x, (0, 0, 0, pad)).view(ranks, step, hidden)
        ids = F.pad(ids, (0, 0, 0, pad), value=-1).view(ranks, step, top_k)
        weights = F.pad(weights.float(), (0, 0, 0, pad)).view(ranks, step, top_k)
        out = self._step(x, ids, weights, step, counts, combine_dtype)
        return out.view(ranks * step, hidden)[:tokens]

    def _forward_this_rank(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, combine_dtype: torch.dtype | None
    ) -> torch.Tensor:
        """Per-process transports: every rank passes ``s`` tokens, its own first and padding after
        (left out of the plan by this rank's token count): ``s`` = the capacity with
        ``fixed_capacity``, else the largest token count of the group (:meth:`_group_step`)."""
        tokens = x.shape[0]
        if self.fixed_capacity and tokens > self.config.capacity:
            raise ValueError(
                f"hidden_states has {tokens} tokens, more than the fixed capacity of {self.config.capacity} per rank "
                "(shard_moe(..., capacity=...) with fixed_capacity=True)"
            )
        step = self.config.capacity if self.fixed_capacity else self._group_step(tokens)
        pad = step - tokens
        x = F.pad(x, (0, 0, 0, pad))
        ids = F.pad(ids, (0, 0, 0, pad), value=-1)
        weights = F.pad(weights.float(), (0, 0, 0, pad))
        return self._step(x, ids, weights, step, tokens, combine_dtype)[:tokens]

    def _group_step(self, tokens: int) -> int:
        """The largest token count of this call over the group: one all-gather, read on the host."""
        everyone = self.group.all_gather(torch.tensor([tokens], dtype=torch.int64, device=self.group.device))
        return int(everyone.max())

    def _step(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, step: int, tokens: list[int] | int,
        combine_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """Plan (with the real token counts) and run one :func:`flatep.ep_moe` step of ``step`` tokens per rank."""
        config = self._config_for(step)
        plan = plan_step(ids, config, self.group, self.policy, tokens=tokens, dtype=x.dtype, cost=self.cost,
                         dispatch_dtype=self.dispatch_dtype)
        out = ep_moe(
            x, ids, weights, config=config, group=self.group, policy=self.policy, pool=self.pool, plan=plan,
            backend=self.backend, activation=self.activation, precision=self.precision,
            combine_dtype=combine_dtype, dispatch_dtype=self.dispatch_dtype,
        )
        if self.record_routing:
            self.tokens_per_expert.append(plan.tokens_per_expert.sum(0))
            self.received.append(plan.received.clone())
        return out

    def maxvio(self, calls: slice = slice(None), total: bool = False) -> list[float]:
        """Router imbalance ``max_e(T_e / mean T) - 1`` of the recorded calls ``calls`` (0 = balanced).

        With ``total``, one value: that of their histograms summed (a few decode tokens alone say
        little about a router's skew; all decode steps together do).
        """
        recorded = self.tokens_per_expert[calls]
        if not recorded:
            return []
        histogram = torch.stack(recorded).double()
        if total:
            histogram = histogram.sum(0, keepdim=True)
        return (histogram.max(1).values / histogram.mean(1) - 1).tolist()

    def rank_imbalance(self, classic: bool = False) -> list[float]:
        """``max_d(rows_d / mean rows) - 1`` of every recorded call: the rows each rank computed (flat
        under ``exact``), or with ``classic`` the rows classic EP would have given each rank (its home
        experts' tokens)."""
        if classic:
            histogram = torch.stack(self.tokens_per_expert).double() if self.tokens_per_expert else torch.empty(0, 1)
            rows = histogram.view(histogram.shape[0], self.config.ranks, -1).sum(-1)
        else:
            rows = torch.stack(self.received).double() if self.received else torch.empty(0, 1)
        return (rows.max(1).values / rows.mean(1) - 1).tolist() if rows.numel() else []

    def reset_routing(self) -> None:
        """Forget the recorded calls."""
        self.tokens_per_expert.clear()
        self.received.clear()


@dataclass(frozen=True)
class ShardSummary:
    """What :func:`shard_moe` did.

    Attributes:
        family: the model family.
        layers: names of the replaced experts modules.
        experts, ranks, experts_per_rank: ``E``, ``R``, ``epn``.
        bytes_before: routed-expert weight bytes each rank held before (all ``E`` experts of every layer).
        bytes_after: per rank after: ``epn`` home experts of every layer plus the ``epn`` borrow
            slots that all layers share.
    """

    family: str
    layers: tuple[str, ...]
    experts: int
    ranks: int
    experts_per_rank: int
    bytes_before: int
    bytes_after: int

    def __str__(self) -> str:
        mib = 2.0**20
        return (
            f"{self.family}: {len(self.layers)} MoE layers sharded over {self.ranks} ranks; routed-expert weights "
            f"per rank {self.bytes_before / mib:.2f} MiB -> {self.bytes_after / mib:.2f} MiB "
            f"({self.experts} experts per layer -> {self.experts_per_rank} home per layer + {self.experts_per_rank} "
            f"slots shared by all layers)"
        )


def shard_moe(
    model: nn.Module,
    group: Group,
    policy: str = "exact",
    *,
    capacity: int = 64,
    align: int | None = None,
    tolerance: float = 0.0,
    backend: str = "auto",
    record_routing: bool = False,
    precision: str = "native",
    cost: CostProfile | None = None,
    fixed_capacity: bool = False,
    dispatch_dtype: torch.dtype | None = None,
    weights: str | None = None,
    fp8_activations: bool | None = None,
) -> ShardSummary:
    """Make the routed experts of every sparse MoE block of ``model`` expert-parallel over ``group``, in place.

    Args:
        model: a loaded transformers model of a supported family (see :data:`FAMILIES`), bfloat16 or
            float32, on ``group.device``; ``R`` must divide its expert count. Experts that
            transformers loaded in fp8 (``FP8Experts``: ``FineGrainedFP8Config`` checkpoints such
            as DeepSeek-V3's and Kimi-K2's, on a GPU) are kept in fp8, values and scales as loaded.
        group: from :func:`flatep.init_group`.
        policy: ``exact`` (flat per-rank load), ``bounded``, ``none`` (classic EP) or ``auto``.
        capacity: initial tokens per rank per MoE call; grows by itself when a call passes more
            (unless ``fixed_capacity``).
        align: rows each expert group is padded to (default 128 on CUDA for the grouped GEMM's tiles,
            8 elsewhere, where padding only costs time).
        tolerance: rank imbalance ``exact`` lets pass without moving expert weights
            (:attr:`flatep.EPConfig.tolerance`).
        backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.ep_moe`).
        record_routing: make every :class:`FlatEPExperts` keep per-call routing statistics.
        precision: ``native`` (default: the model's own rounding order, so that bf16 outputs match the
            unsharded model's as closely as the combine allows) or ``fp32`` (activations in fp32);
            see :mod:`flatep.experts.grouped`.
        cost: the :class:`flatep.CostProfile` of ``policy="auto"`` (default: the generic one).
        fixed_capacity: per-process transports only: every rank pads each MoE call to ``capacity``
            tokens without asking the others for their count, so no call reads anything back to
            the host for its size (what capturing a decode step in a CUDA graph needs); a call of
            more than ``capacity`` tokens raises ``ValueError``. Default: the ranks agree per
            call on the largest count (one all-gather read on the host).
        dispatch_dtype: ``torch.float8_e4m3fn`` to dispatch fp8 rows (inference; see
            :func:`flatep.ep_moe`); default: the model's dtype.
        weights: the format of the expert pools (:data:`flatep.quant.WEIGHT_FORMATS`). Default:
            as the model holds its experts (``fp8`` for fp8 experts modules, else the model's
            float dtype). ``mxfp4`` or ``fp8`` quantize float experts into that format, e.g.
            ``mxfp4`` for gpt-oss, whose MXFP4 checkpoint transformers dequantizes where its
            MXFP4 kernels do not run (on the CPU, and on GPUs without the ``kernels`` package):
            those bf16 values re-quantize to the checkpoint's own (OCP MX rounding is exact on
            values that came from it).
        fp8_activations: mxfp4 pools only: multiply fp8 activations by the weights decoded into e4m3
            on Hopper GPUs (see :class:`flatep.ExpertPool`; default: the environment's
            ``FLATEP_MXFP4_FP8_ACTIVATIONS``).

    Returns:
        A :class:`ShardSummary` (replaced layers, memory per rank before and after).

    Raises:
        ValueError: unsupported family, unexpected experts modules (other quantized layouts),
            ``weights`` that do not fit the experts, bad sizes.
        ImportError: transformers older than 5.0.
    """
    check_policy(policy)
    check_cost(policy, cost)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if fixed_capacity and group.stacked:
        raise ValueError("fixed_capacity is for the per-process transports (nvlink, collective); the local "
                         "transport's virtual ranks split each call's tokens without any exchange")
    if weights is not None:
        check_format(weights)
    require_transformers_5()
    family = family_of(model)
    experts_types = family.experts_types()
    targets = [name for name, module in model.named_modules() if isinstance(module, experts_types)]
    strangers = [
        f"{name} ({type(module).__name__})"
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts" and not isinstance(module, (*experts_types, FlatEPExperts))
    ]
    if strangers:
        taken = " or ".join(kind.__name__ for kind in experts_types)
        raise ValueError(
            f"{family.name}: these experts modules are not {taken} (other quantized layouts, such as "
            f"transformers' MXFP4 kernels' swizzled tensors, are not supported: load the checkpoint dequantized and "
            f"pass weights='mxfp4' to keep the experts in MXFP4): {', '.join(strangers)}"
        )
    if not targets:
        raise ValueError(f"{family.name}: found no {family.experts_class} module to shard in {type(model).__name__}")
    if align is None:
        align = 128 if group.device.type == "cuda" else 8
    bytes_before = bytes_after = 0
    slot_bytes: dict[int, int] = {}  # by address: layers of one shape share their slots
    for name in targets:
        # One layer at a time: its original weights are released as soon as the module is replaced,
        # so the peak is the unsharded model plus one layer's pool.
        experts = model.get_submodule(name)
        config, pool, activation = _build_pool(family, experts, model, group, capacity, align, tolerance, weights,
                                               fp8_activations)
        bytes_before += sum(p.numel() * p.element_size() for p in experts.parameters())
        bytes_after += sum(pool.home(n).numel() * pool.home(n).element_size() for n in pool.names)
        slot_bytes.update({pool.slots(n).data_ptr(): pool.slots(n).numel() * pool.slots(n).element_size() for n in pool.names})
        parent_name, _, child = name.rpartition(".")
        check_dispatch_dtype(dispatch_dtype, pool.dtype, config.hidden)  # the first layer raises, before any change
        replacement = FlatEPExperts(pool, config, group, policy, activation, backend, record_routing, precision, cost,
                                    fixed_capacity, dispatch_dtype)
        setattr(model.get_submodule(parent_name), child, replacement)
        del experts
    return ShardSummary(
        family.name, tuple(targets), config.experts, config.ranks, config.experts_per_rank,
        bytes_before, (bytes_after + sum(slot_bytes.values())) // len(group.local_ranks),
    )


@torch.no_grad()
def _build_pool(
    family: Family, experts: nn.Module, model: nn.Module, group: Group, capacity: int, align: int, tolerance: float,
    weights: str | None = None, fp8_activations: bool | None = None,
) -> tuple[EPConfig, ExpertPool, Activation]:
    """This process's ranks' pool of one experts module, converting only the experts they own."""
    fp8 = family.fp8_experts and isinstance(experts, fp8_experts_type() or ())
    convert = _fp8_swiglu_weights if fp8 else family.convert
    first = convert(experts, 0, 1)  # shapes and dtype, at the cost of one expert
    # fp8 experts hold no activation dtype of their own: the embeddings' (bf16 as loaded).
    dtype = model.get_input_embeddings().weight.dtype if fp8 else first.w13.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{family.name}: expert weights (and activations) must be bfloat16 or float32, got {dtype}")
    if first.w13.device != group.device:
        raise ValueError(f"{family.name}: the model is on {first.w13.device}, the group on {group.device}")
    held = "fp8" if fp8 else "bf16"
    if fp8 and weights not in (None, "fp8"):
        raise ValueError(f"{family.name}: these experts are fp8 ({type(experts).__name__}); weights={weights!r} would need "
                         "them dequantized first: load the checkpoint with FineGrainedFP8Config(dequantize=True)")
    config = EPConfig(
        ranks=group.world, experts=experts.gate_up_proj.shape[0], top_k=int(model.config.num_experts_per_tok),
        hidden=first.w13.shape[-1], intermediate=first.w2.shape[-1], capacity=capacity, align=align,
        tolerance=tolerance,
    )
    try:
        pool = ExpertPool(config, group, dtype, biases=first.b13 is not None, weights=weights or held,
                          fp8_activations=fp8_activations)
    except ValueError as error:
        raise ValueError(f"{family.name}: weights={weights or held!r} does not fit these experts: {error}") from None
    epn = config.experts_per_rank
    lo = group.first_rank * epn
    mine = convert(experts, lo, lo + len(group.local_ranks) * epn)
    pool.load_home(mine.w13, mine.w2, mine.b13, mine.b2)  # float experts are quantized into a packed pool here
    return config, pool, family.activation(experts, model.config)


def sharded_experts(model: nn.Module) -> list[tuple[str, FlatEPExperts]]:
    """Every :class:`FlatEPExperts` of a model sharded by :func:`shard_moe`, in module order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, FlatEPExperts)]


__all__ = [
    "FAMILIES", "ExpertWeights", "Family", "FlatEPExperts", "ShardSummary", "family_of", "require_transformers_5",
    "shard_moe", "sharded_experts",
]
