"""The mxfp4 weights' decode in registers, for the Triton tiles of :mod:`flatep.kernels.quant_gemm`
and :mod:`flatep.kernels.mxfp4_dequant`: int32 words of packed e2m1 codes and their e8m0 scales in,
bf16 weights out, exactly (e2m1 times a power of two).

FlatEP's word layout (:data:`flatep.quant.mxfp4.WORD_PAIRS`; 8 columns a word) is chosen for this
decode. It works on whole words, two weights per instruction: pair ``p`` of a word (columns ``p``
and ``p + 4``) is the word rotated by a constant and masked (two such terms ORed for the last pair),
which places both codes bit for bit into the two halves of a bf16 pair (sign to bit 15, exponent
and mantissa to bits 8-6): ``e2m1 * 2**-126`` for every code (codes 0 and 1 become bf16
subnormals). In the checkpoint's nibble order a code's sign and magnitude need different shifts,
two shifts and two masks per pair (a local sm_90 compile of the 16-row tile's K step: 243
instructions against 289, and 497 against 592 for the 32-row tile). One packed bf16x2 multiply by
the block's ``2**(e - 1)`` finishes each pair (PTX inline assembly, :mod:`flatep.kernels.e2m1_ptx`;
exact, including the subnormal inputs, which bf16 arithmetic keeps). That factor is a bf16 only up
to scale byte 128 (weights up to 12, which real checkpoints stay well under); from byte 129 on it is
capped at +inf, which makes every weight of such a block +-inf or NaN: the GEMMs then compute the
tile again with two multiplies per pair (by ``2**126``, then by ``2**(e - 127)``: exact at every
byte; see :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton`). One multiply instead of two
takes 392 instructions per K step of the 16 x 128 x 64 tile on 2 warps against 434 (168 registers a
thread either way), and 443 against 483 for the 32 x 256 x 64 tile (214 and 216 registers; local
sm_90 compile, Triton 3.6, in the lane word order below). Byte 0 (``2**-127``) decodes to its values
(bf16 subnormals) with one multiply and to 0 with two (they are below ``6 * 2**-127`` anyway).

A word yields columns in the order 0 4 1 5 2 6 3 7: short tiles run the dot over K in that order
and permute the activations alike. Triton's ``mma.sync`` operand layout gives each lane one word of
each 32-column chunk of a K step: in column order a lane's two words of a 64-wide step lie in
different scale blocks, and it loads and converts one scale byte per word. :func:`lane_word_order`
takes each step's words in another order (``GemmConfig.lane_words``; the activations alike), in
which a lane's words are neighbours in one block: 8 scale loads a step instead of 16, and 392
instructions per K step instead of 423 for the 16-row tile (168 registers instead of 188), 443
instead of 472 for the 32-row one (214 instead of 234; local sm_90 compile, Triton 3.6;
``bench/scripts/gemm_kloop_sass.py`` counts a tree's tiles with and without). The default short
tiles take it (:func:`flatep.kernels.packed_tiles.default_config`): with pointer copies neither
order was faster for the 16-row tile on an H100 and the plain 32-row tile was 1-3% faster, but with
TMA copies the lane order took 10-12% less time than the plain one for the 32-row tile. Tall unswapped tiles
(a warp-group MMA, whose weight operand goes through shared memory anyway) put the decoded weights
back in column order instead (``NATURAL_K``).

The interpreter runs the same bit placement, word order and multiplies in fp32, with the same cap.
:func:`mma_decoded_tile` decodes the ``mma`` layout (:func:`flatep.quant.mxfp4.mma_bit`, pools for
fp8 activations) exactly, in column order.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flatep.kernels.e2m1_ptx import INF_PAIR, ONE_MULTIPLY_BIAS, ONE_MULTIPLY_MAX_BYTE, SCALE_PAIR, scaled_pairs_ptx
from flatep.quant.mxfp4 import WORD_PAIRS, _as_int32

_PAIR0_ROTATION, _PAIR0_MASK = tl.constexpr(WORD_PAIRS[0][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[0][0][1]))
_PAIR1_ROTATION, _PAIR1_MASK = tl.constexpr(WORD_PAIRS[1][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[1][0][1]))
_PAIR2_ROTATION, _PAIR2_MASK = tl.constexpr(WORD_PAIRS[2][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[2][0][1]))
_PAIR3_ROTATION, _PAIR3_MASK = tl.constexpr(WORD_PAIRS[3][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[3][0][1]))
_PAIR3B_ROTATION, _PAIR3B_MASK = tl.constexpr(WORD_PAIRS[3][1][0]), tl.constexpr(_as_int32(WORD_PAIRS[3][1][1]))


@triton.jit
def _rotate_left(words, rotation: tl.constexpr):
    """``words`` (int32) rotated left by ``rotation`` bits (0..31)."""
    if rotation == 0:
        return words
    bits = words.to(tl.uint32, bitcast=True)
    return ((bits << rotation) | (bits >> (32 - rotation))).to(tl.int32, bitcast=True)


@triton.jit
def _e2m1_bf16_pairs(words):
    """The four bf16 pairs of int32 ``words`` in FlatEP's word layout (:data:`flatep.quant.mxfp4.WORD_PAIRS`):
    pair ``p`` holds column ``8j + p`` of word ``j`` in its low half and ``8j + p + 4`` in its high
    half, each e2m1 code's bits placed into a bf16 (sign to bit 15, exponent and mantissa to bits
    8-6), which makes it ``e2m1 * 2**-126`` exactly (codes 0 and 1 become bf16 subnormals): one
    shift and one mask per pair (two of each for the last)."""
    p0 = _rotate_left(words, _PAIR0_ROTATION) & _PAIR0_MASK
    p1 = _rotate_left(words, _PAIR1_ROTATION) & _PAIR1_MASK
    p2 = _rotate_left(words, _PAIR2_ROTATION) & _PAIR2_MASK
    p3 = (_rotate_left(words, _PAIR3_ROTATION) & _PAIR3_MASK) | (_rotate_left(words, _PAIR3B_ROTATION) & _PAIR3B_MASK)
    return p0, p1, p2, p3


_SCALED_PAIRS_PTX = tl.constexpr(scaled_pairs_ptx(False))
_ONE_MULTIPLY_PTX = tl.constexpr(scaled_pairs_ptx(True))
_SCALE_PAIR = tl.constexpr(SCALE_PAIR)
_ONE_MULTIPLY_BIAS = tl.constexpr(ONE_MULTIPLY_BIAS)
_ONE_MULTIPLY_MAX_BYTE = tl.constexpr(ONE_MULTIPLY_MAX_BYTE)
_INF_PAIR = tl.constexpr(INF_PAIR)


@triton.jit
def _scaled_pairs_asm(words, scale_pairs, ONE_MULTIPLY: tl.constexpr):
    """:func:`_e2m1_bf16_pairs` times ``2**126`` (0x7E80 in bf16) times ``scale_pairs`` (bf16x2), or
    with ``ONE_MULTIPLY`` times ``scale_pairs`` alone, in PTX: the multiplies are packed bf16x2
    FMAs, one instruction per two weights, exact (powers of two)."""
    ptx: tl.constexpr = _ONE_MULTIPLY_PTX if ONE_MULTIPLY else _SCALED_PAIRS_PTX
    return tl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r,r", [words, scale_pairs],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _pairs_to_values(p0, p1, p2, p3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 pairs ``[BLOCK_N, BLOCK_K/8]`` each -> ``[BLOCK_N, BLOCK_K/2]`` int32 in logical order
    (pair ``p`` of word ``j`` at ``4j + p``)."""
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [BLOCK_N, BLOCK_K // 2])


@triton.jit
def lane_word_order(x, ROWS: tl.constexpr, WORDS: tl.constexpr, INNER: tl.constexpr):
    """``x [ROWS, WORDS * INNER]`` (``INNER`` values per word of a K step) with the step's words
    reordered: position ``4c + t`` takes word ``t * C + c`` (``C = WORDS / 4``, one word per
    32-column chunk). The short tiles' MMA operand gives lane ``t`` (of each four) position ``t``
    of every chunk, so the words a lane decodes are neighbours in memory and share e8m0 scale
    blocks: one scale a column per 32-column block it spans instead of one per word (see
    :func:`_word_scales`)."""
    CHUNKS: tl.constexpr = WORDS // 4
    return tl.reshape(tl.permute(tl.reshape(x, [ROWS, 4, CHUNKS, INNER]), (0, 2, 1, 3)), [ROWS, WORDS * INNER])


@triton.jit
def _word_scales(x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANE_ORDER: tl.constexpr):
    """``x [BLOCK_N, BLOCK_K/32]`` (one value per e8m0 scale block of a K step) repeated for each
    word of its block: ``[BLOCK_N, BLOCK_K/8]``, the words in column order, or with ``LANE_ORDER``
    in :func:`lane_word_order`'s order (the block of position ``4c + t`` is ``(t * C + c) // 4``).
    Broadcasts, so that what is computed per block (the scale pairs) is computed once per block."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    if not LANE_ORDER or BLOCKS == 1:
        words = tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK_N, BLOCKS, 4]), [BLOCK_N, WORDS])
    elif BLOCKS == 2:  # position 4c + t is in block t // 2
        words = tl.reshape(tl.broadcast_to(tl.reshape(x, [BLOCK_N, 1, 2, 1]), [BLOCK_N, 2, 2, 2]), [BLOCK_N, WORDS])
    else:  # BLOCKS a multiple of 4: position 4c + t is in block t * BLOCKS / 4 + c // 4
        by_lane = tl.permute(tl.reshape(x, [BLOCK_N, 4, BLOCKS // 4]), (0, 2, 1))
        words = tl.reshape(tl.broadcast_to(tl.reshape(by_lane, [BLOCK_N, BLOCKS // 4, 1, 4]),
                                           [BLOCK_N, BLOCKS // 4, 4, 4]), [BLOCK_N, WORDS])
    return words


@triton.jit
def _mma_code_values(words, MAGNITUDE: tl.constexpr, SIGN: tl.constexpr):
    """The e2m1 values (fp32) of the codes of int32 ``words`` whose magnitude bits start at bit
    ``MAGNITUDE`` and whose sign is bit ``SIGN`` (the ``mma`` layout, :func:`flatep.quant.mxfp4.mma_bit`),
    built as normal floats (``(1 + m / 2) * 2**(e - 1)``; ``0.5 * m`` for exponent 0)."""
    magnitude = (words >> MAGNITUDE) & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    bits = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(((words >> SIGN) & 1) != 0, -value, value)


@triton.jit
def mma_decoded_tile(words, exponent, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """The weights of int32 ``words [BLOCK_N, BLOCK_K/8]`` in the ``mma`` layout (column order) with int32
    e8m0 ``exponent [BLOCK_N, BLOCK_K/32]``: ``[BLOCK_N, BLOCK_K]`` bf16 (fp32 under the interpreter) in
    column order, each weight ``e2m1 * 2**(e - 127)`` as one fp32 product, exact for every byte from 1
    to 254 (byte 0 gives 0, as the bf16 tiles' second pass; 255 inf or NaN). Word ``4 * block + q``
    holds columns ``32 * block + 4q + j`` and ``32 * block + 16 + 4q + j``."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    low = tl.reshape(tl.join(tl.join(_mma_code_values(words, 0, 7), _mma_code_values(words, 8, 23)),
                             tl.join(_mma_code_values(words, 4, 15), _mma_code_values(words, 12, 31))),
                     [BLOCK_N, WORDS, 4])  # columns 4q + j
    high = tl.reshape(tl.join(tl.join(_mma_code_values(words, 16, 3), _mma_code_values(words, 24, 19)),
                              tl.join(_mma_code_values(words, 20, 11), _mma_code_values(words, 28, 27))),
                      [BLOCK_N, WORDS, 4])  # columns 16 + 4q + j
    values = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCKS, 4, 4, 2])  # [.., block, q, j, half]
    values = tl.reshape(tl.permute(values, (0, 1, 4, 2, 3)), [BLOCK_N, BLOCKS, 32])
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(values * scale[:, :, None], [BLOCK_N, BLOCK_K])
    if not INTERPRET:
        w = w.to(tl.bfloat16)  # exact: e2m1 times a power of two
    return w


@triton.jit
def decoded_tile(words, exponent, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATURAL_K: tl.constexpr,
                  INTERPRET: tl.constexpr, ONE_MULTIPLY: tl.constexpr = False, LANE_WORDS: tl.constexpr = False):
    """The weights of int32 ``words [BLOCK_N, BLOCK_K/8]`` (word layout; with ``LANE_WORDS`` in
    :func:`lane_word_order`'s order, else in column order) with int32 e8m0 ``exponent [BLOCK_N,
    BLOCK_K/32]``: ``[BLOCK_N, BLOCK_K]`` bf16 (fp32 under the interpreter), the words in their
    order and each word's columns in the order 0 4 1 5 2 6 3 7, or in column order with ``NATURAL_K``.

    ``ONE_MULTIPLY``: one bf16x2 multiply per pair instead of two (by ``2**(e - 1)``, exact for
    scale bytes up to 128, byte 0 included: its values come out as they are, bf16 subnormals);
    every weight of a block with a byte from 129 on is then +-inf or NaN instead."""
    WORDS: tl.constexpr = BLOCK_K // 8
    if INTERPRET:
        p0, p1, p2, p3 = _e2m1_bf16_pairs(words)
        pairs = _pairs_to_values(p0, p1, p2, p3, BLOCK_N, BLOCK_K)
        low = (pairs << 16).to(tl.float32, bitcast=True)
        high = (pairs & -0x10000).to(tl.float32, bitcast=True)
        raw = tl.reshape(tl.join(low, high), [BLOCK_N, WORDS, 8])  # e2m1 * 2**-126
        if ONE_MULTIPLY:  # as the GPU's: 2**(e - 1) in fp32, +inf from byte 129 on
            capped = tl.minimum(exponent, _ONE_MULTIPLY_MAX_BYTE + 1) + _ONE_MULTIPLY_BIAS
            scale = (capped << 23).to(tl.float32, bitcast=True)
        else:
            raw = raw * 8.507059173023462e37  # 2**126
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        scale = _word_scales(scale, BLOCK_N, BLOCK_K, LANE_WORDS)
        w = tl.reshape(raw * scale[:, :, None], [BLOCK_N, BLOCK_K])
    else:
        if ONE_MULTIPLY:
            scale_pairs = (exponent * _SCALE_PAIR + _ONE_MULTIPLY_BIAS * _SCALE_PAIR).to(tl.uint32, bitcast=True)
            scale_pairs = tl.minimum(scale_pairs, _INF_PAIR).to(tl.int32, bitcast=True)
        else:
            scale_pairs = exponent * _SCALE_PAIR
        scale_pairs = _word_scales(scale_pairs, BLOCK_N, BLOCK_K, LANE_WORDS)
        p0, p1, p2, p3 = _scaled_pairs_asm(words, scale_pairs, ONE_MULTIPLY)
        pairs = _pairs_to_values(p0, p1, p2, p3, BLOCK_N, BLOCK_K)
        low = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])
    if NATURAL_K:
        w = tl.reshape(tl.permute(tl.reshape(w, [BLOCK_N, WORDS, 4, 2]), (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
    return w
