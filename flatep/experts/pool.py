"""Expert weight pools: each layer's home experts, and one or two sets of borrow slots per process.

Per projection a layer's pool is a symmetric buffer whose per-rank part ``[epn, ...]`` holds the
rank's own experts. The experts a rank borrows for a step go into *slots*: a symmetric buffer
``[epn, ...]`` per projection that every layer of the same shape and dtype shares (it lives in the
group's buffer cache), because a rank computes one layer at a time. Memory per rank is therefore
``epn`` experts per layer plus one layer's worth of slots, not ``2*epn`` per layer.

With ``slot_sets=2`` there are two such sets and layer ``L`` (the pool's ``layer`` index) uses set
``L % 2``: one more layer's worth of slots (``epn`` experts per rank) buys room to push layer
``L+1``'s borrowed experts while layer ``L`` still computes with its own
(:func:`flatep.layer.prefetch_experts`). Every pool of one shape should use the same ``slot_sets``.

Home experts and slots are separate tensors, so a rank's experts run as two grouped GEMMs
(``torch._grouped_mm`` with ``offs``), one per tensor, over the two parts of the split shard
layout (:mod:`flatep.plan.split`).

Weight formats (:mod:`flatep.quant`): a ``bf16`` pool holds plain weights in its dtype; an ``fp8``
or ``mxfp4`` pool holds each projection packed (``w13``, ``w2``) with its scales beside it
(``w13_scale``, ``w2_scale``), each a symmetric buffer with its own slots, so a push moves the
packed bytes and the scales together. Biases stay in the pool's dtype.
"""
from __future__ import annotations

import math
import warnings

import torch

from flatep.config import EPConfig
from flatep.kernels import mxfp4_fp8mma
from flatep.quant.tensor import QuantizedTensor, check_pool_dims, packed_layout, pool_layout
from flatep.transport.base import Group

Weights = torch.Tensor | QuantizedTensor

WINDOW_WARNING_SHARE = 0.05
"""Loading mxfp4 weights into ``mma``-layout pools (fp8 activations) warns where more than this share of
a projection's tiles hold scale bytes outside the fp8 kernel's window
(:func:`flatep.kernels.mxfp4_fp8mma.tiles_outside_window`): those tiles are computed twice, the second
time by the exact bf16 tile. In issue #15's Kimi-K3 cell on an H100 the fp8 path saved 2.4% and 7.1% of
the experts' time at maxvio 0 and 10 (bench/results/2026-12-07-h100-m), so a few percent of tiles
computed again would use that up."""


class ExpertPool:
    """Weights of one MoE layer laid out for expert parallelism.

    Attributes:
        w13: home experts of the fused gate/up projection, ``[n, epn, 2I, H]`` on the local
            transport (``n`` = ranks this process drives), ``[epn, 2I, H]`` otherwise.
        w2: home experts of the down projection, ``[n, epn, H, I]`` (or ``[epn, H, I]``).
        b13, b2: with ``biases=True``, the gate/up bias ``[n, epn, 2I]`` and the down bias
            ``[n, epn, H]`` of the home experts (pushed with the weights); otherwise None.
        w13_scale, w2_scale: the scales of ``w13`` and ``w2`` in the ``fp8`` and ``mxfp4`` formats
            (:func:`flatep.quant.packed_layout`), otherwise None. mxfp4 scales are stored
            column-fastest (:func:`flatep.quant.columns_fastest`: each expert's ``[K/32, N]`` bytes
            contiguous, the attribute a transposed view of them), which lets the GPU kernel
            pipeline their loads; a push moves the stored bytes.
        names: the pool tensors that exist (``w13``, ``w2``, then ``w13_scale``, ``w2_scale`` when
            quantized, then ``b13``, ``b2`` with biases).
        dtype: the activations' dtype (and the plain weights' and biases').
        weights: the weight format, ``bf16``, ``fp8`` or ``mxfp4``.
        layer: the layer's index in the model (selects the slot set).
        slot_sets: sets of borrow slots shared by the layers of this shape: 1 (every layer uses
            the same slots) or 2 (layer ``L`` uses set ``L % 2``, so the next layer's push may
            run while this layer computes; costs ``epn`` more experts per rank).
        layout: the packed values' byte layout (:func:`flatep.quant.pool_layout`): ``checkpoint`` for
            fp8, ``words`` for mxfp4, or ``mma`` for mxfp4 with ``fp8_activations``.

    The constructor's ``fp8_activations`` (mxfp4 pools only; default
    :data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`, the environment's ``FLATEP_MXFP4_FP8_ACTIVATIONS``)
    makes the pool hold the ``mma`` layout, so that its GEMMs multiply fp8 activations by the weights
    decoded into e4m3 on Hopper GPUs (:mod:`flatep.kernels.mxfp4_fp8mma`); it changes the
    activations' precision (see that flag). Pools whose weights are exchanged by a push must agree.
    """

    def __init__(
        self, config: EPConfig, group: Group, dtype: torch.dtype, biases: bool = False, weights: str = "bf16",
        *, layer: int = 0, slot_sets: int = 1, fp8_activations: bool | None = None,
    ) -> None:
        check_slot_sets(layer, slot_sets)
        self.layer, self.slot_sets = layer, slot_sets
        check_pool_dims(weights, config.hidden, config.intermediate)
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"dtype (of activations and biases) must be torch.bfloat16 or torch.float32, got {dtype}")
        # The values' byte layout, fixed when the pool is made (mxfp4: words, or mma for fp8 activations).
        self.layout = pool_layout(weights, fp8_activations)
        self.config, self.group, self.dtype, self.weights = config, group, dtype, weights
        scales = ("w13_scale", "w2_scale") if weights != "bf16" else ()
        self.names: tuple[str, ...] = ("w13", "w2", *scales, *(("b13", "b2") if biases else ()))
        for name in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2"):
            setattr(self, name, self._from_storage(name, group.symmetric_empty(*self._storage_layout(name)))
                    if name in self.names else None)
        for name in self.names:  # allocated with the pool, where every rank of the group takes part
            self.slots(name)

    def _layout(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """``((epn, *one expert's shape), dtype)`` of pool tensor ``name`` per rank."""
        epn, hidden, intermediate = self.config.experts_per_rank, self.config.hidden, self.config.intermediate
        matrix = {"w13": (2 * intermediate, hidden), "w2": (hidden, intermediate)}
        if name in ("b13", "b2"):
            return (epn, 2 * intermediate if name == "b13" else hidden), self.dtype
        projection = name.removesuffix("_scale")
        if self.weights == "bf16":
            return (epn, *matrix[projection]), self.dtype
        shape, dtype = packed_layout(self.weights, *matrix[projection])[1 if name.endswith("_scale") else 0]
        return (epn, *shape), dtype

    def _columns_fastest(self, name: str) -> bool:
        """Whether pool tensor ``name`` is stored with its last two dimensions swapped (mxfp4 scales)."""
        return self.weights == "mxfp4" and name.endswith("_scale")

    def _storage_layout(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """:meth:`_layout` as stored: the last two dimensions swapped where :meth:`_columns_fastest`."""
        shape, dtype = self._layout(name)
        return ((*shape[:-2], shape[-1], shape[-2]) if self._columns_fastest(name) else shape), dtype

    def _from_storage(self, name: str, stored: torch.Tensor) -> torch.Tensor:
        """The logical view of pool tensor ``name``'s storage ``stored`` (and back: the swap is its own inverse)."""
        return stored.transpose(-1, -2) if self._columns_fastest(name) else stored

    def expert_shape(self, name: str) -> tuple[int, ...]:
        """``(epn, *one expert's shape)`` of the pool tensor ``name`` per rank (packed shapes when quantized)."""
        return self._layout(name)[0]

    def expert_nbytes(self) -> int:
        """Bytes of one expert over every pool tensor (packed values, scales, biases): what one push of
        one borrowed expert moves."""
        total = 0
        for name in self.names:
            shape, dtype = self._layout(name)
            total += math.prod(shape[1:]) * dtype.itemsize
        return total

    @property
    def slot_set(self) -> int:
        """The set of borrow slots this layer uses: ``layer % slot_sets``."""
        return self.layer % self.slot_sets

    def slots(self, name: str) -> torch.Tensor:
        """The process's borrow slots of projection ``name`` in this layer's slot set, shaped like its home pool.

        One symmetric buffer per (slot set, projection, shape, dtype), from the group's buffer
        cache, so every layer of this shape using this set shares it. Its contents are valid only
        between a step's push and the end of that step's experts.
        """
        home = self.home(name)
        shape, _ = self._storage_layout(name)
        return self._from_storage(name, self.group.buffer(f"slots{self.slot_set}.{name}", shape, home.dtype))

    @classmethod
    def from_weights(
        cls,
        w13: Weights,
        w2: Weights,
        config: EPConfig,
        group: Group,
        b13: torch.Tensor | None = None,
        b2: torch.Tensor | None = None,
        *,
        weights: str | None = None,
        dtype: torch.dtype | None = None,
        layer: int = 0,
        slot_sets: int = 1,
        fp8_activations: bool | None = None,
    ) -> "ExpertPool":
        """Build a pool from all ``E`` experts' weights, keeping each rank's own slice.

        Args:
            w13: ``[E, 2I, H]`` gate rows then up rows (vLLM layout): a float tensor, or a
                :class:`flatep.quant.QuantizedTensor` (e.g. from a checkpoint loader).
            w2: ``[E, H, I]``, like ``w13``.
            b13, b2: optional biases ``[E, 2I]`` and ``[E, H]`` (both or neither).
            weights: the pool's format (default: the format of quantized ``w13``, else ``bf16``);
                float weights are quantized into it.
            dtype: the activations' dtype (default: float weights' dtype, else bfloat16).
            layer, slot_sets: the slot set this layer uses (see :class:`ExpertPool`).
            fp8_activations: mxfp4 only: hold the ``mma`` layout for fp8 activations (see
                :class:`ExpertPool`; default: the environment's ``FLATEP_MXFP4_FP8_ACTIVATIONS``).
        """
        given = w13.format if isinstance(w13, QuantizedTensor) else "bf16"
        weights = weights or given
        if given != "bf16" and weights != given:
            raise ValueError(f"weights={weights!r} does not match the {given} tensors passed; dequantize them first")
        dtype = dtype or (w13.dtype if isinstance(w13, torch.Tensor) else torch.bfloat16)
        check_expert_weights(w13, w2, config, b13, b2, dtype)
        pool = cls(config, group, dtype, biases=b13 is not None, weights=weights, layer=layer, slot_sets=slot_sets,
                   fp8_activations=fp8_activations)
        pool.load(w13, w2, b13, b2)
        return pool

    def home(self, name: str) -> torch.Tensor:
        """Home experts of projection ``name`` of the ranks this process drives: ``[n, epn, ...]`` (or ``[epn, ...]``)."""
        if name not in self.names:
            raise ValueError(f"this pool holds {self.names}, not {name!r}")
        return getattr(self, name)

    def load(
        self, w13: Weights, w2: Weights, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
    ) -> None:
        """Copy the slices of ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (and of the biases ``b13 [E, 2I]``,
        ``b2 [E, H]`` when the pool has them) homed on this process's ranks. Float weights are
        quantized into a quantized pool's format; quantized weights must be in the pool's format."""
        if (b13 is not None) != (self.b13 is not None) or (b2 is not None) != (self.b2 is not None):
            raise ValueError(f"this pool holds {self.names}: pass b13 and b2 exactly when it has bias pools")
        epn = self.config.experts_per_rank
        first = self.group.first_rank * epn
        count = len(self.group.local_ranks) * epn
        self.load_home(*(None if weights is None else weights[first : first + count] for weights in (w13, w2, b13, b2)))

    def load_home(
        self, w13: Weights, w2: Weights, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None
    ) -> None:
        """Copy the experts homed on this process's ranks only: ``w13 [n*epn, 2I, H]``, ``w2 [n*epn, H, I]``
        (``n`` = ranks this process drives; rank ``r``'s experts are ``[r*epn, (r+1)*epn)``), and biases alike.

        Float weights are quantized into the pool's format; quantized ones must be in it."""
        tensors = {"w13": w13, "w2": w2, "b13": b13, "b2": b2}
        for name in ("w13", "w2"):
            weights = tensors[name]
            if self.weights == "bf16":
                if isinstance(weights, QuantizedTensor):
                    raise ValueError(f"{name}: a bf16 pool takes float weights, got {weights.format} (dequantize them)")
                continue
            if not isinstance(weights, QuantizedTensor):
                weights = QuantizedTensor.quantize(weights, self.weights)
            if weights.format != self.weights:
                raise ValueError(f"{name} is {weights.format}, but this pool holds {self.weights}")
            weights = weights.in_layout(self.layout)  # mxfp4: the GPU decoder's layout
            if self.layout == "mma":
                _warn_outside_window(name, weights.scales)
            tensors[name], tensors[f"{name}_scale"] = weights.values, weights.scales
        for name in self.names:
            weights = tensors[name]
            home = self.home(name)
            if weights is None or weights.numel() != home.numel():
                raise ValueError(f"{name} must hold the {home.shape[-3] * (home.shape[0] if self.group.stacked else 1)} "
                                 f"experts homed on this process, shape {[*home.shape]}, got "
                                 f"{None if weights is None else list(weights.shape)}")
            if weights.dtype != home.dtype and home.dtype in (torch.float8_e4m3fn, torch.uint8):
                raise ValueError(f"{name} must be {home.dtype}, got {weights.dtype}")
            home.copy_(weights.to(home.device).reshape(home.shape))

    def push(self, slot_experts: torch.Tensor, backend: str = "auto", programs: int | None = None) -> None:
        """Copy every borrowed expert of this step from its owner's home pool into the receiver's slot
        (of this layer's slot set), on the current stream.

        How the weights travel is the transport's business (:meth:`Group.push_pools`): the push
        kernel over peer addresses, or point-to-point messages on the collective transport. The
        caller orders it against the ranks' other uses of the slots (barriers: see
        :func:`flatep.layer.ep_moe`).

        Args:
            slot_experts: ``[R, epn]`` int32 from the plan (``-1`` = empty slot).
            backend: ``auto``, ``triton`` or ``torch`` (see :func:`flatep.kernels.backend.use_triton`).
            programs: cap on the push kernel's programs (``None``: its default).
        """
        pools = []
        for name in self.names:  # as stored: each expert's bytes contiguous
            home, slots = self._from_storage(name, self.home(name)), self._from_storage(name, self.slots(name))
            if home.dtype == torch.float8_e4m3fn:  # moved as bytes: no collective needs to know fp8
                home, slots = home.view(torch.uint8), slots.view(torch.uint8)
            pools.append((home, slots))
        self.group.push_pools(pools, slot_experts, backend, programs)

    def compute_view(self, local_index: int, part: str = "home") -> tuple[Weights | None, ...]:
        """``(w13 [epn, 2I, H], w2 [epn, H, I], b13 [epn, 2I] | None, b2 [epn, H] | None)`` of one
        rank this process drives: its home experts (``part="home"``) or its slots (``"slots"``).
        In a quantized pool ``w13`` and ``w2`` are :class:`flatep.quant.QuantizedTensor` views."""
        if part not in ("home", "slots"):
            raise ValueError(f"part must be 'home' or 'slots', got {part!r}")
        views: dict[str, torch.Tensor | None] = {}
        for name in ("w13", "w2", "w13_scale", "w2_scale", "b13", "b2"):
            if name not in self.names:
                views[name] = None
                continue
            tensor = self.home(name) if part == "home" else self.slots(name)
            views[name] = tensor[local_index] if self.group.stacked else tensor
        w13, w2 = views["w13"], views["w2"]
        if self.weights != "bf16":
            w13 = QuantizedTensor(self.weights, w13, views["w13_scale"], self.layout)
            w2 = QuantizedTensor(self.weights, w2, views["w2_scale"], self.layout)
        return w13, w2, views["b13"], views["b2"]


def check_slot_sets(layer: int, slot_sets: int) -> None:
    """Raise ``ValueError`` unless ``layer`` is a non-negative int and ``slot_sets`` is 1 or 2."""
    if isinstance(slot_sets, bool) or slot_sets not in (1, 2):
        raise ValueError(f"slot_sets must be 1 or 2, got {slot_sets!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int (the layer's index), got {layer!r}")


def check_expert_weights(
    w13: Weights,
    w2: Weights,
    config: EPConfig,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Raise ``ValueError`` unless ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (and the optional biases
    ``b13 [E, 2I]``, ``b2 [E, H]``, both or neither, in ``dtype``: default the weights' dtype) match
    ``config``. The weights are float tensors, or :class:`flatep.quant.QuantizedTensor` of one format."""
    experts, hidden, intermediate = config.experts, config.hidden, config.intermediate
    if tuple(w13.shape) != (experts, 2 * intermediate, hidden):
        raise ValueError(f"w13 must have shape [E, 2I, H] = {[experts, 2 * intermediate, hidden]}, got {list(w13.shape)}")
    if tuple(w2.shape) != (experts, hidden, intermediate):
        raise ValueError(f"w2 must have shape [E, H, I] = {[experts, hidden, intermediate]}, got {list(w2.shape)}")
    quantized = [isinstance(weights, QuantizedTensor) for weights in (w13, w2)]
    if any(quantized):
        if not all(quantized) or w13.format != w2.format:
            kinds = [weights.format if isinstance(weights, QuantizedTensor) else str(weights.dtype) for weights in (w13, w2)]
            raise ValueError(f"w13 and w2 must be in one weight format, got {kinds[0]} and {kinds[1]}")
        check_pool_dims(w13.format, hidden, intermediate)
        dtype = dtype or torch.bfloat16
    else:
        if w13.dtype != w2.dtype or w13.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"w13 and w2 must both be bfloat16 or float32, got {w13.dtype} and {w2.dtype}")
        dtype = dtype or w13.dtype
    if (b13 is None) != (b2 is None):
        raise ValueError("pass both expert biases b13 and b2, or neither")
    if b13 is not None and b2 is not None:
        if tuple(b13.shape) != (experts, 2 * intermediate):
            raise ValueError(f"b13 must have shape [E, 2I] = {[experts, 2 * intermediate]}, got {list(b13.shape)}")
        if tuple(b2.shape) != (experts, hidden):
            raise ValueError(f"b2 must have shape [E, H] = {[experts, hidden]}, got {list(b2.shape)}")
        if b13.dtype != dtype or b2.dtype != dtype:
            raise ValueError(f"b13 and b2 must have the weights' dtype {dtype}, got {b13.dtype} and {b2.dtype}")


def _warn_outside_window(name: str, scales: torch.Tensor) -> None:
    """Warn where more than :data:`WINDOW_WARNING_SHARE` of the fp8 kernel's tiles over these experts'
    ``scales [n, N, K/32]`` would be computed again."""
    share = float(mxfp4_fp8mma.tiles_outside_window(scales).float().mean())
    if share > WINDOW_WARNING_SHARE:
        warnings.warn(f"{name}: {share:.1%} of its experts' 128-column tiles hold mxfp4 scale bytes outside "
                      f"{mxfp4_fp8mma.LOW}..{mxfp4_fp8mma.HIGH} (or reach past N), which the fp8-activation kernel "
                      f"computes twice; these weights are likely faster in the default layout (fp8_activations=False, "
                      f"FLATEP_MXFP4_FP8_ACTIVATIONS unset)", stacklevel=4)
