"""FP8 e4m3 with one fp32 scale per 128x128 block: the DeepSeek-V3 / Kimi-K2 checkpoint layout.

Byte layout (one weight matrix ``[N, K]``, output rows by input columns, any leading dimensions):

- ``values`` (checkpoint name ``weight``): ``[..., N, K]`` ``torch.float8_e4m3fn``, one byte per
  weight, row-major. e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, largest
  finite magnitude 448, one NaN pattern per sign.
- ``scales`` (checkpoint name ``weight_scale_inv``): ``[..., ceil(N/128), ceil(K/128)]`` float32;
  ``scales[i, j]`` belongs to rows ``[128 i, 128 i + 128)`` and columns ``[128 j, 128 j + 128)``
  (the last block of a dimension that is not a multiple of 128 is partial).
- Dequantization: ``w[n, k] = float(values[n, k]) * scales[n // 128, k // 128]``.

Quantization (:func:`quantize_fp8_block`) picks ``scale = amax(|block|) / 448`` (1 for an all-zero
block), so every block uses the whole e4m3 range; the cast rounds to nearest even and saturates at
+-448 (:func:`to_e4m3`).

Activations (:func:`quantize_fp8_activations`) are quantized as DeepSeek-V3's inference does: per
token, per 128-wide group of the input dimension, ``scale = max(amax, 1e-10) / 448``, giving
``q [M, K]`` e4m3 and ``scales [M, ceil(K/128)]`` float32 with ``x ~ q * scales[:, k // 128]``.
The division by 448 is a multiplication by the fp32 reciprocal of 448 (:data:`E4M3_RECIPROCAL`),
which is what torch computes for ``tensor / 448`` on a GPU; the values are ``x / scale`` correctly
rounded. Both are exact IEEE operations, so the Triton kernels give the same bits on every device.
"""
from __future__ import annotations

import torch

FP8_BLOCK = 128
"""Rows and columns of one weight scale block (and columns of one activation group)."""
E4M3_MAX = 448.0
"""Largest finite e4m3fn magnitude."""
E4M3_RECIPROCAL = 1.0 / E4M3_MAX
"""The activation scale's factor: ``scale = max(amax, 1e-10) * E4M3_RECIPROCAL``, rounded to fp32
where it multiplies fp32 (what torch computes for ``tensor / 448`` on a GPU)."""
_ACTIVATION_EPS = 1e-10  # keeps an all-zero row's scale finite (and its values 0, not NaN)


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Cast to ``float8_e4m3fn``, rounding to nearest even and saturating at +-448 (NaN stays NaN)."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_scale_shape(rows: int, columns: int) -> tuple[int, int]:
    """``(ceil(rows/128), ceil(columns/128))``: the scale grid of a ``[rows, columns]`` matrix."""
    return -(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK)


def _expand_blocks(scales: torch.Tensor, rows: int, columns: int, block: int = FP8_BLOCK) -> torch.Tensor:
    """``[..., rows, columns]``: every block scale repeated over its block, partial edges cropped."""
    expanded = scales.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return expanded[..., :rows, :columns]


def check_fp8_block(values: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> None:
    """Raise ``ValueError`` unless ``values [..., N, K]`` e4m3fn and ``scales [..., ceil(N/128), ceil(K/128)]``
    float32 form one block-scaled FP8 tensor (``name`` is used in the message)."""
    if values.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name} values must be torch.float8_e4m3fn, got {values.dtype}")
    if scales.dtype != torch.float32:
        raise ValueError(f"{name} scales (weight_scale_inv) must be torch.float32, got {scales.dtype}")
    if values.dim() < 2:
        raise ValueError(f"{name} values must be [..., N, K], got shape {list(values.shape)}")
    expected = [*values.shape[:-2], *fp8_scale_shape(*values.shape[-2:])]
    if list(scales.shape) != expected:
        raise ValueError(f"{name} scales must have shape [..., ceil(N/128), ceil(K/128)] = {expected} for values "
                         f"{list(values.shape)}, got {list(scales.shape)}")
    if values.device != scales.device:
        raise ValueError(f"{name} values and scales must be on one device, got {values.device} and {scales.device}")


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``weight [..., N, K]`` (any float dtype, finite).

    Returns:
        ``(values [..., N, K] float8_e4m3fn, scales [..., ceil(N/128), ceil(K/128)] float32)``.
    """
    if not weight.is_floating_point() or weight.dim() < 2:
        raise ValueError(f"weight must be a floating-point [..., N, K] tensor, got {weight.dtype} {list(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight must be finite to quantize")
    rows, columns = weight.shape[-2:]
    grid = fp8_scale_shape(rows, columns)
    padded = torch.nn.functional.pad(weight.float(), (0, grid[1] * FP8_BLOCK - columns, 0, grid[0] * FP8_BLOCK - rows))
    blocks = padded.unflatten(-1, (grid[1], FP8_BLOCK)).unflatten(-3, (grid[0], FP8_BLOCK))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N/128, K/128]
    scales = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    values = to_e4m3(weight.float() / _expand_blocks(scales, rows, columns))
    return values, scales


def dequantize_fp8_block(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * scales`` (each scale over its 128x128 block): ``[..., N, K]`` in ``dtype``."""
    check_fp8_block(values, scales)
    rows, columns = values.shape[-2:]
    return (values.float() * _expand_blocks(scales, rows, columns)).to(dtype)


def quantize_fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column-group quantization of ``x [M, K]`` (any float dtype).

    Returns:
        ``(values [M, K] float8_e4m3fn, scales [M, ceil(K/128)] float32)``.
    """
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"x must be a floating-point [M, K] tensor, got {x.dtype} {list(x.shape)}")
    rows, columns = x.shape
    groups = -(-columns // FP8_BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, groups * FP8_BLOCK - columns)).view(rows, groups, FP8_BLOCK)
    scales = padded.abs().amax(dim=-1).clamp_min(_ACTIVATION_EPS) * E4M3_RECIPROCAL
    values = to_e4m3(padded / scales.unsqueeze(-1)).view(rows, groups * FP8_BLOCK)[:, :columns]
    return values.contiguous(), scales


def dequantize_fp8_activations(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``values [M, K] * scales [M, ceil(K/128)]`` (each scale over its 128 columns): ``[M, K]`` float32."""
    return values.float() * scales.repeat_interleave(FP8_BLOCK, dim=-1)[:, : values.shape[-1]]
