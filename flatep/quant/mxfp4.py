"""MXFP4: e2m1 values, two per byte, one e8m0 scale per 32 values (OCP Microscaling; the gpt-oss
and Kimi-K3 checkpoint layout).

Byte layout (one weight matrix ``[N, K]``, output rows by input columns, any leading dimensions;
``K`` must be a multiple of 32):

- ``values``: ``[..., N, K/2]`` uint8, packed along the input dimension: byte ``j`` of row ``n``
  holds element ``2j`` in its low nibble and element ``2j+1`` in its high nibble. The checkpoint's
  ``*_blocks`` tensor ``[..., N, K/32, 16]`` is the same bytes (:func:`mxfp4_from_checkpoint`).
- Nibble (e2m1): bit 3 sign, bits 2-1 exponent (bias 1), bit 0 mantissa; the codes 0..7 are the
  magnitudes ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (:data:`E2M1_VALUES` lists all 16, negatives 8..15).
- ``scales`` (``*_scales``): ``[..., N, K/32]`` uint8 e8m0, ``scale = 2**(byte - 127)`` for the 32
  values ``[32 b, 32 b + 32)`` of the row; byte 255 is NaN in the OCP spec (never written here).
- Dequantization: ``w[n, k] = E2M1_VALUES[nibble(n, k)] * 2**(scales[n, k // 32] - 127)``.

Quantization (:func:`quantize_mxfp4`) follows the OCP MX v1.0 recipe: the shared exponent is
``floor(log2(amax)) - 2`` (2 = e2m1's largest exponent), clamped to the e8m0 range; each value
divided by its scale rounds to the nearest e2m1 value (ties to even mantissa) and saturates at +-6.
"""
from __future__ import annotations

import torch

MX_BLOCK = 32
"""Values sharing one e8m0 scale."""
E2M1_MAX = 6.0
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each nibble ``0..15``."""
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between consecutive magnitudes


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Nibbles (uint8 ``0..15``) of the e2m1 values nearest to ``x`` (ties to even mantissa, saturating at +-6)."""
    magnitude = x.float().abs().contiguous()  # bucketize copies a strided input (with a warning)
    midpoints = torch.tensor(_MIDPOINTS, device=x.device)
    code = torch.bucketize(magnitude, midpoints)  # a midpoint itself goes to the smaller magnitude...
    tie = (code < len(_MIDPOINTS)) & (magnitude == midpoints[code.clamp(max=len(_MIDPOINTS) - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ...unless that one has an odd mantissa bit
    sign = torch.signbit(x).long() << 3
    return (code | sign).to(torch.uint8)


def e2m1_decode(nibbles: torch.Tensor) -> torch.Tensor:
    """float32 value of each nibble (uint8 ``0..15``)."""
    return torch.tensor(E2M1_VALUES, device=nibbles.device)[nibbles.long()]


def check_mxfp4(values: torch.Tensor, scales: torch.Tensor, name: str = "weight") -> None:
    """Raise ``ValueError`` unless ``values [..., N, K/2]`` uint8 and ``scales [..., N, K/32]`` uint8 form one
    MXFP4 tensor (``name`` is used in the message)."""
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name} MXFP4 values and scales must both be torch.uint8, got {values.dtype} and {scales.dtype}")
    if values.dim() < 2:
        raise ValueError(f"{name} values must be [..., N, K/2], got shape {list(values.shape)}")
    if values.shape[-1] % (MX_BLOCK // 2):
        raise ValueError(f"{name} values: K/2 = {values.shape[-1]} must be a multiple of 16 (K a multiple of 32)")
    expected = [*values.shape[:-1], values.shape[-1] // (MX_BLOCK // 2)]
    if list(scales.shape) != expected:
        raise ValueError(f"{name} scales must have shape [..., N, K/32] = {expected} for values {list(values.shape)}, "
                         f"got {list(scales.shape)}")
    if values.device != scales.device:
        raise ValueError(f"{name} values and scales must be on one device, got {values.device} and {scales.device}")


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``weight [..., N, K]`` (finite, ``K`` a multiple of 32).

    Returns:
        ``(values [..., N, K/2] uint8, scales [..., N, K/32] uint8)``.
    """
    if not weight.is_floating_point() or weight.dim() < 2:
        raise ValueError(f"weight must be a floating-point [..., N, K] tensor, got {weight.dtype} {list(weight.shape)}")
    if weight.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP4 needs the input dimension K to be a multiple of {MX_BLOCK}, got K={weight.shape[-1]}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight must be finite to quantize")
    blocks = weight.float().unflatten(-1, (-1, MX_BLOCK))
    amax = blocks.abs().amax(dim=-1)
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1): floor(log2 amax) = exponent - 1
    shared = torch.where(amax > 0, exponent - 3, torch.full_like(exponent, -E8M0_BIAS))
    shared = shared.clamp(-E8M0_BIAS, E8M0_BIAS)
    nibbles = e2m1_encode(torch.ldexp(blocks, -shared.unsqueeze(-1).float())).flatten(-2)
    values = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return values, (shared + E8M0_BIAS).to(torch.uint8)


def unpack_mxfp4_nibbles(values: torch.Tensor) -> torch.Tensor:
    """``[..., N, K]`` uint8 nibbles of packed ``values [..., N, K/2]`` (low nibble first)."""
    return torch.stack([values & 0xF, values >> 4], dim=-1).flatten(-2)


def dequantize_mxfp4(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1_VALUES[nibble] * 2**(scale - 127)``: ``[..., N, K]`` in ``dtype`` (exact in bf16 and fp32
    while the result stays in their range)."""
    check_mxfp4(values, scales)
    decoded = e2m1_decode(unpack_mxfp4_nibbles(values)).unflatten(-1, (-1, MX_BLOCK))
    exponents = scales.to(torch.int32) - E8M0_BIAS
    scaled = torch.ldexp(decoded, exponents.unsqueeze(-1).float())
    scaled = torch.where((scales == 255).unsqueeze(-1), torch.full_like(scaled, float("nan")), scaled)
    return scaled.flatten(-2).to(dtype)


def mxfp4_from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors as stored (gpt-oss ``*_blocks [..., N, K/32, 16]``, ``*_scales [..., N, K/32]``, uint8)
    to ``(values [..., N, K/2], scales [..., N, K/32])``; ``values [..., N, K/2]`` is accepted as well."""
    if blocks.dim() >= 3 and blocks.shape[-1] == MX_BLOCK // 2 and list(blocks.shape[:-1]) == list(scales.shape):
        blocks = blocks.flatten(-2)
    check_mxfp4(blocks, scales)
    return blocks.contiguous(), scales.contiguous()
