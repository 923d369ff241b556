"""The fp8-activation mxfp4 prototype of ``bench/scripts/fp8mma`` on the CPU: its word layout and
byte-permute decode (emulated bit for bit) against the e2m1 and e8m0 definitions, its activation
split, and its kernel compiled for sm_90 (its fp8 MMAs take the decoded weights from registers, no
spills in its K loop, three programs' shared memory within an SM's). With Triton 3.6 (the GPU
machines') the kernel has no stack; Triton 3.9's ptxas keeps 16 bytes of it, loaded once a tile."""
from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

from flatep.bench.sass import innermost_mma_loop
from flatep.kernels import fp8_wgmma
from flatep.kernels.backend import interpreting
from flatep.quant.mxfp4 import E2M1_VALUES
from tests.helpers import sm90_build, write_compiled

PROTOTYPE = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "fp8mma"


@pytest.fixture
def fp8mma(monkeypatch):
    monkeypatch.syspath_prepend(str(PROTOTYPE))
    return importlib.import_module("mxfp4_fp8mma")


def _prmt(low: int, high: int, selector: int) -> int:
    """PTX ``prmt.b32 d, low, high, selector`` (default mode): output byte ``i`` is byte ``selector``
    nibble ``i`` of ``{high, low}``; a nibble with bit 3 set would replicate a sign instead."""
    table = [(low >> 8 * i) & 0xFF for i in range(4)] + [(high >> 8 * i) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        nibble = (selector >> 4 * i) & 0xF
        assert nibble < 8, "the decode must clear bit 3 of each selector nibble"
        out |= table[nibble] << 8 * i
    return out


def _decode(word: int, table0: int, table1: int) -> tuple[int, int]:
    """The prototype's DECODE_PTX on one word: the e4m3 bytes of columns ``4q + j`` and ``16 + 4q + j``."""
    magnitudes = word & 0x77777777
    first = _prmt(table0, table1, magnitudes & 0xFFFF) | (word & 0x80808080)
    second = _prmt(table0, table1, magnitudes >> 16) | ((word << 4) & 0x80808080)
    return first, second


def _decoded_values(fp8mma, codes: torch.Tensor, scale: int) -> torch.Tensor:
    """One row's e2m1 ``codes [K]`` with one scale byte for every block -> the decoded e4m3 values, fp32."""
    words = fp8mma.to_mma_words(codes[None])[0].tolist()
    table0 = (scale * fp8mma.STEP0 + fp8mma.TABLE0) & 0xFFFFFFFF
    table1 = (scale * fp8mma.STEP1 + fp8mma.TABLE1) & 0xFFFFFFFF
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    out = torch.empty(codes.shape[0])
    for index, word in enumerate(words):
        block, lane = divmod(index, 4)
        for half, register in enumerate(_decode(word & 0xFFFFFFFF, table0, table1)):
            for j in range(4):
                out[32 * block + 16 * half + 4 * lane + j] = e4m3[(register >> 8 * j) & 0xFF]
    return out


def test_every_code_decodes_exactly_at_every_scale_in_the_window(fp8mma):
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)[order]
    expected_codes = torch.tensor(E2M1_VALUES)[codes.long()]
    for scale in range(fp8mma.LOW, fp8mma.HIGH + 1):
        decoded = _decoded_values(fp8mma, codes, scale)
        torch.testing.assert_close(decoded, expected_codes * 2.0 ** (scale - fp8mma.CENTER), rtol=0, atol=0)
        assert torch.equal(torch.signbit(decoded), codes >= 8)  # -0 stays -0


@pytest.mark.parametrize("past", [-1, 1])
def test_the_window_is_tight(fp8mma, past):
    """One byte past either end of the window decodes some code wrongly: the kernel's flag is needed."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)
    scale = fp8mma.LOW - 1 if past < 0 else fp8mma.HIGH + 1
    decoded = _decoded_values(fp8mma, codes, scale)
    expected = torch.tensor(E2M1_VALUES)[codes.long()] * 2.0 ** (scale - fp8mma.CENTER)
    assert not torch.equal(decoded, expected)


def test_word_layout_places_each_code_once(fp8mma):
    codes = torch.randint(0, 16, (3, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    words = fp8mma.to_mma_words(codes)
    assert words.shape == (3, 12) and words.dtype == torch.int32
    for row in range(3):
        decoded = _decoded_values(fp8mma, codes[row], fp8mma.CENTER)
        torch.testing.assert_close(decoded, torch.tensor(E2M1_VALUES)[codes[row].long()], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp8mma.to_mma_words(codes[:, :48])


def test_split_rows_carries_bf16_rows(fp8mma):
    rows = torch.randn(6, 512, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rows[3] *= 2.0 ** -30
    hi_lo, factor = fp8mma.split_rows(rows)
    assert hi_lo.shape == (12, 512) and hi_lo.dtype == torch.float8_e4m3fn
    rebuilt = (hi_lo[:6].float() + hi_lo[6:].float()) * factor[:, None] * 2.0 ** (127 - fp8mma.CENTER)
    largest = rows.float().abs().amax(1, keepdim=True)
    # exact wherever lo is a normal e4m3; within e4m3's subnormal step of each row's largest elsewhere
    assert ((rebuilt - rows.float()).abs() <= largest * 2.0 ** -16).all()
    assert (rebuilt == rows.float()).float().mean() > 0.99


def _compile(block_m: int, block_k: int, stages: int, directory: str) -> None:
    sys.path.insert(0, str(PROTOTYPE))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    fp8mma = importlib.import_module("mxfp4_fp8mma")
    inner = 3584
    hi_lo = torch.empty(512, inner, dtype=torch.float8_e4m3fn)
    words = torch.empty(2, 512, inner // 8, dtype=torch.int32)
    scales = torch.empty(2, inner // 32, 512, dtype=torch.uint8)
    kernel = fp8mma._fp8mma_kernel
    descriptors = fp8mma.descriptors(hi_lo, words, scales, block_m, block_k)
    types = dict(zip(("a_desc", "w_desc", "s_desc"), map(mangle_type, descriptors)))
    types |= {"out_ptr": "*bf16", "offsets_ptr": "*i32", "redo_ptr": "*i32", "factor_ptr": "*fp32"}
    constants = {"K": inner, "GROUP_M": 8, "GROUPS": 128, "STAGES": stages, "PRODUCER_REGISTERS": 40,
                 "WL": fp8mma.words_layout(block_k), "SL": fp8mma.scales_layout(block_k), "CHECK": True,
                 "num_warps": fp8mma.NUM_WARPS}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    write_compiled(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": fp8mma.NUM_WARPS, "maxnreg": 80}), directory)


@pytest.mark.skipif(fp8_wgmma.gluon is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("block_m, block_k, stages", [(32, 128, 3), (16, 64, 6)])
def test_compiles_for_sm90_with_the_weights_in_registers(block_m, block_k, stages, tmp_path):
    shared, _, sass, usage = sm90_build(
        f"from tests.bench.test_fp8mma_prototype import _compile; _compile({block_m}, {block_k}, {stages}, "
        f"{str(tmp_path)!r})", tmp_path)
    assert 3 * (shared + 1024) <= 228 * 1024  # three programs an SM, 1 KiB of each reserved
    mmas = re.findall(rf"QGMMA\.64x{block_m}x32\.F32\.E4M3\.E4M3 R\d+, (\S+), gdesc", sass)
    assert len(mmas) >= 8 and all(operand.startswith("R") for operand in mmas)
    assert "LOCAL:0" in usage
    assert not [line for line in innermost_mma_loop(sass) if "STL" in line or "LDL" in line]  # no spills in the K loop


def test_the_stand_in_loads_as_an_against_arm():
    """``--against bench/scripts/fp8mma/quant_gemm_fp8mma.py`` loads with every GEMM ``experts_phase`` swaps."""
    from flatep.bench.experts_phase import PACKED_GEMMS, revision_gemms
    from flatep.kernels import quant_gemm

    gemms = revision_gemms(str(PROTOTYPE / "quant_gemm_fp8mma.py"))
    assert set(gemms) == set(PACKED_GEMMS)
    assert gemms["packed_launches"](64, 4, "mxfp4") == quant_gemm.packed_launches(64, 4, "mxfp4")


@pytest.mark.skipif(not interpreting(), reason="CPU tensors reach Triton only under TRITON_INTERPRET=1")
def test_the_stand_in_keeps_flateps_functions_off_cuda():
    """Off CUDA the stand-in's mxfp4 GEMM is FlatEP's, bit for bit."""
    from flatep.bench.experts_phase import revision_gemms
    from flatep.kernels import quant_gemm
    from flatep.quant import QuantizedTensor

    gemms = revision_gemms(str(PROTOTYPE / "quant_gemm_fp8mma.py"))
    generator = torch.Generator().manual_seed(3)
    weights = QuantizedTensor.quantize(torch.randn(2, 64, 64, generator=generator), "mxfp4").in_layout("words")
    rows = torch.randn(5, 64, generator=generator).to(torch.bfloat16)
    offsets = torch.tensor([2, 5], dtype=torch.int32)
    expected = quant_gemm.mxfp4_grouped_mm_triton(rows, weights.values, weights.scales, offsets)
    got = gemms["mxfp4_grouped_mm_triton"](rows, weights.values, weights.scales, offsets)
    assert torch.equal(got, expected)


def test_launch_names_the_operand_that_does_not_fit(fp8mma):
    rows, columns, inner = 4, 128, 256
    operands = dict(hi_lo=torch.zeros(2 * rows, inner, dtype=torch.float8_e4m3fn), factor=torch.ones(rows),
                    words=torch.zeros(2, columns, inner // 8, dtype=torch.int32),
                    scales=torch.full((2, inner // 32, columns), 123, dtype=torch.uint8),
                    out=torch.empty(rows, columns, dtype=torch.bfloat16),
                    offsets=torch.tensor([2, 4], dtype=torch.int32))
    for name, bad in (("hi_lo", operands["hi_lo"][:rows]), ("factor", operands["factor"].double()),
                      ("scales", operands["scales"].transpose(1, 2)), ("out", operands["out"].float()),
                      ("offsets", operands["offsets"].long()), ("words", operands["words"].view(torch.float32))):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            fp8mma.launch(**{**operands, name: bad})
    with pytest.raises(ValueError, match="block_m must be 16, 32 or 64"):
        fp8mma.launch(**operands, block_m=128)
    with pytest.raises(ValueError, match="multiple of block_k"):
        fp8mma.launch(**{**operands, "hi_lo": operands["hi_lo"][:, :192].contiguous(),
                         "words": operands["words"][..., :24].contiguous(),
                         "scales": operands["scales"][:, :6].contiguous()})
