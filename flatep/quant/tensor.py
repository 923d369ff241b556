"""A quantized weight tensor (packed values with their scales) and the weight formats' packed layouts."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flatep.environment import environment_flag
from flatep.quant.fp8 import FP8_BLOCK, check_fp8_block, dequantize_fp8_block, fp8_scale_shape, quantize_fp8_block
from flatep.quant.mxfp4 import (
    MX_BLOCK,
    check_mxfp4,
    dequantize_mxfp4,
    from_mma_layout,
    from_word_layout,
    quantize_mxfp4,
    to_mma_layout,
    to_word_layout,
)

WEIGHT_FORMATS = ("bf16", "fp8", "mxfp4")
"""``bf16``: plain weights in the pool's dtype (bfloat16, or float32 for checks); ``fp8``: e4m3 with
128x128 fp32 block scales (:mod:`flatep.quant.fp8`); ``mxfp4``: e2m1 with e8m0 scales per 32
(:mod:`flatep.quant.mxfp4`)."""
QUANTIZED_FORMATS = ("fp8", "mxfp4")
LAYOUTS = ("checkpoint", "words", "mma")
"""Byte layouts of packed values: ``checkpoint`` (as the format's checkpoints store them; the only
one of fp8) and, for mxfp4, ``words``: FlatEP's word layout (:data:`flatep.quant.mxfp4.WORD_PAIRS`),
which pools hold and the GPU kernels decode into bf16, and ``mma``
(:func:`flatep.quant.mxfp4.to_mma_layout`), which pools hold instead with
:data:`MXFP4_FP8_ACTIVATIONS` and the fp8-activation kernel decodes into e4m3.
:meth:`QuantizedTensor.in_layout` also stores the scales of ``words`` and ``mma`` columns fastest
(see :func:`columns_fastest`)."""
MXFP4_FP8_ACTIVATIONS = environment_flag("FLATEP_MXFP4_FP8_ACTIVATIONS", False)
"""Whether mxfp4 expert pools hold the ``mma`` layout, so that their GEMMs multiply the weights
decoded into e4m3 by fp8 activations on Hopper GPUs (:mod:`flatep.kernels.mxfp4_fp8mma`): off unless
the environment sets ``FLATEP_MXFP4_FP8_ACTIVATIONS=1``, because it changes the activations'
precision (each row as two e4m3 parts with one power of two a row, which hold bf16's 8 significant
bits for values at least 2**-9 of their row's largest, and smaller ones to within 2**-17 of it).
Elsewhere (other GPUs, the CPU) such pools run the exact bf16 route of the same layout. Read once, at
import; set it before pools are made. A pool's own ``fp8_activations`` argument overrides it
(:class:`flatep.ExpertPool`)."""
_PACKED_LAYOUTS = ("words", "mma")


def columns_fastest(scales: torch.Tensor) -> torch.Tensor:
    """``scales [..., N, K/32]`` with the same values, stored column-fastest (strides ``[..., 1, N]``:
    each matrix's ``[K/32, N]`` bytes contiguous). The mxfp4 GEMM reads a K step's scales of a tile's
    columns, a few bytes per column: stored so, they are contiguous, and the kernel's pipeline loads
    them asynchronously with the weights (in the checkpoint's order each step waits for them)."""
    return scales.transpose(-1, -2).contiguous().transpose(-1, -2)


def pool_layout(format: str, fp8_activations: bool | None = None) -> str:
    """The layout expert pools hold ``format``'s values in: for mxfp4 ``words``, or ``mma`` with
    ``fp8_activations`` (default :data:`MXFP4_FP8_ACTIVATIONS`); else ``checkpoint``."""
    if fp8_activations is not None and not isinstance(fp8_activations, bool):
        raise ValueError(f"fp8_activations must be None, True or False, got {fp8_activations!r}")
    if format != "mxfp4":
        if fp8_activations:
            raise ValueError(f"fp8_activations (fp8 rows times weights decoded into e4m3) applies to mxfp4 weights, "
                             f"got {format}")
        return "checkpoint"
    return "mma" if (MXFP4_FP8_ACTIVATIONS if fp8_activations is None else fp8_activations) else "words"


def check_format(weights: str) -> None:
    """Raise ``ValueError`` unless ``weights`` is one of :data:`WEIGHT_FORMATS`."""
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights (the weight format) must be one of {WEIGHT_FORMATS}, got {weights!r}")


def packed_layout(weights: str, rows: int, columns: int) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    """``((values shape, dtype), (scales shape, dtype))`` of one quantized ``[rows, columns]`` matrix.

    Raises:
        ValueError: for ``bf16`` (nothing packed) or dimensions the format cannot hold.
    """
    if weights == "fp8":
        return ((rows, columns), torch.float8_e4m3fn), (fp8_scale_shape(rows, columns), torch.float32)
    if weights == "mxfp4":
        if columns % MX_BLOCK:
            raise ValueError(f"mxfp4 needs the input dimension to be a multiple of {MX_BLOCK}, got {columns}")
        return ((rows, columns // 2), torch.uint8), ((rows, columns // MX_BLOCK), torch.uint8)
    raise ValueError(f"packed_layout takes a quantized format {QUANTIZED_FORMATS}, got {weights!r}")


def expert_weight_nbytes(weights: str, hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of one expert's ``w13 [2I, H]`` and ``w2 [H, I]`` in ``weights`` format, scales included
    (``bf16``: plain weights of ``dtype``): what a push moves per borrowed expert, biases aside."""
    check_format(weights)
    total = 0
    for rows, columns in ((2 * intermediate, hidden), (hidden, intermediate)):
        if weights == "bf16":
            total += rows * columns * dtype.itemsize
            continue
        for shape, element in packed_layout(weights, rows, columns):
            total += math.prod(shape) * element.itemsize
    return total


def check_pool_dims(weights: str, hidden: int, intermediate: int) -> None:
    """Raise ``ValueError`` unless experts with these sizes can be held in ``weights`` format.

    ``fp8`` needs ``H`` and ``I`` to be multiples of 128 (whole scale blocks, so that the fused
    gate/up projection keeps the gate's and the up's blocks apart); ``mxfp4`` needs multiples of 32.
    """
    check_format(weights)
    block = {"bf16": 1, "fp8": FP8_BLOCK, "mxfp4": MX_BLOCK}[weights]
    for name, size in (("hidden", hidden), ("intermediate", intermediate)):
        if size % block:
            raise ValueError(f"{weights} experts need {name} to be a multiple of {block}, got {size}")


@dataclass(frozen=True)
class QuantizedTensor:
    """Packed weights ``[..., N, K]`` (logical shape) of one format, with their scales.

    Attributes:
        format: ``fp8`` or ``mxfp4``.
        values: fp8: ``[..., N, K]`` float8_e4m3fn; mxfp4: ``[..., N, K/2]`` uint8, two e2m1 codes per
            byte, in ``layout``.
        scales: fp8: ``[..., ceil(N/128), ceil(K/128)]`` float32; mxfp4: ``[..., N, K/32]`` uint8 e8m0.
        layout: how ``values`` lie (:data:`LAYOUTS`): ``checkpoint`` (the default: as checkpoints,
            :func:`~flatep.quant.quantize_mxfp4` and the loaders give them) or, mxfp4 only,
            ``words``: the same bytes with each 4 bytes' bits permuted for the GPU decoder, as
            expert pools hold them, or ``mma``: each 16 bytes' bits permuted for the fp8-activation
            kernel, as pools hold them with :data:`MXFP4_FP8_ACTIVATIONS` (:meth:`in_layout`
            converts, and stores the scales column-fastest; pools convert what they load). The
            scales may be in any strides.
    """

    format: str
    values: torch.Tensor
    scales: torch.Tensor
    layout: str = "checkpoint"

    def __post_init__(self) -> None:
        if self.format == "fp8":
            check_fp8_block(self.values, self.scales)
        elif self.format == "mxfp4":
            check_mxfp4(self.values, self.scales)
        else:
            raise ValueError(f"format must be one of {QUANTIZED_FORMATS}, got {self.format!r}")
        if self.layout not in LAYOUTS or (self.layout != "checkpoint" and self.format != "mxfp4"):
            raise ValueError(f"layout must be 'checkpoint', or 'words' or 'mma' for mxfp4, got {self.layout!r} for "
                             f"{self.format}")
        if self.values.shape[:-2] != self.scales.shape[:-2]:
            raise ValueError(f"values {list(self.values.shape)} and scales {list(self.scales.shape)} must share leading dims")

    @classmethod
    def quantize(cls, weight: torch.Tensor, format: str) -> "QuantizedTensor":
        """Quantize a float ``weight [..., N, K]`` into ``format``."""
        if format == "fp8":
            return cls("fp8", *quantize_fp8_block(weight))
        if format == "mxfp4":
            return cls("mxfp4", *quantize_mxfp4(weight))
        raise ValueError(f"format must be one of {QUANTIZED_FORMATS}, got {format!r}")

    def in_layout(self, layout: str) -> "QuantizedTensor":
        """This tensor with its values in ``layout``, its scales stored column-fastest in ``words`` and
        ``mma`` (:func:`columns_fastest`) and contiguous in ``checkpoint``; itself where it is so
        already (a ``checkpoint`` tensor in any strides)."""
        scales_in_place = layout not in _PACKED_LAYOUTS or self.scales.stride(-2) == 1 or self.scales.shape[-2] == 1
        if layout == self.layout and scales_in_place:
            return self
        if layout not in LAYOUTS or self.format != "mxfp4":
            raise ValueError(f"layout must be 'checkpoint', or 'words' or 'mma' for mxfp4, got {layout!r} for "
                             f"{self.format}")
        values = self.values
        if self.layout != layout:
            values = {"checkpoint": lambda v: v, "words": from_word_layout, "mma": from_mma_layout}[self.layout](values)
            values = {"checkpoint": lambda v: v, "words": to_word_layout, "mma": to_mma_layout}[layout](values)
        if layout in _PACKED_LAYOUTS:
            return QuantizedTensor(self.format, values, columns_fastest(self.scales), layout)
        return QuantizedTensor(self.format, values, self.scales.contiguous(), layout)

    @property
    def shape(self) -> torch.Size:
        """Logical shape ``[..., N, K]``."""
        if self.format == "mxfp4":
            return torch.Size([*self.values.shape[:-1], 2 * self.values.shape[-1]])
        return self.values.shape

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def requires_grad(self) -> bool:
        """Always False: packed weights take no gradients."""
        return False

    @property
    def nbytes(self) -> int:
        """Packed bytes: values plus scales."""
        return self.values.nbytes + self.scales.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[..., N, K]`` in ``dtype``."""
        if self.format == "fp8":
            return dequantize_fp8_block(self.values, self.scales, dtype)
        return dequantize_mxfp4(self.in_layout("checkpoint").values, self.scales, dtype)

    def __getitem__(self, index: int | slice) -> "QuantizedTensor":
        """Index the leading (expert) dimensions only."""
        if len(self.shape) < 3:
            raise IndexError("only the leading dimensions of a QuantizedTensor [..., N, K] can be indexed")
        return QuantizedTensor(self.format, self.values[index], self.scales[index], self.layout)

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        return QuantizedTensor(self.format, self.values.to(device), self.scales.to(device), self.layout)

    def cat(self, other: "QuantizedTensor") -> "QuantizedTensor":
        """Rows of ``self`` then rows of ``other`` (``[..., N1 + N2, K]``): fuses gate and up projections.

        fp8 needs ``N1`` to be a multiple of 128, so that no scale block straddles the seam.
        """
        if other.format != self.format or other.shape[:-2] != self.shape[:-2] or other.shape[-1] != self.shape[-1]:
            raise ValueError(f"cannot stack {self.format} {list(self.shape)} and {other.format} {list(other.shape)} by rows")
        if self.format == "fp8" and self.shape[-2] % FP8_BLOCK:
            raise ValueError(f"fp8 rows can be stacked only at a block boundary: N={self.shape[-2]} is not a multiple of 128")
        other = other.in_layout(self.layout)
        stacked = QuantizedTensor(self.format, torch.cat([self.values, other.values], -2),
                                  torch.cat([self.scales, other.scales], -2), self.layout)
        return stacked.in_layout(self.layout)  # words, mma: the scales stored columns-fastest again
