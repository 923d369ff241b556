"""``flatep.bench.sass``: the K loop of a SASS listing."""
from __future__ import annotations

import pytest

from flatep.bench.sass import innermost_mma_loop

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   IMAD R2, R1, R1, RZ ;
        /*0020*/                   LDS R3, [R2] ;
        /*0030*/                   HGMMA.64x32x16.F32.BF16 R24, R56, gdesc[UR4], R24 ;
        /*0040*/               @P0 BRA 0x20 ;
        /*0050*/                   STG.E [R4], R24 ;
        /*0060*/               @P1 BRA 0x10 ;
        /*0070*/                   LDS R5, [R6] ;
        /*0080*/               @P2 BRA 0x70 ;
        /*0090*/                   EXIT ;
"""


def test_the_innermost_loop_with_an_mma():
    loop = innermost_mma_loop(SASS)
    assert [line.split()[0] for line in loop] == ["LDS", "HGMMA.64x32x16.F32.BF16", "@P0"]


def test_no_mma_loop_is_an_error():
    with pytest.raises(ValueError, match="no loop"):
        innermost_mma_loop(SASS.replace("HGMMA.64x32x16.F32.BF16", "FFMA"))
