"""Grouped gated-MLP experts over a receive shard: ``torch._grouped_mm`` with ``offs = offsets``.

The experts are gated MLPs ``y = W_2 act(W_gate x + b_gate, W_up x + b_up) + b_2``. ``act`` is
:func:`swiglu` (``silu(gate) * up``: Qwen, DeepSeek, Kimi, Mixtral) unless the caller passes another
activation such as :class:`ClampedSwiGLU` (gpt-oss). Biases are optional and absent for most models.

Two roundings of the same function (``precision``):

- ``fp32`` (default): bias additions and the activation in fp32, the route weight folded into the
  activated rows before the down GEMM, one rounding to the shard's dtype in between.
- ``native``: the order and precision of the models' own expert loops (transformers): bias and
  activation in the shard's dtype, the down GEMM on unweighted rows, then its bias, then the route
  weight (product rounded once to the shard's dtype). In bf16 this reproduces transformers' experts
  bit for bit where the GEMMs agree row by row and the route weights are bf16 (Qwen3-MoE, gpt-oss);
  with fp32 route weights (DeepSeek-V3) transformers sums the K products before rounding them,
  which a combine of unweighted rows cannot do.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from flatep.kernels import mxfp4_dequant, mxfp4_fp8mma
from flatep.kernels.activation import copy_rows_triton, swiglu_weighted_torch, swiglu_weighted_triton
from flatep.kernels.backend import use_triton
from flatep.kernels.decode_gemm import DECODE_ROWS_PER_GROUP, decode_launches, decode_swiglu
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.fp8_rows import Fp8Rows
from flatep.kernels.fp8_split import split_rows_triton
from flatep.kernels.grouped_fp32 import grouped_rows_mm
from flatep.kernels.packed_tiles import packed_launches
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.kernels.streams import side_by_side
from flatep.quant.fp8 import FP8_BLOCK, dequantize_fp8_activations, quantize_fp8_activations
from flatep.quant.tensor import QuantizedTensor, pool_layout

Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``act(gate [rows, I], up [rows, I]) -> [rows, I]`` in their dtype (fp32, or the shard's under ``native``)."""

PRECISIONS = ("fp32", "native")


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``: the default gated activation."""
    return F.silu(gate) * up


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's gated activation: ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, limit)``.

    Attributes:
        alpha: sigmoid sharpness (gpt-oss: 1.702).
        limit: clamp bound of gate (above) and up (both sides) (gpt-oss: 7.0).
    """

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def _grouped_matmul(
    rows: torch.Tensor, weights: torch.Tensor | QuantizedTensor, offsets: torch.Tensor, backend: str = "auto",
    rows_per_group: int | None = None, activations: Fp8Rows | None = None,
) -> torch.Tensor:
    """``out[i] = rows[i] @ weights[g(i)].T`` for the group ``g(i)`` holding row ``i``.

    Args:
        rows: ``[M, in]``.
        weights: ``[G, out, in]`` (vLLM layout; passed transposed, no copy), or packed weights of
            that logical shape (:func:`quantized_grouped_mm`).
        offsets: ``[G]`` int32 inclusive end row of each group; rows past ``offsets[-1]`` are
            left unwritten.
        backend: for packed weights, ``auto``, ``triton`` or ``torch``.
        rows_per_group, activations: for packed weights, see :func:`quantized_grouped_mm`.
    """
    if isinstance(weights, QuantizedTensor):
        return quantized_grouped_mm(rows, weights, offsets, backend, rows_per_group, activations)
    if rows.is_cuda and rows.dtype != torch.bfloat16:
        # The CUDA grouped GEMM is bf16-only (other dtypes take a fallback that reads the offsets on
        # the host): FlatEP's fp32 grouped GEMM instead, IEEE products, offsets read on the device.
        return grouped_rows_mm(rows.float(), weights.transpose(-2, -1), offsets).to(rows.dtype)
    return torch._grouped_mm(rows, weights.transpose(-2, -1), offs=offsets)


def quantized_grouped_mm(
    rows: torch.Tensor, weights: QuantizedTensor, offsets: torch.Tensor, backend: str = "auto",
    rows_per_group: int | None = None, activations: Fp8Rows | None = None, *,
    slots: QuantizedTensor | None = None, slot_base: int = 0, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = rows[i] @ W[g(i)].T`` with packed ``W``: ``[M, out]`` in ``rows``' dtype.

    - ``fp8``: the rows are quantized per token per 128-column group (as DeepSeek-V3 runs its
      FP8 experts; :func:`flatep.quant.quantize_fp8_activations`), then block-scaled GEMM.
    - ``mxfp4``: the rows as they are (bf16) times the dequantized weights (exact in bf16); with
      :data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`, on a Hopper GPU, the rows split into two e4m3
      parts times the weights decoded into e4m3 (:mod:`flatep.kernels.mxfp4_fp8mma`; the split once a
      GEMM, shared by its launches).

    Triton (bf16 rows, ``backend`` allowing it) reads the packed weights and dequantizes in
    registers, over rows before ``offsets[-1]`` only (mxfp4 weights in the checkpoint layout are
    converted to the pools' word layout first, on every call: pass a pool's views, or
    ``weights.in_layout("words")`` made once); the torch path dequantizes to fp32 and is the
    exact reference of the same function (rows past ``offsets[-1]`` undefined on both).

    Args:
        rows: ``[M, K]`` bf16 (or fp32: torch path only).
        weights: ``[G, N, K]`` fp8 or mxfp4.
        offsets: ``[G]`` int32 inclusive end row of each group.
        rows_per_group: the real rows a group holds on average (a host int; default ``M / G``): the
            Triton kernels' tiles follow it, and where that is a few rows the groups of many rows
            run in a launch of their own with tall tiles (:func:`flatep.kernels.packed_tiles.packed_launches`;
            on CUDA the launches run side by side on streams of their own, :mod:`flatep.kernels.streams`);
            mxfp4 from :data:`flatep.kernels.mxfp4_dequant.THROUGH_BF16_ROWS` rows on decodes the
            weights whole into bf16 for ``torch._grouped_mm`` instead
            (:func:`flatep.kernels.mxfp4_dequant.mxfp4_grouped_mm_bf16`).
        activations: ``fp8`` only: the rows already quantized (:class:`flatep.kernels.fp8_rows.Fp8Rows`
            ``[M, K]``, as fp8 dispatch delivers them), used instead of quantizing ``rows``, which
            are then not read.
        slots: Triton only: a second set of experts ``[G2, N, K]`` in the same format (a layer's
            borrow slots) for groups ``G .. G+G2-1`` (``offsets`` then holds ``G+G2`` ends), whose
            rows start at row ``slot_base``; both sets run in the same launches.
        slot_base: first row of the ``slots`` groups.
        out: Triton only: an ``[M, N]`` bf16 tensor (unit column stride) to write into.
    """
    if rows.dim() != 2 or weights.shape[-1] != rows.shape[1] or len(weights.shape) != 3:
        raise ValueError(f"rows [M, K] and weights [G, N, K] must agree on K, got {list(rows.shape)} and {list(weights.shape)}")
    if slots is not None and (not isinstance(slots, QuantizedTensor) or slots.format != weights.format):
        raise ValueError(f"slots must be {weights.format} weights like the experts', got {slots!r}")
    groups = weights.shape[0] + (0 if slots is None else slots.shape[0])
    if offsets.dtype != torch.int32 or offsets.shape != (groups,):
        raise ValueError(f"offsets must be [{groups}] int32, got {list(offsets.shape)} {offsets.dtype}")
    if activations is not None and weights.format != "fp8":
        raise ValueError(f"pre-quantized fp8 activations need fp8 weights, got {weights.format}")
    if use_triton(rows.device, backend) and rows.dtype == torch.bfloat16:
        # A pool's layout as it is (words, or mma for fp8 activations); checkpoint order converted per call.
        layout = weights.layout if weights.layout != "checkpoint" else pool_layout(weights.format)
        weights = weights.in_layout(layout)
        second = skip = None
        if slots is not None:
            slots = slots.in_layout(layout)
            second = (slots.values, slots.scales)
            skip = _between_sets(offsets, weights.shape[0], slot_base)
        groups = offsets.shape[0]
        if out is None:  # made before the launches, which each write their own groups' rows of it
            out = rows.new_empty(rows.shape[0], weights.shape[1])
        # The mma layout's arguments only where it is used: experts_phase --against swaps in other
        # revisions' GEMMs, which may predate them.
        mma = {"layout": layout} if layout == "mma" else {}
        launches = [(None, None)] if rows_per_group is None else packed_launches(rows_per_group * groups, groups,
                                                                                 weights.format, rows.device, **mma)
        if weights.format == "fp8":
            given = (quantize_fp8_activations_triton(rows, offsets[-1:], skip) if activations is None
                     else (activations.values, activations.scales))
            side_by_side([functools.partial(fp8_grouped_mm_triton, rows, weights.values, weights.scales, offsets,
                                            config=config, out=out, activations=given, group_rows=group_rows,
                                            slots=second, slot_base=slot_base)
                          for config, group_rows in launches], rows.device)
            return out
        if rows_per_group is not None and rows_per_group >= mxfp4_dequant.THROUGH_BF16_ROWS:
            return mxfp4_dequant.mxfp4_grouped_mm_bf16(rows, weights.values, weights.scales, offsets, out,
                                                       slots=second, slot_base=slot_base, **mma)
        if layout == "mma" and any(config is not None and config.wgmma for config, _ in launches):
            mma["fp8_rows"] = split_rows_triton(rows, mxfp4_fp8mma.CENTER, offsets[-1:], skip)  # once for the launches
        side_by_side([functools.partial(mxfp4_grouped_mm_triton, rows, weights.values, weights.scales, offsets,
                                        config=config, out=out, group_rows=group_rows, slots=second,
                                        slot_base=slot_base, **mma)
                      for config, group_rows in launches], rows.device)
        return out
    if slots is not None or out is not None:
        raise ValueError("slots and out need the Triton kernels (bf16 rows, a backend allowing Triton)")
    if activations is not None:
        products = dequantize_fp8_activations(activations.values, activations.scales)
    elif weights.format == "fp8":
        products = dequantize_fp8_activations(*quantize_fp8_activations(rows))
    else:
        products = rows.float()
    return _grouped_matmul(products, weights.dequantize(torch.float32), offsets).to(rows.dtype)


def _between_sets(offsets: torch.Tensor, groups: int, slot_base: int) -> tuple[torch.Tensor, int] | None:
    """The rows between a first set of ``groups`` groups and a second set starting at row
    ``slot_base``, as the row kernels' ``skip``: no row of either set, often several times the
    real rows (a layer's slot rows start at a row sized for the step's worst case)."""
    return (offsets[groups - 1:groups], slot_base) if groups else None


def row_groups(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """``[rows] int64`` group of every shard row; rows past ``offsets[-1]`` get the last group.

    Sync-free (a ``searchsorted``), so biases can be gathered per row inside a CUDA graph.
    """
    positions = torch.arange(rows, device=offsets.device, dtype=offsets.dtype)
    groups = torch.searchsorted(offsets, positions, right=True)
    return groups.clamp_max(offsets.shape[0] - 1)


def takes_decode_kernels(
    shard: torch.Tensor, route_weights: torch.Tensor, w13, w2, rows_per_group: int, *, precision: str = "fp32",
    biased: bool = False, activation: Activation = swiglu, backend: str = "auto",
) -> bool:
    """Whether :func:`grouped_swiglu` runs these experts with :mod:`flatep.kernels.decode_gemm`:
    Triton allowed, ``fp32`` precision, :func:`swiglu`, no biases, bf16 rows and weights on CUDA,
    at most :data:`DECODE_ROWS_PER_GROUP` rows per group on average (host values alone decide, so
    a captured graph keeps its kernels)."""
    if precision != "fp32" or biased or activation is not swiglu or not use_triton(shard.device, backend):
        return False
    tensors = (shard, w13, w2)
    return (
        shard.is_cuda
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 for t in tensors)
        and shard.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1
        and route_weights.dtype == torch.float32 and route_weights.is_contiguous()
        and rows_per_group <= DECODE_ROWS_PER_GROUP
    )


def takes_packed_kernels(
    shard: torch.Tensor, route_weights: torch.Tensor, w13, w2, *, precision: str = "fp32", biased: bool = False,
    activation: Activation = swiglu, backend: str = "auto",
) -> bool:
    """Whether :func:`grouped_swiglu` runs these packed experts with the Triton kernels of
    :mod:`flatep.kernels.quant_gemm` (which a second set of experts in the same format may share):
    Triton allowed, ``fp32`` precision, :func:`swiglu`, no biases, bf16 rows, fp32 route weights,
    ``w13`` and ``w2`` packed in one format (host values alone decide)."""
    if precision != "fp32" or biased or activation is not swiglu or not use_triton(shard.device, backend):
        return False
    return (
        shard.dtype == torch.bfloat16 and shard.stride(1) == 1
        and isinstance(w13, QuantizedTensor) and isinstance(w2, QuantizedTensor) and w13.format == w2.format
        and route_weights.dtype == torch.float32 and route_weights.is_contiguous()
    )


def grouped_swiglu(
    shard: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    activation: Activation = swiglu,
    precision: str = "fp32",
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    rows_per_group: int | None = None,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_base: int = 0,
    activations: Fp8Rows | None = None,
) -> torch.Tensor:
    """The experts of one rank over its receive shard.

    ``y = route_weight * (W_2 act(W_gate x + b_gate, W_up x + b_up) + b_2)`` per row, with the
    weights of the row's group; GEMMs in the shard's dtype. Under ``precision="fp32"`` the route
    weight is applied before the down projection (and to ``b_2`` separately), activations and bias
    additions in fp32; under ``"native"`` everything runs in the shard's dtype in the order of the
    formula (see the module docstring).

    Args:
        shard: ``[rows, H]`` received rows (padding rows hold anything, NaN included: every row
            is computed on its own, so they reach only their own output rows, which combine never reads).
        route_weights: ``[rows]`` fp32 route weight of each row (padding rows likewise; rows past
            the last group may hold stale values and are ignored).
        w13: ``[G, 2I, H]`` gate rows then up rows of each group's expert (the layer passes ``G =
            epn``: a rank's home experts, or its slots); a float tensor, or packed fp8 / mxfp4
            weights (:class:`flatep.quant.QuantizedTensor`, see :func:`quantized_grouped_mm`).
        w2: ``[G, H, I]``, like ``w13``.
        offsets: ``[G]`` int32 inclusive padded end row of each group.
        b13: optional ``[G, 2I]`` gate then up bias of each group's expert.
        b2: optional ``[G, H]`` down-projection bias.
        activation: ``act(gate, up)`` on the ``[rows, I]`` halves (default :func:`swiglu`).
        precision: ``fp32`` or ``native``.
        out_dtype: dtype of the weighted rows (default the shard's). ``float32`` keeps the product
            of a row and its fp32 route weight unrounded, so that combine rounds once per token.
        backend: ``auto``, ``triton`` or ``torch`` (:func:`flatep.kernels.backend.use_triton`). With
            Triton, ``precision="fp32"``, no biases and :func:`swiglu`, the steps between the GEMMs
            run over the rows before ``offsets[-1]`` only (read on the device: no sync); there,
            bf16 shards on CUDA with at most :data:`flatep.kernels.decode_gemm.DECODE_ROWS_PER_GROUP`
            rows per group on average run the decode kernels instead (gate/up fused with the
            activation, each active expert's weights read once).
        out: optional ``[rows, H]`` tensor to write the result into (its dtype is then the
            ``out_dtype``); with Triton only its rows before ``offsets[-1]`` are written.
        rows_per_group: the real rows a group holds on average, a host int (default ``rows /
            G``). It decides whether the decode kernels run and picks their tiles and the packed
            GEMMs' tiles; pass it when the shard is a buffer sized for more rows than the step
            holds (the layer passes the step's ``T*K/E``), so that the kernels do not depend on
            the buffer's size.
        slots: optional ``(w13 [G2, 2I, H], w2 [G2, H, I])``, a second set of experts (the
            process's borrow slots) for groups ``G .. G+G2-1`` (``offsets`` then holds ``G+G2``
            ends), whose rows start at row ``slot_base``: both sets run in the same launches. Only
            where the decode kernels run (:func:`takes_decode_kernels`), or the packed kernels
            (:func:`takes_packed_kernels`, the slots packed in the experts' format); otherwise
            ``ValueError``.
        slot_base: first row of the ``slots`` groups.
        activations: with fp8 ``w13`` only: the shard's rows as fp8 dispatch delivered them
            (:class:`flatep.kernels.fp8_rows.Fp8Rows`, ``[rows, H]``); the gate/up GEMM reads them
            instead of quantizing ``shard``, whose rows are then not read (only its shape, dtype
            and device are used).

    Returns:
        ``out``, or a new ``[rows, H]`` tensor in ``out_dtype``; rows past ``offsets[-1]`` are
        undefined.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if activations is not None and not (isinstance(w13, QuantizedTensor) and w13.format == "fp8"):
        raise ValueError("activations (fp8 rows as dispatched) need fp8 w13 weights")
    out_dtype = out.dtype if out is not None else out_dtype or shard.dtype
    intermediate = w2.shape[-1]
    biased = b13 is not None or b2 is not None
    bounded = use_triton(shard.device, backend)
    fused = precision == "fp32" and not biased and activation is swiglu and bounded
    groups = max(w13.shape[0] + (0 if slots is None else slots[0].shape[0]), 1)
    per_group = -(-shard.shape[0] // groups) if rows_per_group is None else rows_per_group
    decode = takes_decode_kernels(shard, route_weights, w13, w2, per_group, precision=precision, biased=biased,
                                  activation=activation, backend=backend)
    packed = not decode and takes_packed_kernels(shard, route_weights, w13, w2, precision=precision, biased=biased,
                                                 activation=activation, backend=backend)
    if slots is not None and not (
            (decode and takes_decode_kernels(shard, route_weights, *slots, per_group, backend=backend))
            or (packed and takes_packed_kernels(shard, route_weights, *slots, backend=backend)
                and slots[0].format == w13.format)):
        raise ValueError("slots run in the launches of the decode kernels or of the packed kernels only (see "
                         "takes_decode_kernels, takes_packed_kernels): run the second set of experts in its own "
                         "grouped_swiglu call")
    skip = None if slots is None else _between_sets(offsets, w13.shape[0], slot_base)
    if decode:
        # Tiles follow the rows a group holds in this step, never the size of the buffer the shard
        # lives in (sized for the step's worst case, or for another policy's: on the H200 at
        # Kimi-K2, s = 128, classic's experts took 995 us with 32-row tiles and auto's, the same
        # groups in a larger buffer, 1087 us with the 64-row tiles its buffer implied).
        activated = torch.empty(shard.shape[0], intermediate, dtype=shard.dtype, device=shard.device)
        direct = out is not None and out.dtype == torch.bfloat16 and out.stride(1) == 1
        result = out if direct else torch.empty(shard.shape[0], w2.shape[1], dtype=shard.dtype, device=shard.device)
        decode_swiglu(shard, w13, w2, route_weights, offsets, decode_launches(per_group * groups, groups), activated,
                      result, slots=slots, slot_base=slot_base)
        if direct:
            return out
        out = out if out is not None else torch.empty(result.shape, dtype=out_dtype, device=result.device)
        copy_rows_triton(out, result, offsets[-1:], skip=skip)
        return out
    if packed:
        result = _packed_experts(shard, route_weights, w13, w2, offsets, per_group, activations, slots, slot_base, skip,
                                 out)
    elif fused:
        # Same function, but the elementwise steps skip rows past offsets[-1] (several times the
        # real rows at small batch); those rows of the result stay undefined, as the GEMMs leave them.
        hidden_states = _grouped_matmul(shard, w13, offsets, backend, rows_per_group, activations)
        activated = torch.empty(shard.shape[0], intermediate, dtype=shard.dtype, device=shard.device)
        swiglu_weighted_triton(hidden_states, route_weights, offsets[-1:], activated)
        result = _grouped_matmul(activated, w2, offsets, backend, rows_per_group)  # converted (real rows only) on delivery
    else:
        hidden_states = _grouped_matmul(shard, w13, offsets, backend, rows_per_group, activations)
        result = _torch_experts(hidden_states, route_weights, w2, offsets, b13, b2, activation, precision, out_dtype, backend,
                                rows_per_group)
    if result is out or (out is None and result.dtype == out_dtype):
        return result
    if out is None:
        out = torch.empty(result.shape, dtype=out_dtype, device=result.device)
    if bounded:
        copy_rows_triton(out, result, offsets[-1:], skip=skip)
    else:
        out.copy_(result)
    return out


def _packed_experts(
    shard: torch.Tensor, route_weights: torch.Tensor, w13: QuantizedTensor, w2: QuantizedTensor, offsets: torch.Tensor,
    rows_per_group: int, activations: Fp8Rows | None, slots: tuple[QuantizedTensor, QuantizedTensor] | None,
    slot_base: int, skip: tuple[torch.Tensor, int] | None, out: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`grouped_swiglu` on packed experts with the Triton kernels (:func:`takes_packed_kernels`):
    the gate/up GEMM, the SwiGLU pass over the real rows, the down GEMM, a second set of experts
    (``slots``) in the same launches, the SwiGLU pass leaving out the rows ``skip`` names (those
    between the two sets). Returns ``out`` itself where it is bf16 with unit column
    stride (the down GEMM writes into it), else a new ``[rows, H]`` bf16 tensor."""
    intermediate = w2.shape[-1]
    slot_w13, slot_w2 = (None, None) if slots is None else slots
    hidden_states = quantized_grouped_mm(shard, w13, offsets, rows_per_group=rows_per_group, activations=activations,
                                         slots=slot_w13, slot_base=slot_base, backend="triton")
    direct = out if out is not None and out.dtype == torch.bfloat16 and out.stride(1) == 1 else None
    down = dict(rows_per_group=rows_per_group, slots=slot_w2, slot_base=slot_base, out=direct, backend="triton")
    if w2.format != "fp8":
        activated = torch.empty(shard.shape[0], intermediate, dtype=shard.dtype, device=shard.device)
        swiglu_weighted_triton(hidden_states, route_weights, offsets[-1:], activated, skip=skip)
        return quantized_grouped_mm(activated, w2, offsets, **down)
    # The fp8 down projection quantizes its input per token per 128 columns: done in the SwiGLU
    # pass itself (bit-equal to quantizing its bf16 output), one launch and one read fewer.
    values = torch.empty(shard.shape[0], intermediate, dtype=torch.float8_e4m3fn, device=shard.device)
    scales = torch.empty(shard.shape[0], intermediate // FP8_BLOCK, dtype=torch.float32, device=shard.device)
    swiglu_weighted_triton(hidden_states, route_weights, offsets[-1:], values, scales=scales, skip=skip)
    # The GEMM takes the rows' shape from a bf16 tensor it does not read: one broadcast row.
    unread = hidden_states.new_empty(1, intermediate).expand(shard.shape[0], intermediate)
    return quantized_grouped_mm(unread, w2, offsets, activations=Fp8Rows(values, scales), **down)


def _torch_experts(
    hidden_states: torch.Tensor,
    route_weights: torch.Tensor,
    w2: torch.Tensor,
    offsets: torch.Tensor,
    b13: torch.Tensor | None,
    b2: torch.Tensor | None,
    activation: Activation,
    precision: str,
    out_dtype: torch.dtype,
    backend: str = "auto",
    rows_per_group: int | None = None,
) -> torch.Tensor:
    """:func:`grouped_swiglu` after the gate/up GEMM, in plain torch over every row: ``[rows, H]`` in ``out_dtype``."""
    intermediate = w2.shape[-1]
    dtype = hidden_states.dtype
    groups = row_groups(offsets, hidden_states.shape[0]) if b13 is not None or b2 is not None else None
    weights = route_weights.float().unsqueeze(-1)  # NaN and +-inf propagate, as in a dense MoE
    if precision == "native":
        if b13 is not None:
            hidden_states = hidden_states + b13[groups]
        out = _grouped_matmul(activation(hidden_states[:, :intermediate], hidden_states[:, intermediate:]), w2, offsets,
                              backend, rows_per_group)
        if b2 is not None:
            out = out + b2[groups]
        # A bf16 route weight times a bf16 row is exact in fp32: one rounding, as a bf16 product has.
        return (out.float() * weights).to(out_dtype)
    hidden_states = hidden_states.float()
    if b13 is not None:
        hidden_states = hidden_states + b13[groups].float()
    activated = swiglu_weighted_torch(hidden_states, route_weights, dtype, activation)
    out = _grouped_matmul(activated, w2, offsets, backend, rows_per_group)
    if b2 is None:
        return out.to(out_dtype)
    return (out.float() + weights * b2[groups].float()).to(out_dtype)
