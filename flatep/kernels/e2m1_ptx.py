"""The GPU decode of FlatEP's mxfp4 word layout as PTX inline assembly, shared by the Triton
tiles (:mod:`flatep.kernels.quant_gemm`) and the Gluon kernel (:mod:`flatep.kernels.mxfp4_wgmma`).

An asm block takes one int32 word (``$4``: 8 e2m1 codes in the word layout,
:data:`flatep.quant.mxfp4.WORD_PAIRS`) and one bf16 pair of the word's block scale (``$5``), and
writes four int32 registers ``$0 .. $3``, each two bf16 weights. The scale pair of an e8m0 byte is
``byte * SCALE_PAIR`` (two multiplies a pair of weights: by ``2**126``, then by ``2**(byte - 127)``)
or, for the one-multiply decode, ``min(byte * SCALE_PAIR + ONE_MULTIPLY_BIAS * SCALE_PAIR,
INF_PAIR)`` (``2**(byte - 1)``, exact up to byte :data:`ONE_MULTIPLY_MAX_BYTE`, +inf past it).
"""
from __future__ import annotations

from flatep.quant.mxfp4 import WORD_PAIRS

SCALE_PAIR = 0x800080
"""An e8m0 byte times this is the bf16 pair of ``2**(byte - 127)`` (a bf16 power of two has exponent
field = byte; byte 0 gives 0): ``byte << 7 | byte << 23`` in one multiply, the copies not overlapping."""
ONE_MULTIPLY_BIAS = 126
"""The one-multiply decode's factor ``2**(byte - 1)`` has exponent field ``byte + 126``."""
ONE_MULTIPLY_MAX_BYTE = 128
"""The largest scale byte the one-multiply decode gets right (its factor is a bf16 up to it)."""
INF_PAIR = 0x7F807F80
"""The bf16 pair of +inf, the one-multiply factor's cap."""


def _placement_ptx(pair: int) -> list[str]:
    """PTX placing pair ``pair`` of word ``$4`` into ``t`` (see :data:`flatep.quant.mxfp4.WORD_PAIRS`):
    per term a shift (a plain left shift where no kept bit wraps around, which ptxas may issue on
    the multiply pipe; else a rotation) and a mask; terms ORed."""
    lines = []
    for term, (rotation, mask) in enumerate(WORD_PAIRS[pair]):
        register = "t" if term == 0 else "u"
        if rotation == 0:
            lines.append(f"and.b32 {register}, $4, {mask:#010x};")
        else:
            kept = [bit for bit in range(32) if mask >> bit & 1]
            shift = f"shl.b32 {register}, $4," if min(kept) >= rotation else f"shf.l.wrap.b32 {register}, $4, $4,"
            lines += [f"{shift} {rotation};", f"and.b32 {register}, {register}, {mask:#010x};"]
        if term:
            lines.append("or.b32 t, t, u;")
    return lines


def scaled_pairs_ptx(one_multiply: bool, natural: bool = False) -> str:
    """Per pair of the word, the placement (bits to a bf16 pair worth ``e2m1 * 2**-126`` each), then
    bf16x2 FMAs with a -0 addend (plain products, signs of zeros kept): by ``2**126`` and by ``$5``,
    or (``one_multiply``) by ``$5`` alone.

    Output ``$p`` holds pair ``p``: columns ``p`` (low half) and ``p + 4`` (high half) of the word.
    With ``natural``, four byte permutes (``prmt``) put the columns in order instead: ``$q`` holds
    columns ``2q`` and ``2q + 1``, so that the four registers stored one after another are the
    word's 8 bf16 weights in column order."""
    temporaries = "q0, q1, q2, q3, " if natural else ""
    lines = [f".reg .b32 {temporaries}t, u, big, nzero;", "mov.b32 big, 0x7E807E80;", "mov.b32 nzero, 0x80008000;"]
    for pair in range(4):
        target = f"q{pair}" if natural else f"${pair}"
        lines += _placement_ptx(pair)
        lines += ([] if one_multiply else ["fma.rn.bf16x2 t, t, big, nzero;"]) + [f"fma.rn.bf16x2 {target}, t, $5, nzero;"]
    if natural:  # columns (0, 1) and (2, 3) are the pairs' low halves, (4, 5) and (6, 7) their high ones
        lines += ["prmt.b32 $0, q0, q1, 0x5410;", "prmt.b32 $1, q2, q3, 0x5410;",
                  "prmt.b32 $2, q0, q1, 0x7632;", "prmt.b32 $3, q2, q3, 0x7632;"]
    return "{\n" + "\n".join(lines) + "\n}"
