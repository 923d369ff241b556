"""Grouped GEMMs over packed weights: the Triton kernels (interpreter on CPU) against the torch path,
and the torch path against its definition."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from flatep.experts.grouped import quantized_grouped_mm
from flatep.kernels import fp8_activations, fp8_wgmma
from flatep.kernels.backend import interpreting, resident_programs
from flatep.kernels.e2m1_ptx import scaled_pairs_ptx
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.grouped_tiles import locate_tile, persistent_grid, tile_table
from flatep.kernels.mxfp4_decode import _INF_PAIR, _ONE_MULTIPLY_BIAS, _ONE_MULTIPLY_PTX, _SCALE_PAIR, _SCALED_PAIRS_PTX
from flatep.kernels.packed_tiles import HOT_ROWS, GemmConfig, default_config, packed_launches
from flatep.kernels.quant_gemm import _mxfp4_descriptors, fp8_grouped_mm_triton, mxfp4_grouped_mm_triton
from flatep.quant import (
    E2M1_VALUES,
    QuantizedTensor,
    dequantize_fp8_activations,
    pool_layout,
    quantize_fp8_activations,
    to_word_layout,
)
from flatep.quant.fp8 import E4M3_RECIPROCAL
from tests.helpers import DEVICE, relative_error, second_pass_flags

triton_available = DEVICE.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not triton_available, reason="needs CUDA or TRITON_INTERPRET=1")


def grouped_inputs(format, sizes, out_features, in_features, seed, padding=3):
    """Rows ``[sum(sizes) + padding, K]`` bf16 (the padding rows poisoned), weights ``[G, N, K]``, offsets."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(sum(sizes) + padding, in_features, generator=generator)
    rows[sum(sizes):] = float("nan")  # past offsets[-1]: must never be read into a real row
    weight = torch.randn(len(sizes), out_features, in_features, generator=generator) * in_features**-0.5
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    packed = QuantizedTensor.quantize(weight, format).in_layout(pool_layout(format))  # as pools hold them
    return rows.bfloat16().to(DEVICE), packed.to(DEVICE), offsets.to(DEVICE)


def per_group_reference(rows, packed, offsets):
    """One fp32 matmul per group over the dequantized weights (and fp8-quantized rows)."""
    activations = rows.float()
    if packed.format == "fp8":
        activations = dequantize_fp8_activations(*quantize_fp8_activations(rows))
    weights = packed.dequantize()
    out = torch.full((rows.shape[0], weights.shape[1]), float("nan"), device=rows.device)
    start = 0
    for group, end in enumerate(offsets.tolist()):
        out[start:end] = activations[start:end] @ weights[group].T
        start = end
    return out


@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_torch_path_is_the_per_group_definition(format):
    rows, packed, offsets = grouped_inputs(format, [5, 0, 9, 2], 256, 256, seed=1)
    out = quantized_grouped_mm(rows, packed, offsets, backend="torch")
    end = int(offsets[-1])
    reference = per_group_reference(rows, packed, offsets)
    assert out.dtype == torch.bfloat16
    assert relative_error(out[:end], reference[:end]) < 4e-3  # one bf16 rounding of the fp32 result


CASES = [
    # (group sizes, N, K, config): empty groups, groups straddling tiles, partial N tiles.
    ([5, 0, 19, 2], 256, 256, GemmConfig(block_m=16, block_n=64)),
    ([1, 33, 0, 0], 192, 128, GemmConfig(block_m=32, block_n=128)),
    ([0, 0, 7], 128, 384, None),
    ([5, 0, 19, 2], 256, 256, GemmConfig(block_m=16, block_n=128, swap_ab=True)),
    # Four column tiles per weight scale block, the last block partial (N = 160).
    ([4, 11, 0, 6], 160, 256, GemmConfig(block_m=16, block_n=32, swap_ab=True)),
    # The accumulator rescaled per K step, both orientations.
    ([5, 0, 19, 2], 256, 384, GemmConfig(block_m=16, block_n=64, rescale=True)),
    ([4, 11, 0, 6], 160, 384, GemmConfig(block_m=16, block_n=32, swap_ab=True, rescale=True)),
]


@needs_triton
@pytest.mark.parametrize("sizes, out_features, in_features, config", CASES)
def test_fp8_triton_matches_torch(sizes, out_features, in_features, config):
    rows, packed, offsets = grouped_inputs("fp8", sizes, out_features, in_features, seed=len(sizes) + out_features)
    out = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    end = int(offsets[-1])
    reference = quantized_grouped_mm(rows, packed, offsets, backend="torch")
    # Same quantized operands; only the order of the fp32 sums and the final bf16 rounding differ.
    assert relative_error(out[:end], reference[:end]) < 4e-3


@needs_triton
@pytest.mark.parametrize("sizes, out_features, in_features, config", [
    ([5, 0, 19, 2], 256, 96, GemmConfig(block_m=16, block_n=64, block_k=64)),
    ([1, 33, 0, 0], 48, 64, GemmConfig(block_m=32, block_n=32, block_k=32)),
    ([0, 0, 7], 64, 160, None),
    ([5, 0, 19, 2], 96, 96, GemmConfig(block_m=16, block_n=32, block_k=64, swap_ab=True)),
    ([5, 0, 19, 2], 256, 160, GemmConfig(block_m=16, block_n=64, block_k=64, lane_words=True)),
    ([3, 21, 0, 9], 64, 288, GemmConfig(block_m=32, block_n=32, block_k=128, lane_words=True)),
])
def test_mxfp4_triton_matches_torch(sizes, out_features, in_features, config):
    rows, packed, offsets = grouped_inputs("mxfp4", sizes, out_features, in_features, seed=len(sizes) + out_features)
    out = mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    end = int(offsets[-1])
    reference = quantized_grouped_mm(rows, packed, offsets, backend="torch")
    assert relative_error(out[:end], reference[:end]) < 4e-3


@pytest.mark.skipif(DEVICE.type != "cuda", reason="register limits are a ptxas option: only a GPU compiles under one")
@pytest.mark.parametrize("format, config", [
    ("mxfp4", GemmConfig(16, 128, 128, num_warps=2, programs_per_sm=6, lane_words=True)),
    ("mxfp4", GemmConfig(32, 256, 128, num_warps=4, lane_words=True)),
    ("fp8", GemmConfig(64, 128, 128, num_warps=4)),
])
@pytest.mark.parametrize("registers", [128, 168])
def test_a_register_limited_tile_writes_the_unlimited_tiles_bits(format, config, registers):
    """A register limit changes where ptxas keeps values (spilling some), never the arithmetic: the
    same tile under ``maxnreg`` writes the same bits."""
    rows, packed, offsets = grouped_inputs(format, [40, 0, 17, 70], 512, 1024, seed=registers)
    kernel = mxfp4_grouped_mm_triton if format == "mxfp4" else fp8_grouped_mm_triton
    unlimited, limited = (torch.full((rows.shape[0], 512), float("nan"), dtype=torch.bfloat16, device=DEVICE)
                          for _ in range(2))  # poisoned: an unwritten row stays NaN
    kernel(rows, packed.values, packed.scales, offsets, config, out=unlimited)
    kernel(rows, packed.values, packed.scales, offsets, dataclasses.replace(config, max_registers=registers), out=limited)
    end = int(offsets[-1])
    assert torch.isfinite(unlimited[:end].float()).all()
    assert torch.equal(limited[:end].view(torch.int16), unlimited[:end].view(torch.int16))


@pytest.mark.parametrize("make, message", [
    (lambda r, p, o: fp8_grouped_mm_triton(r.float(), p.values, p.scales, o), "bfloat16"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales[..., :1], o), "scales must be"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o.long()), "int32"),
    (lambda r, p, o: fp8_grouped_mm_triton(r[:, :128], p.values, p.scales, o), "K=128"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(16, 16, 64)), "block_k"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(16, 256, 128)), "block_n must divide"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(16, 96, 128)), "block_n must divide"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(16, 64, 128, lane_words=True)),
     "lane_words is an mxfp4"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(64, 128, num_warps=4, wgmma=True)),
     "wgmma config takes block_m"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, GemmConfig(128, 128, num_warps=8, num_stages=4,
                                                                                wgmma=True)), "must be 5 or 6"),
    (lambda r, p, o: quantized_grouped_mm(r[:, :128], p, o), "agree on K"),
    (lambda r, p, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, out=torch.empty_like(r)), "out must be"),
])
def test_bad_input_raises(make, message):
    rows, packed, offsets = grouped_inputs("fp8", [3, 4], 128, 256, seed=2)
    with pytest.raises(ValueError, match=message):
        make(rows, packed, offsets)


@pytest.mark.parametrize("variable, attribute, unset", [("FLATEP_MXFP4_WGMMA", "MXFP4_WGMMA_DEFAULT", False),
                                                         ("FLATEP_MXFP4_SWAP", "MXFP4_SWAP_DEFAULT", True),
                                                         ("FLATEP_MXFP4_SWAP64", "MXFP4_SWAP64_DEFAULT", False)])
@pytest.mark.parametrize("setting", [None, "0", "1", "yes"])
def test_the_environment_turns_a_gluon_mxfp4_default_on_or_off(variable, attribute, unset, setting):
    """``variable=1`` at import makes ``attribute`` true, ``variable=0`` false, and without ``variable``
    it is ``unset``; any other value raises, naming the variable (a process of its own, as users run it)."""
    environment = {name: value for name, value in os.environ.items() if name != variable}
    if setting is not None:
        environment[variable] = setting
    run = subprocess.run([sys.executable, "-c", f"from flatep.kernels import packed_tiles; "
                          f"print(packed_tiles.{attribute})"], env=environment, capture_output=True, text=True,
                         timeout=120)
    if setting == "yes":
        assert run.returncode != 0 and f"ValueError: {variable} must be 0 or 1" in run.stderr
    else:
        assert run.returncode == 0, run.stderr
        assert run.stdout.strip() == str(unset if setting is None else setting == "1")


@pytest.mark.skipif(fp8_wgmma.available(DEVICE), reason="the kernel runs here")
def test_wgmma_config_off_hopper_raises():
    assert not default_config(4 * 1024, 4, "fp8", DEVICE).wgmma  # the default takes the Triton tiles here
    assert not default_config(4 * 64, 4, "mxfp4", DEVICE).wgmma
    rows, packed, offsets = grouped_inputs("fp8", [3, 4], 128, 640, seed=3)
    config = GemmConfig(128, 128, num_warps=8, num_stages=5, programs_per_sm=1, wgmma=True)
    with pytest.raises(ValueError, match="needs a Hopper"):
        fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    rows, packed, offsets = grouped_inputs("mxfp4", [3, 4], 256, 640, seed=3)
    config = GemmConfig(64, 256, 64, num_warps=4, num_stages=4, programs_per_sm=1, wgmma=True)
    with pytest.raises(ValueError, match="needs a Hopper"):
        mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)


@pytest.mark.parametrize("config, message", [
    (GemmConfig(16, 16, 96), "power of two"),
    (GemmConfig(64, 32, 64, lane_words=True), "lane_words needs a tile whose weights are a register operand"),
    (GemmConfig(16, 32, 32, lane_words=True), "block_k of 64 or more"),
    (GemmConfig(128, 128, 128, num_warps=8, wgmma=True),
     "an mxfp4 wgmma config takes block_m in \\(64,\\) and block_n, block_k"),
    (GemmConfig(64, 256, 64, num_warps=4, num_stages=8, programs_per_sm=1, wgmma=True), "num_stages"),
])
def test_mxfp4_bad_tiles_raise(config, message):
    rows, packed, offsets = grouped_inputs("mxfp4", [3, 4], 32, 192, seed=4)
    with pytest.raises(ValueError, match=message):
        mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)


@pytest.mark.parametrize("registers", [0, 15, 256, 168.0, True, "168"])
def test_a_register_limit_outside_what_ptxas_takes_is_refused(registers):
    with pytest.raises(ValueError, match=r"max_registers must be None or an int in \[16, 255\]"):
        GemmConfig(32, 256, 128, max_registers=registers)


def test_a_register_limit_is_refused_for_the_gluon_kernel():
    with pytest.raises(ValueError, match="max_registers is a Triton tile option"):
        GemmConfig(128, 128, 128, num_warps=8, programs_per_sm=1, wgmma=True, max_registers=168)


def test_a_register_limit_names_itself_in_the_label():
    assert GemmConfig(32, 256, 128, max_registers=168).label == "m32 n256 k128 w4 s3 g8 p2 r168"
    assert GemmConfig(32, 256, 128).label == "m32 n256 k128 w4 s3 g8 p2"


@needs_triton
@pytest.mark.parametrize("config, in_features", [
    (GemmConfig(16, 32, 64), 96), (GemmConfig(16, 32, 32, swap_ab=True), 96), (None, 96),
    # the lane word order at 2, 4 and 8 scale blocks a K step, partial last steps included
    (GemmConfig(16, 32, 64, swap_ab=True, lane_words=True), 96), (GemmConfig(16, 32, 64, lane_words=True), 96),
    (GemmConfig(16, 32, 128, lane_words=True), 288), (GemmConfig(16, 32, 256, lane_words=True), 288),
])
def test_mxfp4_kernel_decodes_every_code_at_any_scale_exactly(config, in_features):
    """One-hot rows read the decoded weights back one by one: every nibble (all 16 codes, both
    nibbles of a byte, every position in a word) under scale bytes from 3 to 200 (values from
    2**-125 to 6 * 2**73, all normal in bf16) must come out exactly, in every column order and
    word order (a word paired with another's scale block would show)."""
    generator = torch.Generator().manual_seed(11)
    out_features = 32  # 96 and 288 input columns: partial last K steps
    values = torch.randint(0, 256, (1, out_features, in_features // 2), generator=generator, dtype=torch.uint8)
    choices = torch.tensor([3, 60, 120, 126, 127, 128, 129, 140, 200], dtype=torch.uint8)
    scales = choices[torch.randint(0, len(choices), (1, out_features, in_features // 32), generator=generator)]
    packed = QuantizedTensor("mxfp4", values, scales, "words").to(DEVICE)
    rows = torch.eye(in_features).bfloat16().to(DEVICE)
    offsets = torch.tensor([in_features], dtype=torch.int32, device=DEVICE)
    out = mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    assert torch.equal(out.float(), packed.dequantize()[0].T)


@needs_triton
@pytest.mark.parametrize("config", [GemmConfig(16, 32, 64, lane_words=True), GemmConfig(64, 32, 64),
                                    GemmConfig(16, 32, 64, swap_ab=True)])
@pytest.mark.parametrize("byte, flagged", [(128, False), (129, True)])
def test_mxfp4_second_pass_follows_the_scale_bytes_not_the_rows(config, byte, flagged, monkeypatch):
    """Rows holding NaN inside groups (the padding rows dispatch leaves unwritten) do not send the
    launch through the two-multiply pass: only their own outputs are NaN, and the other rows equal
    the same launch over clean rows, bit for bit. A scale byte of 128 (the last the one-multiply
    decode gets right) leaves the flag clear, one of 129 sets it, in the partial last K step;
    either way the result is the dequantized weights'."""
    sizes, out_features, in_features = [5, 70, 3], 64, 96
    rows, packed, offsets = grouped_inputs("mxfp4", sizes, out_features, in_features, seed=17)
    padding = torch.zeros(rows.shape[0], dtype=torch.bool, device=DEVICE)
    padding[[1, 4, 5 + 66, 5 + 69, 75]] = True  # the 64-row tile's second row tile holds 6 rows, 2 NaN
    clean = mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    flags = second_pass_flags(monkeypatch)
    poisoned = rows.clone()
    poisoned[padding] = float("nan")
    out = mxfp4_grouped_mm_triton(poisoned, packed.values, packed.scales, offsets, config)
    assert [int(flag) for flag in flags] == [0]
    end = sum(sizes)
    assert out[:end][padding[:end]].isnan().all()
    assert torch.equal(out[:end][~padding[:end]], clean[:end][~padding[:end]])
    flags.clear()
    packed.scales[1, 7, 2] = byte  # block 2 of 3: the last K step's
    out = mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config)
    assert [int(flag) for flag in flags] == [int(flagged)]
    assert relative_error(out[:end], per_group_reference(rows, packed, offsets)[:end]) < 4e-3


def run_decode_ptx(ptx: str, word: int, scale_pair: int) -> list[int]:
    """The GPU decode's PTX (``_SCALED_PAIRS_PTX`` or ``_ONE_MULTIPLY_PTX``) run instruction by
    instruction on one word: its integer ops on 32-bit registers, its bf16x2 FMAs in fp32 rounded
    to bf16 (exact here: the factors are powers of two and the addend -0). Returns the four output
    registers."""
    registers = {"$4": word, "$5": scale_pair}

    def value(operand):
        return registers[operand] if operand in registers else int(operand, 0) & 0xFFFFFFFF

    def halves(bits):
        return [torch.tensor([(bits >> shift & 0xFFFF) << 16]).to(torch.int32).view(torch.float32).item()
                for shift in (0, 16)]

    def bf16_bits(number):
        return torch.tensor([number], dtype=torch.float32).bfloat16().view(torch.int16).item() & 0xFFFF

    for line in lines_of(ptx):
        opcode, operands = line.split(None, 1)
        destination, *sources = [operand.strip() for operand in operands.rstrip(";").split(",")]
        inputs = [value(operand) for operand in sources]
        if opcode == "mov.b32":
            result = inputs[0]
        elif opcode == "and.b32":
            result = inputs[0] & inputs[1]
        elif opcode == "or.b32":
            result = inputs[0] | inputs[1]
        elif opcode == "shl.b32":
            result = inputs[0] << inputs[1]
        elif opcode == "shf.l.wrap.b32":
            assert inputs[0] == inputs[1]  # a rotation
            result = inputs[0] << inputs[2] | inputs[0] >> (32 - inputs[2])
        elif opcode == "prmt.b32":  # bytes of the pair (b, a) picked by the selector's nibbles, low first
            pool = inputs[0] | inputs[1] << 32
            result = sum(((pool >> 8 * (inputs[2] >> 4 * i & 0x7)) & 0xFF) << 8 * i for i in range(4))
        elif opcode == "fma.rn.bf16x2":
            products = [x * y + z for x, y, z in zip(*(halves(bits) for bits in inputs))]
            result = bf16_bits(products[0]) | bf16_bits(products[1]) << 16
        else:
            raise AssertionError(f"unexpected PTX {line!r}")
        registers[destination] = result & 0xFFFFFFFF
    return [registers[f"${pair}"] for pair in range(4)]


def test_gpu_decode_ptx_in_column_order_is_the_pairs_rearranged():
    """The Gluon kernel's decode PTX (``natural``): output ``q`` holds the word's columns ``2q`` and
    ``2q + 1`` (low half first), the same weights as the pair order's outputs."""
    generator = torch.Generator().manual_seed(11)
    words = torch.randint(0, 2**32, (64,), generator=generator, dtype=torch.int64).tolist()
    for one_multiply, pair_of in ((False, lambda scale: scale * _SCALE_PAIR.value), (True, one_multiply_pair)):
        for word, scale in zip(words, (1, 100, 127, 128) * 16):
            pairs = run_decode_ptx(scaled_pairs_ptx(one_multiply), word, pair_of(scale))
            natural = run_decode_ptx(scaled_pairs_ptx(one_multiply, natural=True), word, pair_of(scale))
            columns = [(pairs[column % 4] >> 16 * (column // 4)) & 0xFFFF for column in range(8)]
            assert natural == [columns[2 * q] | columns[2 * q + 1] << 16 for q in range(4)]


def lines_of(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if line.strip() and line.strip() not in "{}" and not line.strip().startswith(".reg")]


def one_multiply_pair(scale: int) -> int:
    """The one-multiply decode's factor pair, as the kernel forms it: ``2**(scale - 1)`` in bf16,
    capped at +inf."""
    return min(scale * _SCALE_PAIR.value + _ONE_MULTIPLY_BIAS.value * _SCALE_PAIR.value, _INF_PAIR.value)


@pytest.mark.parametrize("ptx, pair_of, scale", [
    *[(_SCALED_PAIRS_PTX.value, lambda scale: scale * _SCALE_PAIR.value, scale) for scale in (1, 100, 127, 130, 200)],
    *[(_ONE_MULTIPLY_PTX.value, one_multiply_pair, scale) for scale in (0, 1, 100, 127, 128)],
])
def test_gpu_decode_ptx_yields_each_pair_of_the_word_layout(ptx, pair_of, scale):
    """The inline PTX (which only a GPU runs) against the layout's definition, on the CPU: pair ``p``
    of a word is columns ``p`` (low half) and ``p + 4`` (high half), decoded and scaled exactly
    (the one-multiply decode up to scale byte 128, byte 0's values as bf16 subnormals)."""
    generator = torch.Generator().manual_seed(scale)
    nibbles = torch.randint(0, 16, (64, 8), generator=generator, dtype=torch.uint8)
    nibbles[:16, 0] = nibbles[16:32, 3] = nibbles[32:48, 5] = nibbles[48:, 7] = torch.arange(16, dtype=torch.uint8)
    words = to_word_layout(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(torch.int32).squeeze(1)
    for word, codes in zip(words.tolist(), nibbles.tolist()):
        pairs = run_decode_ptx(ptx, word & 0xFFFFFFFF, pair_of(scale))
        got = [((pairs[column % 4] >> 16 * (column // 4)) & 0xFFFF) << 16 for column in range(8)]
        got = torch.tensor(got, dtype=torch.int64).to(torch.int32).view(torch.float32)
        expected = torch.tensor([E2M1_VALUES[code] for code in codes]) * 2.0 ** (scale - 127)
        assert torch.equal(got, expected) and torch.equal(torch.signbit(got), torch.signbit(expected))


@pytest.mark.parametrize("scale", [129, 130, 200, 254])
def test_gpu_one_multiply_decode_is_not_finite_past_scale_byte_128(scale):
    """Past byte 128 the one-multiply factor is capped at +inf: every weight of the block decodes
    to +-inf (NaN for the zero codes), which flags the tile for the two-multiply pass."""
    word = to_word_layout(torch.arange(16, dtype=torch.uint8).reshape(2, 8)[:, 0::2]
                          | (torch.arange(16, dtype=torch.uint8).reshape(2, 8)[:, 1::2] << 4))
    for packed in word.view(torch.int32).flatten().tolist():
        pairs = run_decode_ptx(_ONE_MULTIPLY_PTX.value, packed & 0xFFFFFFFF, one_multiply_pair(scale))
        got = torch.tensor([((pairs[column % 4] >> 16 * (column // 4)) & 0xFFFF) << 16 for column in range(8)],
                           dtype=torch.int64).to(torch.int32).view(torch.float32)
        assert not bool(torch.isfinite(got).any())


@needs_triton
def test_fp8_activation_quantization_kernel_equals_torch():
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(12, 256, generator=generator) * torch.logspace(-4, 1, 256)).bfloat16().to(DEVICE)
    x[5] = 0
    end = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    values, scales = quantize_fp8_activations_triton(x, end)
    expected_values, expected_scales = quantize_fp8_activations(x[:10])
    assert torch.equal(scales[:10], expected_scales)
    assert torch.equal(values[:10].float(), expected_values.float())


@needs_triton
def test_fp8_activation_quantization_of_negligible_values_equals_torch():
    """Values whose quotient by their group's scale lies around 2**-11 .. 2**-9 (e4m3's smallest
    step is 2**-9), zeros of both signs, and groups of values far below the scale's floor (1e-30):
    bit for bit as torch."""
    generator = torch.Generator().manual_seed(11)
    magnitudes = 2.0 ** (torch.rand(16, 256, generator=generator) * 20 - 24)  # 2**-24 .. 2**-4 of the amax
    signs = torch.where(torch.rand(16, 256, generator=generator) < 0.5, -1.0, 1.0)
    x = signs * magnitudes * 448  # the amax column makes the scale 1: quotients 448 * 2**-24 .. 448 * 2**-4
    x[:, ::128] = 448.0
    x[:8] /= 448 * 2**12  # quotients around 2**-11 .. 2**-9 for the first rows' groups
    x[3, 7:60] = 0.0
    x[4, 7:60] = -0.0
    x[12] *= 1e-30  # a group far below the 1e-10 amax floor: every quotient negligible
    x = x.bfloat16().to(DEVICE)
    end = torch.tensor([16], dtype=torch.int32, device=DEVICE)
    values, scales = quantize_fp8_activations_triton(x, end)
    expected_values, expected_scales = quantize_fp8_activations(x)
    assert torch.equal(scales, expected_scales)
    assert torch.equal(values.float(), expected_values.float())
    if DEVICE.type == "cuda":  # the interpreter's rounding drops the sign of a zero; the GPU's cast keeps it
        assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert 0 < int((expected_values.float() == 0).sum()) < values.numel()  # negligible values and others both


def bf16_amax_and_values(amax_bits: torch.Tensor, binades: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Each positive bf16 ``amax`` (``amax_bits [A]`` int16 bit patterns) with every bf16 value ``x``
    from ``amax * 2**-binades`` to ``amax`` (below that, a quotient by the scale is under
    448 * 2**-24, far below e4m3's smallest step): ``(amax [A] fp32, x [A, 128 * binades + 1] fp32)``."""
    below = torch.arange(128 * binades + 1, dtype=torch.int32)  # bf16 has 7 mantissa bits: 128 values a binade
    x_bits = (amax_bits.to(torch.int32)[:, None] - below[None, :]).clamp_min(1)  # positive bf16 bits are monotone
    to_float = lambda bits: bits.to(torch.int16).view(torch.bfloat16).float()  # noqa: E731
    return to_float(amax_bits), to_float(x_bits)


def test_fp8_quantization_by_reciprocal_equals_the_division_for_every_bf16_value():
    """The GPU kernel's quotient (``e4m3_rows`` for bf16 rows): ``e = x * RN(1 / scale)``, then
    ``e + (x - scale * e) * RN(1 / scale)`` with the remainder exact (an fma), rounds to the same
    e4m3 value as ``x / scale`` for every positive bf16 amax of these binades (all 128 mantissas:
    subnormal, around the scale's 1e-10 floor, 1, the largest) and every bf16 x up to 24 binades
    below it; by symmetry for negative values too. The fmas are emulated in float64: the remainder
    is exact there, and the sum rounds twice only if float64 lands on an fp32 midpoint (asserted
    not to happen). The GPU test of the kernel itself runs every bf16 amax."""
    exponents = torch.tensor([-133, -34, -33, -32, 0, 127])  # 2**-133 subnormal; 1e-10 ~ 2**-33.2
    amax_bits = ((exponents[:, None] + 127) * 128 + torch.arange(128)[None, :]).clamp(1, 0x7F7F).reshape(-1)
    amax, x = bf16_amax_and_values(amax_bits.to(torch.int16))
    scale = (amax.clamp_min(1e-10) * E4M3_RECIPROCAL)[:, None]
    reciprocal = 1.0 / scale
    estimate = x * reciprocal
    remainder = (x.double() - scale.double() * estimate.double()).float()  # exact, then rounded once
    corrected = estimate.double() + remainder.double() * reciprocal.double()
    assert not bool(((corrected.view(torch.int64) & (2**29 - 1)) == 2**28).any())  # no fp32 midpoint in float64
    to_e4m3 = lambda q: q.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    expected = to_e4m3(x / scale)
    assert not torch.equal(to_e4m3(estimate), expected)  # the product alone is off in some cases
    assert torch.equal(to_e4m3(corrected.float()), expected)


@triton.jit
def _fma_kernel(out_ptr, a, b, c):
    tl.store(out_ptr, tl.fma(a, b, c))


@triton.jit
def _quotients_kernel(x_ptr, quotient_ptr, scale_ptr, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """``e4m3_rows``' reciprocal branch on bf16 ``x [ROWS, GROUP]``: its fp32 quotients (clamped,
    not yet rounded to e4m3) and scales."""
    row, column = tl.arange(0, ROWS), tl.arange(0, GROUP)
    x = tl.load(x_ptr + row[:, None] * GROUP + column[None, :]).to(tl.float32)
    quotient, scale = fp8_activations.e4m3_rows(x, True, False)
    tl.store(quotient_ptr + row[:, None] * GROUP + column[None, :], quotient)
    tl.store(scale_ptr + row, scale)


@needs_triton
def test_fp8_quantization_by_reciprocal_gives_the_correctly_rounded_quotients():
    """The reciprocal branch's Triton code (the GPU's path; the interpreter otherwise divides),
    run where ``tl.fma`` rounds once: the fp32 quotients are ``x / scale``'s, bit for bit, over
    values from about 2**-40 of their row's amax to the amax, zeros of both signs, a row below the scale's
    1e-10 floor, and rows holding +-inf (finite values give zeros of their sign, inf gives NaN)."""
    out = torch.empty(1, device=DEVICE)
    _fma_kernel[(1,)](out, 1 + 2**-12, 1 + 2**-12, -(1 + 2**-11))
    if float(out) != 2**-24:
        pytest.skip("this Triton's interpreter rounds tl.fma twice (a product, then a sum)")
    generator = torch.Generator().manual_seed(23)
    x = 2.0 ** (torch.rand(16, 128, generator=generator) * 40 - 30) * torch.randn(16, 128, generator=generator).sign()
    x[3, ::3], x[4, ::3] = 0.0, -0.0
    x[5] *= 1e-25  # amax below 1e-10: the floor is the scale
    x[6, 9], x[7, 10] = float("inf"), -float("inf")
    x = x.bfloat16().to(DEVICE)
    quotients, scales = torch.empty(16, 128, device=DEVICE), torch.empty(16, device=DEVICE)
    _quotients_kernel[(1,)](x, quotients, scales, ROWS=16, GROUP=128)
    want_scales = x.float().abs().amax(dim=1).clamp_min(1e-10) * E4M3_RECIPROCAL
    want = (x.float() / want_scales[:, None]).clamp(-448, 448)
    assert torch.equal(scales, want_scales)
    nan = want.isnan()
    assert int(nan.sum()) == 2 and torch.equal(quotients.isnan(), nan)
    assert torch.equal(quotients.view(torch.int32)[~nan], want.view(torch.int32)[~nan])  # zeros' signs included


@pytest.mark.skipif(DEVICE.type != "cuda", reason="every bf16 amax: too large for the interpreter")
def test_fp8_activation_quantization_of_every_bf16_value_equals_torch():
    """The kernel over every positive finite bf16 amax, each with every bf16 value up to 24 binades
    below it (signs alternating) in groups of 128 led by the amax; rows holding +-inf (whose finite
    values quantize to zeros of their sign) and zeros of both signs: bit for bit as torch."""
    amax, x = bf16_amax_and_values(torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16))
    width = 127  # values a group besides its amax
    per_amax = -(-x.shape[1] // width)
    x = torch.nn.functional.pad(x, (0, per_amax * width - x.shape[1]))  # zeros: a group's padding
    x = x * torch.where(torch.arange(x.shape[1]) % 2 == 0, 1.0, -1.0)
    leaders = amax.repeat_interleave(per_amax)[:, None]
    rows = torch.cat([leaders, x.reshape(-1, width)], dim=1)  # [groups, 128]: one group a row
    rows[:3, 5] = torch.tensor([float("inf"), -float("inf"), 0.0])
    rows[2, 6:100] = -0.0
    rows = rows.bfloat16().to(DEVICE)
    end = torch.tensor([rows.shape[0]], dtype=torch.int32, device=DEVICE)
    got_values, got_scales = quantize_fp8_activations_triton(rows, end)
    want_values, want_scales = quantize_fp8_activations(rows)
    assert torch.equal(got_scales, want_scales)
    nan = want_values.float().isnan()  # inf / inf: NaN, whose sign bit may differ
    assert int(nan.sum()) == 2 and torch.equal(got_values.float().isnan(), nan)
    assert torch.equal(got_values.view(torch.uint8)[~nan], want_values.view(torch.uint8)[~nan])


@needs_triton
@pytest.mark.parametrize("programs", [1, 2, 3])
@pytest.mark.parametrize("skip", [None, (9, 40)])
def test_fp8_activation_quantization_strides_over_the_row_blocks_before_the_end(programs, skip):
    """Fewer programs than row blocks (as on a GPU, where a worst-case-sized shard has far more
    blocks than programs): each program walks every P-th block up to end[0], every real row is
    quantized, and rows past the end, or skipped (the rows between a shard's home and slot
    rows), are left as they were (poisoned)."""
    from flatep.kernels.fp8_activations import act_quant_kernel

    generator = torch.Generator().manual_seed(programs)
    x = (torch.randn(100, 256, generator=generator) * 3).bfloat16().to(DEVICE)
    end = torch.tensor([71], dtype=torch.int32, device=DEVICE)
    values = torch.full((100, 256), 0x7F, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    scales = torch.full((100, 2), -1.0, device=DEVICE)
    start, stop = (None, 0) if skip is None else (torch.tensor([skip[0]], dtype=torch.int32, device=DEVICE), skip[1])
    act_quant_kernel[(programs, 2)](x, values, scales, end, start, 100, stop, x.stride(0), 256, 2, 256, BLOCK_M=16,
                                     GROUP=128, ROUND_FIRST=interpreting())
    computed = torch.zeros(100, dtype=torch.bool, device=DEVICE)
    computed[:71] = True
    if skip is not None:
        computed[skip[0]:skip[1]] = False
    expected_values, expected_scales = quantize_fp8_activations(x[computed])
    assert torch.equal(scales[computed], expected_scales)
    assert torch.equal(values[computed].view(torch.uint8), expected_values.view(torch.uint8))
    assert bool((values[~computed].view(torch.uint8) == 0x7F).all()) and bool((scales[~computed] == -1.0).all())


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_many_groups_with_empty_ones(format):
    sizes = torch.randint(0, 40, (37,), generator=torch.Generator().manual_seed(11))
    sizes[::5] = 0
    in_features = 128
    rows, packed, offsets = grouped_inputs(format, sizes.tolist(), 32, in_features, seed=12)
    kernel = fp8_grouped_mm_triton if format == "fp8" else mxfp4_grouped_mm_triton
    out = kernel(rows, packed.values, packed.scales, offsets, GemmConfig(16, 32, 128 if format == "fp8" else 64))
    end = int(offsets[-1])
    assert relative_error(out[:end], quantized_grouped_mm(rows, packed, offsets, backend="torch")[:end]) < 4e-3


@triton.jit
def store_tile(out_ptr, tile, group, first, last, first_column):
    """Write where tile ``tile`` lies: ``out[tile] = (group, first row, end row, first column)``."""
    tl.store(out_ptr + 4 * tile, group)
    tl.store(out_ptr + 4 * tile + 1, first)
    tl.store(out_ptr + 4 * tile + 2, last)
    tl.store(out_ptr + 4 * tile + 3, first_column)


@triton.jit
def _tile_order_kernel(offsets_ptr, out_ptr, total_ptr, groups, split, split_start, N, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr):
    """The grouped GEMM kernels' loop: each program writes where each of its tiles lies."""
    starts, ends, tiles, passed, total = tile_table(offsets_ptr, groups, split, split_start, N, 0, 2**31 - 1, BLOCK_M, BLOCK_N,
                                                    GROUPS)
    tl.store(total_ptr + tl.program_id(0), total)
    tile = tl.program_id(0)
    while tile < total:
        group, first, last, first_column = locate_tile(tile, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N, GROUP_M, GROUPS)
        store_tile(out_ptr, tile, group, first, last, first_column)
        tile += tl.num_programs(0)


def expected_tile_order(sizes, columns, config, split=None, split_start=0):
    """``(group, first row, end row, first column)`` of each tile, in tile order:
    group by group, bands of ``group_m`` row tiles, all column blocks per band, row tiles fastest;
    group ``split`` starts at row ``split_start``."""
    order, start = [], 0
    for group, size in enumerate(sizes):
        if group == split:
            start = split_start
        tiles = -(-size // config.block_m)
        for band in range(0, tiles, config.group_m):
            for column in range(0, columns, config.block_n):
                for tile in range(band, min(band + config.group_m, tiles)):
                    order.append((group, start + tile * config.block_m, start + size, column))
        start += size
    return order


@needs_triton
@pytest.mark.parametrize("sizes, columns, config", [
    ([40], 96, GemmConfig(16, 32, group_m=2)),  # one group, a shorter last band
    ([3, 0, 50, 1, 0, 17], 64, GemmConfig(16, 16, group_m=3)),  # ragged, empty groups inside
    ([0, 0, 0, 5], 48, GemmConfig(32, 16, group_m=1)),  # leading empty groups
    ([0, 0], 32, GemmConfig(16, 32)),  # nothing to do
    ([int(size) for size in torch.randint(0, 70, (29,), generator=torch.Generator().manual_seed(5))], 80,
     GemmConfig(32, 32, group_m=4)),  # many groups
])
def test_tiles_run_group_by_group_and_each_once_over_a_capped_grid(sizes, columns, config):
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    padding = 1000  # rows past offsets[-1] (a shard sized for more rows): they add no programs past the cap
    (programs,) = persistent_grid(sum(sizes) + padding, len(sizes), columns, config, DEVICE)
    bound = (sum(sizes) + padding + len(sizes) * (config.block_m - 1)) // config.block_m * -(-columns // config.block_n)
    assert programs == min(bound, resident_programs(DEVICE))
    expected = expected_tile_order(sizes, columns, config)
    tiles = torch.full((len(expected) + 1, 4), -1, dtype=torch.int32, device=DEVICE)
    totals = torch.full((programs,), -1, dtype=torch.int32, device=DEVICE)
    _tile_order_kernel[(programs,)](offsets, tiles, totals, len(sizes), len(sizes), 0, columns, BLOCK_M=config.block_m,
                                    BLOCK_N=config.block_n, GROUP_M=config.group_m,
                                    GROUPS=triton.next_power_of_2(len(sizes)))
    assert totals.eq(len(expected)).all()
    assert [tuple(row) for row in tiles[:len(expected)].tolist()] == expected
    assert tiles[len(expected)].eq(-1).all()  # nothing written past the last tile


@needs_triton
@pytest.mark.parametrize("home, slots", [([3, 0, 20], [5, 0, 9]), ([4, 4], [0, 0]), ([0, 0], [7, 1])])
def test_a_second_run_of_groups_starts_at_its_own_row(home, slots):
    """Groups from ``split`` on (a layer's borrow slots) start at ``split_start``, not where the
    home groups end; the rows in between belong to no tile."""
    config, columns, split_start = GemmConfig(16, 32, group_m=2), 64, 48
    ends = torch.tensor(home).cumsum(0).tolist() + (split_start + torch.tensor(slots).cumsum(0)).tolist()
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    expected = expected_tile_order(home + slots, columns, config, split=len(home), split_start=split_start)
    tiles = torch.full((len(expected) + 1, 4), -1, dtype=torch.int32, device=DEVICE)
    totals = torch.full((3,), -1, dtype=torch.int32, device=DEVICE)
    _tile_order_kernel[(3,)](offsets, tiles, totals, len(ends), len(home), split_start, columns, BLOCK_M=config.block_m,
                             BLOCK_N=config.block_n, GROUP_M=config.group_m, GROUPS=triton.next_power_of_2(len(ends)))
    assert totals.eq(len(expected)).all()
    assert [tuple(row) for row in tiles[:len(expected)].tolist()] == expected
    assert tiles[len(expected)].eq(-1).all()


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("sizes, out_features, config", [
    ([40], 160, GemmConfig(16, 64, group_m=2)),
    ([3, 0, 50, 1, 0, 17], 128, GemmConfig(16, 32, group_m=3)),
    ([0, 0, 0, 5], 192, GemmConfig(32, 128, group_m=1)),
    ([0, 0], 64, GemmConfig(16, 32)),
    ([9, 0, 30, 2], 192, GemmConfig(16, 64, swap_ab=True)),  # the transposed tile
    ([40], 64, GemmConfig(32, 32, group_m=1, swap_ab=True)),
])
def test_only_rows_before_the_last_offset_are_written(format, sizes, out_features, config):
    rows, packed, offsets = grouped_inputs(format, sizes, out_features, 256, seed=sum(sizes) + out_features, padding=21)
    if format == "mxfp4":
        config = dataclasses.replace(config, block_k=64)
    kernel = fp8_grouped_mm_triton if format == "fp8" else mxfp4_grouped_mm_triton
    poison = torch.full((rows.shape[0], out_features), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out = kernel(rows, packed.values, packed.scales, offsets, config, out=poison)
    end = int(offsets[-1])
    assert out is poison
    assert out[end:].isnan().all()
    if end:
        assert relative_error(out[:end], quantized_grouped_mm(rows, packed, offsets, backend="torch")[:end]) < 4e-3


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_packed_tiles_follow_the_rows_per_group_hint(format, monkeypatch):
    """A shard sized for a full step holds few rows per group at decode: the kernels take the tiles
    of the hint (``rows_per_group``), not of the buffer's size, and compute the same rows."""
    import flatep.experts.grouped as grouped

    rows, packed, offsets = grouped_inputs(format, [5, 0, 9, 2], 256, 256, seed=4, padding=400)
    end = int(offsets[-1])
    name = "fp8_grouped_mm_triton" if format == "fp8" else "mxfp4_grouped_mm_triton"
    launch, seen = getattr(grouped, name), []

    def recorded(*args, config=None, group_rows=None, **given):
        seen.append((config, group_rows))
        return launch(*args, config=config, group_rows=group_rows, **given)

    monkeypatch.setattr(grouped, name, recorded)
    hinted = quantized_grouped_mm(rows, packed, offsets, rows_per_group=4)
    plain = quantized_grouped_mm(rows, packed, offsets)
    launches = packed_launches(16, 4, format, DEVICE)  # the layer's: on Hopper, Gluon kernels for some
    # In any order: on CUDA the launches after the first run side by side, enqueued before it.
    assert len(seen) == len(launches) + 1 and all(launch in seen[:-1] for launch in launches)
    assert seen[-1] == (None, None) and launches[0][0] == default_config(16, 4, format, DEVICE)
    assert default_config(16, 4, format) != default_config(rows.shape[0], 4, format)  # the buffer's would differ
    assert torch.equal(hinted[:end].isnan(), plain[:end].isnan())
    torch.testing.assert_close(hinted[:end].float(), plain[:end].float(), rtol=2e-2, atol=2e-2)


@needs_triton
@pytest.mark.parametrize("config", [GemmConfig(16, 128, 128, swap_ab=True), GemmConfig(32, 64, 128, num_stages=2)])
def test_fp8_gemm_on_packed_rows_equals_quantizing_the_rows_itself(config):
    """Activations given as fp8 dispatch's packed rows (strided views of int32 words, rows 4 W bytes
    apart) give, bit for bit, what the GEMM gives quantizing the bf16 rows itself; the rows are then
    not read (poisoned), and a wrong shape is refused."""
    from flatep.kernels.fp8_rows import Fp8Rows, pack_rows_triton

    rows, packed, offsets = grouped_inputs("fp8", [5, 0, 19, 2], 64, 384, seed=9)
    end = int(offsets[-1])
    activations = Fp8Rows.of(pack_rows_triton(rows), 384)
    assert activations.values.stride(0) == 384 + 4 * 3 and activations.scales.stride(0) == (384 + 4 * 3) // 4
    expected = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, config=config)
    poisoned = torch.full_like(rows, float("nan"))
    got = fp8_grouped_mm_triton(poisoned, packed.values, packed.scales, offsets, config=config,
                                activations=(activations.values, activations.scales))
    assert torch.equal(got[:end].view(torch.int16), expected[:end].view(torch.int16))
    with pytest.raises(ValueError, match="activations must be"):
        fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets,
                              activations=(activations.values[:, :256], activations.scales))


@needs_triton
def test_fp8_experts_quantize_the_down_input_in_the_swiglu_pass_bit_equal_to_two_launches():
    """grouped_swiglu with fp8 weights: the SwiGLU pass writes the down projection's fp8 rows itself;
    the result equals the gate/up GEMM, the bf16 SwiGLU and the down GEMM quantizing its own input."""
    from flatep.experts.grouped import grouped_swiglu
    from flatep.kernels.activation import swiglu_weighted_triton

    sizes, hidden, intermediate = [5, 0, 19, 2], 256, 256
    generator = torch.Generator().manual_seed(31)
    shard = torch.randn(sum(sizes) + 3, hidden, generator=generator).bfloat16().to(DEVICE)
    route_weights = (torch.rand(shard.shape[0], generator=generator) + 0.1).to(DEVICE)
    w13 = QuantizedTensor.quantize(torch.randn(4, 2 * intermediate, hidden, generator=generator) * hidden**-0.5, "fp8").to(DEVICE)
    w2 = QuantizedTensor.quantize(torch.randn(4, hidden, intermediate, generator=generator) * intermediate**-0.5, "fp8").to(DEVICE)
    offsets = torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(DEVICE)
    out = grouped_swiglu(shard, route_weights, w13, w2, offsets, backend="triton")
    gate_up = fp8_grouped_mm_triton(shard, w13.values, w13.scales, offsets)
    activated = torch.empty(shard.shape[0], intermediate, dtype=torch.bfloat16, device=DEVICE)
    swiglu_weighted_triton(gate_up, route_weights, offsets[-1:], activated)
    expected = fp8_grouped_mm_triton(activated, w2.values, w2.scales, offsets)
    end = int(offsets[-1])
    assert torch.equal(out[:end], expected[:end])


def test_packed_launches_give_hot_groups_tall_tiles_at_decode_sizes():
    (short, cool), (tall, hot) = packed_launches(16 * 112, 112, "fp8")
    assert short.block_m == 16 and cool == (0, HOT_ROWS)
    assert tall.block_m == 64 and hot == (HOT_ROWS, 2**31 - 1)
    assert len(packed_launches(24 * 112, 112, "fp8")) == 1  # fp8 takes 64-row tiles there
    # mxfp4 steps at decode sizes run each group in the shortest of its 16-, 32- and 64-row tiles
    # that holds it (a row tile decodes its weight tiles again).
    for average in (4, 16, 24):
        (short, few), (middle, some), (tall, hot) = packed_launches(average * 112, 112, "mxfp4")
        assert (short.block_m, middle.block_m, tall.block_m) == (16, 32, 64)
        assert (few, some, hot) == ((0, 16), (16, 32), (32, 2**31 - 1))
    for format in ("fp8", "mxfp4"):
        assert packed_launches(128 * 112, 112, format) == [(default_config(128 * 112, 112, format), None)]


@pytest.mark.parametrize("swap, wgmma, swap64", [(False, False, False), (True, False, False), (True, True, False),
                                                (True, False, True), (True, True, True)])
def test_mxfp4_launches_take_the_gluon_kernels_the_defaults_name_on_hopper(monkeypatch, swap, wgmma, swap64):
    """On a Hopper GPU (faked here) a decode step's middle launch (17-32 rows a group) takes the swapped
    Gluon kernel with ``MXFP4_SWAP_DEFAULT`` and its hot launch the 64-row one with
    ``MXFP4_WGMMA_DEFAULT``, or else the swapped kernel's 64-row tile with ``MXFP4_SWAP64_DEFAULT``;
    the 16-row launch keeps the Triton tile, and no device keeps them all."""
    from flatep.kernels import packed_tiles

    monkeypatch.setattr(packed_tiles, "MXFP4_SWAP_DEFAULT", swap)
    monkeypatch.setattr(packed_tiles, "MXFP4_WGMMA_DEFAULT", wgmma)
    monkeypatch.setattr(packed_tiles, "MXFP4_SWAP64_DEFAULT", swap64)
    monkeypatch.setattr(fp8_wgmma, "available", lambda device: True)
    (short, _), (middle, _), (tall, _) = packed_launches(18 * 112, 112, "mxfp4", torch.device("cuda"))
    assert short == packed_tiles.MXFP4_SHORT[16]
    assert middle == (packed_tiles.MXFP4_SWAP[32] if swap else packed_tiles.MXFP4_SHORT[32])
    assert tall == (packed_tiles.MXFP4_WGMMA if wgmma else packed_tiles.MXFP4_SWAP[64] if swap64
                    else packed_tiles.MXFP4_TALL)
    assert [config.wgmma for config, _ in packed_launches(18 * 112, 112, "mxfp4")] == [False, False, False]


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_group_rows_launches_write_their_groups_only_and_together_all(format):
    """Each launch computes the groups of its row range and leaves every other row as it was
    (poisoned here); the two launches of a split step together equal one launch of all groups."""
    sizes = [1, 5, 0, 3, 9, 2]
    rows, packed, offsets = grouped_inputs(format, sizes, 32, 256, seed=8)
    kernel = fp8_grouped_mm_triton if format == "fp8" else mxfp4_grouped_mm_triton
    config = GemmConfig(16, 32, 128 if format == "fp8" else 64)
    whole = kernel(rows, packed.values, packed.scales, offsets, config)
    out = torch.full_like(whole, float("nan"))
    kernel(rows, packed.values, packed.scales, offsets, config, out=out, group_rows=(0, 3))
    ends = offsets.tolist()
    for group, size in enumerate(sizes):
        block = out[ends[group] - size:ends[group]]
        assert block.isnan().all() if size > 3 else torch.equal(block, whole[ends[group] - size:ends[group]])
    kernel(rows, packed.values, packed.scales, offsets, config, out=out, group_rows=(3, 2**31 - 1))
    assert torch.equal(out[:ends[-1]], whole[:ends[-1]])
    with pytest.raises(ValueError, match="group_rows"):
        kernel(rows, packed.values, packed.scales, offsets, config, group_rows=(4, 3))


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
def test_a_hot_group_at_decode_sizes_runs_in_tall_tiles_and_equals_torch(format):
    """A decode step (about 4 rows per group) with one expert of more than HOT_ROWS rows: the
    short-tile launch and the hot launch together compute every group, as the torch path does."""
    sizes = [3, HOT_ROWS + 7, 0, 2]
    rows, packed, offsets = grouped_inputs(format, sizes, 64, 128 if format == "fp8" else 64, seed=6)
    got = quantized_grouped_mm(rows, packed, offsets, rows_per_group=4)
    end = sum(sizes)
    assert relative_error(got[:end], quantized_grouped_mm(rows, packed, offsets, backend="torch")[:end]) < 4e-3


@needs_triton
def test_mxfp4_step_of_three_launches_equals_torch():
    """An mxfp4 step averaging 24 rows per group: groups of at most 16 rows (16-row tiles), 17 to 32
    rows (32-row tiles) and more (64-row tiles), each computed once, as the torch path does."""
    sizes = [3, 16, 17, 0, 32, 33, HOT_ROWS + 1, 1]
    assert len(packed_launches(24 * len(sizes), len(sizes), "mxfp4")) == 3
    rows, packed, offsets = grouped_inputs("mxfp4", sizes, 64, 64, seed=14)
    got = quantized_grouped_mm(rows, packed, offsets, rows_per_group=24)
    expected = quantized_grouped_mm(rows, packed, offsets, backend="torch")
    for group, end in enumerate(offsets.tolist()):  # every group, so that a launch that skips one fails
        if sizes[group]:
            assert relative_error(got[end - sizes[group]:end], expected[end - sizes[group]:end]) < 4e-3


@needs_triton
@pytest.mark.parametrize("swap_ab", [False, True])
def test_fp8_rescaled_accumulator_holds_scales_far_apart_across_k(swap_ab):
    """Weight blocks and activation groups whose scales differ by up to 2**40 from one K step to
    the next: the rescaled accumulator (acc * s_previous / s, then the MMA adds in place) gives the
    torch path's result as closely as the product-per-step form does."""
    sizes, out_features, in_features = [3, 9, 0, 5], 128, 640
    rows, packed, offsets = grouped_inputs("fp8", sizes, out_features, in_features, seed=31)
    steps = in_features // 128
    factors = 2.0 ** torch.tensor([-20, 12, 0, 20, -8], dtype=torch.float32)
    packed = QuantizedTensor("fp8", packed.values, packed.scales * factors.to(DEVICE)[:steps], "checkpoint")
    rows = (rows.float().unflatten(1, (steps, 128)) * factors.flip(0).to(DEVICE)[:steps, None]).flatten(1).bfloat16()
    end = sum(sizes)
    reference = quantized_grouped_mm(rows, packed, offsets, backend="torch")[:end]
    plain = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, GemmConfig(16, 64, swap_ab=swap_ab))
    rescaled = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets,
                                     GemmConfig(16, 64, swap_ab=swap_ab, rescale=True))
    assert relative_error(plain[:end], reference) < 4e-3 and relative_error(rescaled[:end], reference) < 4e-3
    assert rescaled[:end].isfinite().all()
    # A zero weight block scale (expert 1's only column block, one K step): the plain form takes
    # its weights as 0, the rescaled one divides by it and makes the expert's rows NaN (not a
    # silently wrong value); the other experts' rows are as before.
    packed.scales[1, 0, 2] = 0.0
    reference = quantized_grouped_mm(rows, packed, offsets, backend="torch")[:end]
    plain = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets, GemmConfig(16, 64, swap_ab=swap_ab))
    rescaled = fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets,
                                     GemmConfig(16, 64, swap_ab=swap_ab, rescale=True))
    assert relative_error(plain[:end], reference) < 4e-3
    group_rows = slice(sizes[0], sizes[0] + sizes[1])
    assert rescaled[group_rows].isnan().all()
    assert rescaled[:sizes[0]].isfinite().all() and rescaled[group_rows.stop:end].isfinite().all()


def test_rescale_is_an_fp8_option():
    rows, packed, offsets = grouped_inputs("mxfp4", [2, 3], 32, 64, seed=2)
    with pytest.raises(ValueError, match="rescale is an fp8 tile option"):
        mxfp4_grouped_mm_triton(rows, packed.values, packed.scales, offsets, GemmConfig(16, 32, 32, rescale=True))


@needs_triton
def test_mxfp4_kernel_takes_scales_in_either_order_bit_for_bit():
    """Scales stored column-fastest (as pools hold them) or in the checkpoint's order (each column's
    blocks contiguous) give the same output, bit for bit, for home experts and slots; slot scales
    in other strides than the experts' are refused before any kernel runs."""
    rows, packed, offsets = grouped_inputs("mxfp4", [3, 6, 1, 4], 64, 128, seed=21)
    home, slots = packed[:2], packed[2:]
    assert home.scales.stride(1) == 1  # columns fastest
    by_column = mxfp4_grouped_mm_triton(rows, home.values, home.scales, offsets, GemmConfig(16, 32, 64),
                                        slots=(slots.values, slots.scales), slot_base=9)
    contiguous = home.scales.contiguous(), slots.scales.contiguous()
    by_block = mxfp4_grouped_mm_triton(rows, home.values, contiguous[0], offsets, GemmConfig(16, 32, 64),
                                       slots=(slots.values, contiguous[1]), slot_base=9)
    assert torch.equal(by_column[:14], by_block[:14]) and by_column[:14].isfinite().all()
    with pytest.raises(ValueError, match="slot scales must be .* in the weights' scales' strides"):
        mxfp4_grouped_mm_triton(rows, home.values, home.scales, offsets, slots=(slots.values, contiguous[1]),
                                slot_base=9)


@needs_triton
def test_mxfp4_copies_by_descriptor_only_what_a_descriptor_can_cover():
    """Unswapped tiles over pool-layout operands copy by tensor descriptor (on Hopper; the
    interpreter runs descriptors too); swapped tiles, copies that are not whole multiples of 128
    bytes (TMA's shared-memory alignment), scales in the checkpoint's order and rows whose stride is
    not 16-byte aligned take pointer copies, with the same bits."""
    if not interpreting() and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("tensor descriptors copy by TMA from Hopper on")
    rows, packed, offsets = grouped_inputs("mxfp4", [3, 6, 1, 4], 64, 128, seed=22)
    home, slots = packed[:2], packed[2:]
    config = GemmConfig(16, 64, 64, lane_words=True)
    by_descriptor = _mxfp4_descriptors(rows, home.values, home.scales, slots.values, slots.scales, config)
    shapes = [descriptor.block_shape for descriptor in by_descriptor]
    assert shapes == [[16, 64], [1, 64, 8], [1, 2, 64], [1, 64, 8], [1, 2, 64]]
    assert _mxfp4_descriptors(rows, home.values, home.scales, slots.values, slots.scales,
                              dataclasses.replace(config, block_n=32)) is None  # 64 bytes of scales
    assert _mxfp4_descriptors(rows, home.values, home.scales, slots.values, slots.scales,
                              dataclasses.replace(config, swap_ab=True)) is None
    assert _mxfp4_descriptors(rows, home.values, home.scales.contiguous(), slots.values,
                              slots.scales.contiguous(), config) is None
    wide = torch.zeros(rows.shape[0], rows.shape[1] + 4, dtype=rows.dtype, device=rows.device)
    unaligned = wide[:, :rows.shape[1]].copy_(rows)  # a row stride of 132 bf16: 264 bytes
    assert _mxfp4_descriptors(unaligned, home.values, home.scales, slots.values, slots.scales,
                              config) is None
    expected = mxfp4_grouped_mm_triton(rows, home.values, home.scales, offsets, config,
                                       slots=(slots.values, slots.scales), slot_base=9)
    by_pointer = mxfp4_grouped_mm_triton(unaligned, home.values, home.scales, offsets, config,
                                         slots=(slots.values, slots.scales), slot_base=9)
    assert torch.equal(expected[:14], by_pointer[:14]) and expected[:14].isfinite().all()


@needs_triton
def test_mxfp4_in_checkpoint_layout_runs_the_kernel_after_converting():
    """Weights built from checkpoint bytes (the default layout) give the kernel path the same result
    as the same weights in the pools' word layout, and both equal the torch path."""
    rows, words, offsets = grouped_inputs("mxfp4", [3, 6, 1], 32, 64, seed=12)
    checkpoint = words.in_layout("checkpoint")
    assert checkpoint.layout == "checkpoint" and not torch.equal(checkpoint.values, words.values)
    got = quantized_grouped_mm(rows, checkpoint, offsets, rows_per_group=4)
    assert torch.equal(got[:10], quantized_grouped_mm(rows, words, offsets, rows_per_group=4)[:10])
    assert relative_error(got[:10], quantized_grouped_mm(rows, checkpoint, offsets, backend="torch")[:10]) < 4e-3


@needs_triton
@pytest.mark.parametrize("format", ["fp8", "mxfp4"])
@pytest.mark.parametrize("given", [False, True])
def test_packed_experts_and_slots_in_shared_launches_equal_two_calls(format, given):
    """grouped_swiglu over home experts and a second set (a layer's borrow slots, from row
    slot_base) in the same launches gives, bit for bit, what one call per set gives; the rows
    between the sets (poisoned) reach no real row, and a bf16 ``out`` is written in place (fp8: also
    with the rows given quantized, as fp8 dispatch delivers them)."""
    from flatep.experts.grouped import grouped_swiglu
    from flatep.kernels.fp8_rows import Fp8Rows

    if given and format != "fp8":
        pytest.skip("pre-quantized rows are fp8 only")
    home_sizes, slot_sizes, slot_base, hidden, intermediate = [3, 0, 7], [2, 5], 16, 128, 128
    generator = torch.Generator().manual_seed(41)
    rows = slot_base + sum(slot_sizes) + 2
    shard = torch.randn(rows, hidden, generator=generator).bfloat16()
    shard[sum(home_sizes):slot_base] = float("nan")
    shard[slot_base + sum(slot_sizes):] = float("nan")
    shard = shard.to(DEVICE)
    route_weights = (torch.rand(rows, generator=generator) + 0.1).to(DEVICE)

    def experts(count):
        w13 = torch.randn(count, 2 * intermediate, hidden, generator=generator) * hidden**-0.5
        w2 = torch.randn(count, hidden, intermediate, generator=generator) * intermediate**-0.5
        return tuple(QuantizedTensor.quantize(w, format).in_layout(pool_layout(format)).to(DEVICE) for w in (w13, w2))

    home, slots = experts(3), experts(2)
    home_offsets = torch.tensor(home_sizes).cumsum(0)
    slot_offsets = slot_base + torch.tensor(slot_sizes).cumsum(0)
    offsets = torch.cat([home_offsets, slot_offsets]).to(torch.int32).to(DEVICE)
    activations = None
    if given:
        activations = Fp8Rows(*quantize_fp8_activations_triton(shard, torch.tensor([rows], dtype=torch.int32, device=DEVICE)))
    home_end = sum(home_sizes)
    out = torch.full((rows, hidden), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    result = grouped_swiglu(shard, route_weights, *home, offsets, backend="triton", out=out, rows_per_group=3,
                            slots=slots, slot_base=slot_base, activations=activations)
    assert result is out
    # An fp32 out takes a copy of the real rows: the rows between the sets stay as they were.
    wide = torch.full((rows, hidden), float("inf"), device=DEVICE)
    grouped_swiglu(shard, route_weights, *home, offsets, backend="triton", out=wide, rows_per_group=3, slots=slots,
                   slot_base=slot_base, activations=activations)
    assert torch.equal(wide.bfloat16()[:home_end], out[:home_end]) and torch.equal(wide[slot_base:], out[slot_base:].float())
    assert (wide[home_end:slot_base] == float("inf")).all()
    first = grouped_swiglu(shard[:slot_base], route_weights[:slot_base], *home, offsets[:3], backend="triton",
                           rows_per_group=3, activations=None if activations is None else activations[:slot_base])
    second = grouped_swiglu(shard[slot_base:], route_weights[slot_base:], *slots, offsets[3:] - slot_base,
                            backend="triton", rows_per_group=3,
                            activations=None if activations is None else activations[slot_base:])
    slot_end = slot_base + sum(slot_sizes)
    assert torch.equal(out[:home_end], first[:home_end])
    assert torch.equal(out[slot_base:slot_end], second[:slot_end - slot_base])
    assert out[:home_end].isfinite().all() and out[slot_base:slot_end].isfinite().all()
    assert (out[slot_end:] == float("inf")).all()  # past the last offset: not written


@pytest.mark.parametrize("make, message", [
    (lambda r, p, s, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, slots=(s.values.float(), s.scales)),
     "slot values must be"),
    (lambda r, p, s, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, slots=(s.values, s.scales.double())),
     "slot scales must be"),
    (lambda r, p, s, o: fp8_grouped_mm_triton(r, p.values, p.scales, o[:2], slots=(s.values, s.scales)),
     r"offsets must be a contiguous \[3\]"),
    (lambda r, p, s, o: fp8_grouped_mm_triton(r, p.values, p.scales, o, slots=(s.values, s.scales), slot_base=99),
     "slot_base must be"),
])
def test_slots_of_a_packed_gemm_are_checked_before_running(make, message):
    rows = torch.randn(8, 128).bfloat16()
    home = QuantizedTensor.quantize(torch.randn(2, 128, 128), "fp8")
    slots = QuantizedTensor.quantize(torch.randn(1, 128, 128), "fp8")
    offsets = torch.tensor([2, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=message):
        make(rows, home, slots, offsets)


def test_grouped_swiglu_refuses_slots_in_another_format():
    from flatep.experts.grouped import grouped_swiglu

    shard, route_weights = torch.randn(8, 128).bfloat16().to(DEVICE), torch.rand(8, device=DEVICE)
    home = [QuantizedTensor.quantize(torch.randn(2, *shape), "fp8").to(DEVICE) for shape in ((256, 128), (128, 128))]
    slots = [QuantizedTensor.quantize(torch.randn(1, *shape), "mxfp4").to(DEVICE) for shape in ((256, 128), (128, 128))]
    offsets = torch.tensor([2, 4, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="slots run in the launches"):
        grouped_swiglu(shard, route_weights, *home, offsets, backend="triton", slots=tuple(slots), slot_base=4)
