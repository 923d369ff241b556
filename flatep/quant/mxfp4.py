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

The functions here take and return that checkpoint order. FlatEP's expert pools hold the same
bytes with the bits of each 4 bytes permuted (:data:`WORD_PAIRS`, :func:`to_word_layout`,
:func:`from_word_layout`; a :class:`flatep.quant.QuantizedTensor` with ``layout="words"``): the GPU
kernel decodes that layout with half the integer instructions. With fp8 activations they hold
another permutation, of each 32-column block's 16 bytes (:func:`to_mma_layout`, ``layout="mma"``).
Sizes, scales, and so every byte count, are the same.

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


WORD_PAIRS = (
    ((0, 0x81C081C0),),
    ((6, 0x81C081C0),),
    ((12, 0x81C081C0),),
    ((2, 0x80C080C0), (10, 0x01000100)),
)
"""FlatEP's word layout of packed MXFP4 values, as the GPU decoder reads it: for each pair ``p`` of
columns ``(p, p + 4)`` of a word (8 consecutive columns in 4 bytes, a little-endian uint32), the
``(rotation, mask)`` terms whose results ORed, ``rotate_left(word, rotation) & mask``, put column
``p``'s e2m1 bits at bits 15 (sign), 8-7 (exponent) and 6 (mantissa) and column ``p + 4``'s 16
bits higher: a bf16 pair worth ``e2m1 * 2**-126`` each. The layout is chosen so that a pair costs
one shift and one mask (two of each for the fourth), where the checkpoint's nibble order needs two
shifts and two masks for every pair (measured as a local sm_90 compile of the decode K step)."""


def _word_bit_sources() -> tuple[tuple[int, ...], ...]:
    """Bit of the word (0..31) holding bit ``b`` (0 mantissa, 1-2 exponent, 3 sign) of column ``c``, as ``[c][b]``."""
    sources = []
    for column in range(8):
        high, pair = divmod(column, 4)
        row = []
        for target in (6, 7, 8, 15):
            target += 16 * high
            (rotation,) = [rotation for rotation, mask in WORD_PAIRS[pair] if mask >> target & 1]
            row.append((target - rotation) % 32)
        sources.append(tuple(row))
    if sorted(bit for row in sources for bit in row) != list(range(32)):
        raise AssertionError("WORD_PAIRS must place every bit of a word exactly once")
    return tuple(sources)


_WORD_BIT_SOURCES = _word_bit_sources()


_CHUNK_WORDS = 1 << 24  # words permuted at a time: bounds the temporaries (64 MB each)


def _as_int32(bits: int) -> int:
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _move_bits(values: torch.Tensor, moves: list[tuple[int, int]], group_words: int = 1) -> torch.Tensor:
    """``values [..., K/2]`` uint8 read as groups of ``group_words`` little-endian 32-bit words, bit
    ``source`` of each group (``32 * word + bit``) moved to bit ``target`` for every ``(source,
    target)`` of ``moves`` (a permutation of the group's bits); same shape and dtype. Works where the
    tensor is (a GPU permutes a layer's experts in milliseconds; a CPU core moves about 100 MB a
    second)."""
    if values.dtype != torch.uint8 or values.dim() < 1 or values.shape[-1] % (4 * group_words):
        raise ValueError(f"values must be [..., N, K/2] uint8 with K/2 a multiple of {4 * group_words}, got "
                         f"{values.dtype} {list(values.shape)}")
    masks: dict[tuple[int, int, int], int] = {}  # (source word, target word, shift) -> the source bits moved so
    for source, target in moves:
        key = (source // 32, target // 32, target % 32 - source % 32)
        masks[key] = masks.get(key, 0) | 1 << source % 32
    words = values.contiguous().view(torch.int32).reshape(-1, group_words)
    moved = torch.empty_like(words)
    chunk_groups = max(1, _CHUNK_WORDS // group_words)
    for start in range(0, words.shape[0], chunk_groups):
        chunk = words[start:start + chunk_groups]
        result = torch.zeros_like(chunk)
        for (source, target, shift), mask in masks.items():
            # int32 shifts: left ones drop the bits past 31; right ones are arithmetic, so the mask
            # is applied after them, shifted alike.
            bits = chunk[:, source]
            if shift >= 0:
                result[:, target] |= (bits & _as_int32(mask)) << shift
            else:
                result[:, target] |= (bits >> -shift) & _as_int32(mask >> -shift)
        moved[start:start + chunk_groups] = result
    return moved.view(torch.uint8).reshape(values.shape)


def to_word_layout(values: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order packed values ``[..., N, K/2]`` uint8 (low nibble first) to FlatEP's word
    layout (:data:`WORD_PAIRS`), same shape; ``K/2`` must be a multiple of 4 (``K`` of 8)."""
    return _move_bits(values, [(4 * column + bit, target) for column, row in enumerate(_WORD_BIT_SOURCES)
                               for bit, target in enumerate(row)])


def from_word_layout(values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_word_layout`: FlatEP's word layout back to checkpoint order (low nibble first)."""
    return _move_bits(values, [(source, 4 * column + bit) for column, row in enumerate(_WORD_BIT_SOURCES)
                               for bit, source in enumerate(row)])


def mma_bit(column: int, bit: int) -> int:
    """Bit of a 32-column block's 16 bytes (``32 * word + bit`` of its four little-endian words) that
    holds bit ``bit`` (0 mantissa, 1-2 exponent, 3 sign) of ``column`` in the fp8 MMA layout
    (:func:`to_mma_layout`)."""
    half, q, j = column // 16, column % 16 // 4, column % 4
    if bit < 3:
        return 32 * q + 16 * half + 4 * j + bit
    return 32 * q + 8 * j + (7 if half == 0 else 3)


_MMA_MOVES = [(4 * column + bit, mma_bit(column, bit)) for column in range(MX_BLOCK) for bit in range(4)]


def to_mma_layout(values: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order packed values ``[..., N, K/2]`` uint8 (``K`` a multiple of 32) to the layout
    that :mod:`flatep.kernels.mxfp4_fp8mma` decodes into e4m3 (fp8 activations), same shape. Each
    32-column block's 16 bytes are four little-endian words; word ``q`` holds columns ``4q + j`` and
    ``16 + 4q + j`` (``j`` in 0..3: the K positions the fp8 warp-group MMA's operand gives lane ``q``
    of each four), the magnitude bits of the first at bits ``4j .. 4j+2`` and its sign at ``8j + 7``,
    those of the second at ``16 + 4j ..`` and ``8j + 3`` (:func:`mma_bit`): a byte permute through an
    8-byte table then decodes four magnitudes, and the signs land on the bytes' top bits with one
    shift."""
    return _move_bits(values, _MMA_MOVES, 4)


def from_mma_layout(values: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`to_mma_layout`: back to checkpoint order (low nibble first)."""
    return _move_bits(values, [(target, source) for source, target in _MMA_MOVES], 4)


def mxfp4_from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint tensors as stored (gpt-oss ``*_blocks [..., N, K/32, 16]``, ``*_scales [..., N, K/32]``, uint8)
    to ``(values [..., N, K/2], scales [..., N, K/32])``; ``values [..., N, K/2]`` is accepted as well."""
    if blocks.dim() >= 3 and blocks.shape[-1] == MX_BLOCK // 2 and list(blocks.shape[:-1]) == list(scales.shape):
        blocks = blocks.flatten(-2)
    check_mxfp4(blocks, scales)
    return blocks.contiguous(), scales.contiguous()
