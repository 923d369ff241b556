"""The mxfp4 GEMM over pools in the ``mma`` layout (fp8 activations): the kernel's decode emulated bit
for bit (PTX ``prmt``) over its window of scale bytes, the exact Triton pass on the CPU
(under the interpreter) against the dequantized weights, the Gluon fp8 kernel compiled for sm_90
without a GPU, and on a Hopper GPU against the torch path with slots, in a CUDA graph, including
scale bytes outside its window (the exact pass then computes the flagged tiles again)."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from flatep.kernels import fp8_wgmma, mxfp4_fp8mma, mxfp4_swap
from flatep.kernels.backend import use_triton
from flatep.kernels.packed_tiles import FP8MMA, default_config, packed_launches
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton
from flatep.quant import QuantizedTensor, to_mma_layout
from flatep.quant.mxfp4 import E2M1_VALUES
from tests.helpers import DEVICE, relative_error, sm90_build, write_compiled

on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_wgmma.available(torch.device("cuda"))),
                               reason="the Gluon kernel runs on a Hopper (sm_90) GPU")
needs_triton = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


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
    """The kernel's DECODE_PTX on one word: the e4m3 bytes of columns ``4q + j`` and ``16 + 4q + j``."""
    magnitudes = word & 0x77777777
    first = _prmt(table0, table1, magnitudes & 0xFFFF) | (word & 0x80808080)
    second = _prmt(table0, table1, magnitudes >> 16) | ((word << 4) & 0x80808080)
    return first, second


def _decoded_values(codes: torch.Tensor, scale: int) -> torch.Tensor:
    """One row's e2m1 ``codes [K]`` with one scale byte for every block -> the values the kernel's decode
    (:data:`flatep.kernels.mxfp4_mxfp4_fp8mma.DECODE_PTX`, emulated) makes of its ``mma`` layout, fp32."""
    packed = (codes[0::2] | (codes[1::2] << 4))[None]
    words = to_mma_layout(packed).view(torch.int32)[0].tolist()
    table0 = (scale * mxfp4_fp8mma.STEP0 + mxfp4_fp8mma.TABLE0) & 0xFFFFFFFF
    table1 = (scale * mxfp4_fp8mma.STEP1 + mxfp4_fp8mma.TABLE1) & 0xFFFFFFFF
    e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    out = torch.empty(codes.shape[0])
    for index, word in enumerate(words):
        block, lane = divmod(index, 4)
        for half, register in enumerate(_decode(word & 0xFFFFFFFF, table0, table1)):
            for j in range(4):
                out[32 * block + 16 * half + 4 * lane + j] = e4m3[(register >> 8 * j) & 0xFF]
    return out


def test_every_code_decodes_exactly_at_every_scale_in_the_window():
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)[order]
    expected_codes = torch.tensor(E2M1_VALUES)[codes.long()]
    for scale in range(mxfp4_fp8mma.LOW, mxfp4_fp8mma.HIGH + 1):
        decoded = _decoded_values(codes, scale)
        torch.testing.assert_close(decoded, expected_codes * 2.0 ** (scale - mxfp4_fp8mma.CENTER), rtol=0, atol=0)
        assert torch.equal(torch.signbit(decoded), codes >= 8)  # -0 stays -0


@pytest.mark.parametrize("past", [-1, 1])
def test_the_window_is_tight(past):
    """One byte past either end of the window decodes some code wrongly: the kernel's flag is needed."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(4)
    scale = mxfp4_fp8mma.LOW - 1 if past < 0 else mxfp4_fp8mma.HIGH + 1
    decoded = _decoded_values(codes, scale)
    expected = torch.tensor(E2M1_VALUES)[codes.long()] * 2.0 ** (scale - mxfp4_fp8mma.CENTER)
    assert not torch.equal(decoded, expected)


def test_the_kernels_arithmetic_equals_the_dequantized_product():
    """The kernel's computation emulated in fp32: the emulated decode of each row and block (scale
    bytes across the window) times the split rows' two parts, times the rows' factors, is the product
    of the bf16 rows and the dequantized weights, within e4m3's split error."""
    from flatep.kernels.fp8_split import split_rows

    generator = torch.Generator().manual_seed(12)
    columns, inner = 6, 96
    codes = torch.randint(0, 16, (columns, inner), dtype=torch.uint8, generator=generator)
    scales = torch.randint(mxfp4_fp8mma.LOW, mxfp4_fp8mma.HIGH + 1, (columns, inner // 32), generator=generator)
    decoded = torch.stack([torch.cat([_decoded_values(codes[n], int(scales[n, b]))[32 * b:32 * b + 32]
                                      for b in range(inner // 32)]) for n in range(columns)])
    dense = torch.tensor(E2M1_VALUES)[codes.long()] * torch.exp2(scales.float() - 127).repeat_interleave(32, 1)
    rows = (torch.randn(5, inner, generator=generator) * 3).bfloat16()
    hi_lo, factor = split_rows(rows, mxfp4_fp8mma.CENTER)
    product = (hi_lo[:5].float() @ decoded.T + hi_lo[5:].float() @ decoded.T) * factor[:, None]
    expected = rows.float() @ dense.T
    assert relative_error(product, expected) < 1e-5  # hi + lo is each row but for its smallest values


def _experts(count: int, columns: int, hidden: int, generator: torch.Generator, spread: int = 0) -> QuantizedTensor:
    """``count`` random experts in the ``mma`` layout; ``spread`` moves each scale byte by up to that much."""
    weights = torch.randn(count, columns, hidden, generator=generator) * hidden**-0.5
    packed = QuantizedTensor.quantize(weights, "mxfp4")
    if spread:
        shift = torch.randint(-spread, spread + 1, packed.scales.shape, generator=generator)
        packed = QuantizedTensor("mxfp4", packed.values, (packed.scales.int() + shift).clamp(1, 250).to(torch.uint8))
    return packed.in_layout("mma").to(DEVICE)


def _grouped_case(home_sizes, slot_sizes, hidden, columns, seed, spread=0):
    """Home and slot experts, rows with NaN between the two sets (a shard's unused rows), offsets."""
    generator = torch.Generator().manual_seed(seed)
    home = _experts(len(home_sizes), columns, hidden, generator, spread)
    slots = _experts(len(slot_sizes), columns, hidden, generator, spread)
    gap = 11
    slot_base = sum(home_sizes) + gap
    rows = slot_base + sum(slot_sizes) + 3
    x = torch.randn(rows, hidden, generator=generator).bfloat16().to(DEVICE)
    x[sum(home_sizes):slot_base] = float("nan")
    ends = torch.tensor(home_sizes).cumsum(0).tolist() + (slot_base + torch.tensor(slot_sizes).cumsum(0)).tolist()
    return home, slots, x, torch.tensor(ends, dtype=torch.int32, device=DEVICE), slot_base


def _check(out, home, slots, x, offsets, slot_base, group_rows, tolerance):
    """Every computed group against the dense product over the dequantized weights; every other row
    still holds the poison."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    starts[home.shape[0]] = slot_base
    dense = torch.cat([home.dequantize(), slots.dequantize()])
    for group, (start, end) in enumerate(zip(starts, ends)):
        rows = out[start:end]
        if group_rows is not None and not group_rows[0] < end - start <= group_rows[1]:
            assert (rows == float("inf")).all()
        elif end > start:
            assert relative_error(rows, x[start:end].float() @ dense[group].T) < tolerance
    assert (out[ends[home.shape[0] - 1]:slot_base] == float("inf")).all() and (out[ends[-1]:] == float("inf")).all()


@needs_triton
@pytest.mark.parametrize("group_rows", [None, (4, 9)])
def test_the_exact_pass_equals_the_dequantized_weights_with_slots(group_rows):
    """The Triton tile that decodes the ``mma`` layout into bf16 (every device's path, and the fp8
    kernel's second pass): scale bytes spread far past the fp8 window, home and slot groups."""
    home, slots, x, offsets, slot_base = _grouped_case([5, 0, 12, 3], [7, 9], 96, 160, seed=3, spread=30)
    assert int(home.scales.max()) > mxfp4_fp8mma.HIGH and int(home.scales.min()) < mxfp4_fp8mma.LOW
    out = torch.full((x.shape[0], 160), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    config = default_config(16, 4, "mxfp4", None, "mma")
    mxfp4_grouped_mm_triton(x, home.values, home.scales, offsets, config, out=out, group_rows=group_rows,
                            slots=(slots.values, slots.scales), slot_base=slot_base, layout="mma")
    _check(out, home, slots, x, offsets, slot_base, group_rows, 4e-3)


@needs_triton
@pytest.mark.parametrize("block_n, any_flag", [(64, True), (256, True), (128, False)])
def test_the_exact_pass_computes_the_flagged_tiles_alone(block_n, any_flag):
    """With the fp8 kernel's flags (one per group and 128 columns, after the launch's own), the exact
    pass computes the tiles over the flagged columns (a 256-column tile both its blocks), exactly, and
    leaves every other output as it was (poisoned here); with the launch's flag clear it computes none."""
    from flatep.kernels.quant_gemm import _mxfp4_mma_exact_pass

    sizes, columns = [5, 0, 12, 3, 7, 9], 320  # 3 flag blocks a group, the last 64 columns wide
    home, slots, x, offsets, slot_base = _grouped_case(sizes[:4], sizes[4:], 64, columns, seed=5, spread=30)
    blocks = -(-columns // mxfp4_fp8mma.BLOCK_N)
    tile_flags = torch.rand(len(sizes), blocks, generator=torch.Generator().manual_seed(6)) < 0.4
    tile_flags[2, 0] = tile_flags[5, 2] = True
    redo = torch.cat([torch.tensor([int(any_flag)]), tile_flags.flatten().int()]).int().to(DEVICE)
    assert redo.shape[0] == mxfp4_fp8mma.flag_count(len(sizes), columns)
    out = torch.full((x.shape[0], columns), float("inf"), dtype=torch.bfloat16, device=DEVICE)
    config = dataclasses.replace(default_config(16, 4, "mxfp4", None, "mma"), block_n=block_n)
    _mxfp4_mma_exact_pass(x, home.values, home.scales, offsets, config, out, (0, 1 << 30), slots.values,
                          slots.scales, slot_base, redo)
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    starts[len(sizes) - 2] = slot_base
    dense = torch.cat([home.dequantize(), slots.dequantize()])
    for group, (start, end) in enumerate(zip(starts, ends)):
        for block in range(blocks):
            columns_of = slice(block * mxfp4_fp8mma.BLOCK_N, (block + 1) * mxfp4_fp8mma.BLOCK_N)
            got = out[start:end, columns_of]
            span = max(block_n // mxfp4_fp8mma.BLOCK_N, 1)  # the flag blocks a tile covers
            if any_flag and tile_flags[group, block // span * span:(block // span + 1) * span].any():
                assert relative_error(got, x[start:end].float() @ dense[group, columns_of].T) < 4e-3
            else:
                assert (got == float("inf")).all()


@needs_triton
def test_the_dequantize_kernel_reads_the_mma_layout():
    from flatep.kernels.mxfp4_dequant import dequantize_mxfp4_triton

    experts = _experts(3, 48, 128, torch.Generator().manual_seed(4), spread=30)
    decoded = dequantize_mxfp4_triton(experts.values, experts.scales, layout="mma")
    assert torch.equal(decoded.float(), experts.dequantize(torch.bfloat16).float())


def test_configs_and_launches_of_the_mma_layout():
    cpu = torch.device("cpu")
    assert not default_config(16 * 8, 8, "mxfp4", cpu, "mma").lane_words  # the exact tiles decode in column order
    assert all(not config.lane_words and not config.wgmma for config, _ in packed_launches(20 * 8, 8, "mxfp4", cpu,
                                                                                              "mma"))
    with pytest.raises(ValueError, match="'mma' for mxfp4 only"):
        default_config(16, 1, "fp8", None, "mma")
    values = torch.zeros(1, 128, 32, dtype=torch.uint8)
    scales = torch.full((1, 128, 2), 127, dtype=torch.uint8)
    rows = torch.zeros(4, 64, dtype=torch.bfloat16)
    offsets = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="Hopper"):
        mxfp4_grouped_mm_triton(rows, values, scales, offsets, FP8MMA[32], layout="mma")
    with pytest.raises(ValueError, match="fp8_rows"):
        mxfp4_grouped_mm_triton(rows, values, scales, offsets, fp8_rows=(rows, rows))
    with pytest.raises(ValueError, match="layout must be"):
        mxfp4_grouped_mm_triton(rows, values, scales, offsets, layout="checkpoint")


def _compile(block_m: int, stages: int, registers: int, directory: str, block_k: int = 128, chunk: int = 1) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from flatep.kernels.mxfp4_wgmma import descriptors

    inner = 3584 if block_k == 128 else 2880
    hi_lo = torch.empty(512, inner, dtype=torch.float8_e4m3fn)
    values = torch.empty(2, 512, inner // 2, dtype=torch.uint8)
    scales = torch.empty(2, inner // 32, 512, dtype=torch.uint8).transpose(1, 2)
    kernel = mxfp4_fp8mma._fp8mma_kernel
    operands = descriptors(hi_lo, values, scales, values, scales, block_m, mxfp4_fp8mma.BLOCK_N, block_k)
    types = dict(zip(("a_desc", "w_desc", "s_desc", "slot_w_desc", "slot_s_desc"), map(mangle_type, operands)))
    types |= {"out_ptr": "*bf16", "offsets_ptr": "*i32", "redo_ptr": "*i32", "factor_ptr": "*fp32"}
    constants = {"K": inner, "GROUP_M": 8, "GROUPS": 128, "STAGES": stages,
                 "PRODUCER_REGISTERS": mxfp4_fp8mma.PRODUCER_REGISTERS, "WL": mxfp4_fp8mma.words_layout(block_k),
                 "SL": mxfp4_fp8mma.scales_layout(block_k), "CHUNK": chunk, "num_warps": mxfp4_fp8mma.NUM_WARPS}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = GluonASTSource(fn=kernel, signature=signature,
                            constexprs={(kernel.arg_names.index(name),): value for name, value in constants.items()})
    write_compiled(triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": mxfp4_fp8mma.NUM_WARPS, "maxnreg": registers}), directory)


@pytest.mark.skipif(fp8_wgmma.gluon is None, reason="this Triton has no Gluon Hopper API")
@pytest.mark.parametrize("block_m, block_k, programs, chunk", [
    (32, 128, None, mxfp4_fp8mma.CHUNK_STEPS), (64, 128, None, mxfp4_fp8mma.CHUNK_STEPS),
    (32, 64, None, mxfp4_fp8mma.CHUNK_STEPS),
    # the chunked candidate (bench/scripts/chunk_candidate.py): 2 programs an SM for its registers
    (32, 128, 2, 2), (64, 128, 2, 2), (32, 64, 2, 2)])
def test_compiles_for_sm90_with_the_weights_in_registers(block_m, block_k, programs, chunk, tmp_path):
    """:data:`FP8MMA`'s tiles at Kimi-K3's K (and K steps of 64 at gpt-oss's, 45 of them: a chunk's
    tail), K steps one by one and in chunks: every fp8 MMA takes its first operand from registers,
    no register spills, and the programs an SM fit its shared memory. In chunks, the SASS keeps the
    waits for all but the last half's MMAs (two a step but the chunk's first and last) and waits for
    none in flight only at a chunk's end and its tail's: ptxas did not serialize the MMAs."""
    from flatep.bench.sass import innermost_mma_loop

    config = FP8MMA[block_m]
    programs = programs or config.programs_per_sm
    registers = mxfp4_swap.max_registers(programs)
    if programs == config.programs_per_sm:
        assert registers == {32: 80, 64: 128}[block_m]  # the prototype's measured launches (2026-12-07-h100-j)
    shared, _, sass, usage = sm90_build(
        f"from tests.kernels.test_mxfp4_fp8mma import _compile; "
        f"_compile({block_m}, {config.num_stages}, {registers}, {str(tmp_path)!r}, {block_k}, {chunk})", tmp_path)
    assert programs * (shared + 1024) <= 228 * 1024  # 1 KiB of each program reserved
    mmas = re.findall(rf"QGMMA\.64x{block_m}x32\.F32\.E4M3\.E4M3 R\d+, (\S+), gdesc", sass)
    assert len(mmas) >= 4 * block_k // 32 * chunk and all(operand.startswith("R") for operand in mmas)
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d+)", sass)
    assert waits.count("0x0") <= 2 and waits.count("0x2") >= 2 * chunk - 2
    # No spills in the K loop; Triton 3.9's ptxas keeps a 16-byte stack frame outside it for the 32-row
    # tile at 80 registers. The chunks, at 128 registers, keep none at all.
    assert not [line for line in innermost_mma_loop(sass) if "STL" in line or "LDL" in line]
    assert chunk == 1 or "STACK:0" in usage


@on_hopper
@pytest.mark.parametrize("chunk", [mxfp4_fp8mma.CHUNK_STEPS, 2])
@pytest.mark.parametrize("group_rows, out_of_window, hidden, columns", [
    ((0, 32), False, 3584, 384), ((32, 1 << 30), False, 3584, 384), (None, True, 3584, 384),
    ((0, 32), False, 2880, 320), ((32, 1 << 30), True, 2880, 320)])
def test_the_fp8_kernel_with_slots_in_a_graph(group_rows, out_of_window, hidden, columns, chunk, monkeypatch):
    """:data:`FP8MMA`'s tiles with home and slot groups of 0-70 rows, captured in a CUDA graph with
    host syncs raising; the kernel flags exactly the groups' 128 columns whose tiles read a scale byte
    outside its window (past ``N``, the copies' zeros), which the exact pass computes again (there
    within bf16's error, not the fp8 kernel's). Also gpt-oss-like sizes: ``K`` = 2880 (K steps of 64)
    and ``N`` not a multiple of 128. K steps one by one and in chunks of 2 (with a tail at 2880)."""
    monkeypatch.setattr(mxfp4_fp8mma, "CHUNK_STEPS", chunk)
    home, slots, x, offsets, slot_base = _grouped_case([18, 0, 31, 5, 70, 33], [9, 40], hidden, columns, seed=11)
    if out_of_window:
        home.scales[4, 7, 3] = mxfp4_fp8mma.HIGH + 40
        home.scales[0 if group_rows is None else 4, 200, 80] = mxfp4_fp8mma.LOW - 30
    config = FP8MMA[32 if group_rows in (None, (0, 32)) else 64]
    out = torch.full((x.shape[0], columns), float("inf"), dtype=torch.bfloat16, device="cuda")
    flags, launch = [], mxfp4_fp8mma.mxfp4_fp8mma_launch
    monkeypatch.setattr(mxfp4_fp8mma, "mxfp4_fp8mma_launch", lambda *args: (flags.append(args[8]), launch(*args)))

    def run():
        mxfp4_grouped_mm_triton(x, home.values, home.scales, offsets, config, out=out, group_rows=group_rows,
                                slots=(slots.values, slots.scales), slot_base=slot_base, layout="mma")

    run()  # compiles
    out.fill_(float("inf"))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            run()
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    expected = _outside_window(home, slots, offsets, slot_base, group_rows)
    assert torch.equal(flags[-1].cpu(), torch.cat([expected.any().int()[None], expected.flatten().int()]))
    assert expected[:, :columns // mxfp4_fp8mma.BLOCK_N].any() == out_of_window
    _check(out, home, slots, x, offsets, slot_base, group_rows, 4e-3 if out_of_window else 6e-3)


def _outside_window(home, slots, offsets, slot_base, group_rows) -> torch.Tensor:
    """``[groups, ceil(N / 128)]`` bool: the launch's groups' 128 columns that hold a scale byte outside
    the fp8 kernel's window, or reach past ``N`` (what its flags must say)."""
    ends = offsets.tolist()
    starts = [0, *ends[:-1]]
    starts[home.shape[0]] = slot_base
    outside = mxfp4_fp8mma.tiles_outside_window(torch.cat([home.scales, slots.scales]).cpu())
    above, at_most = group_rows or (0, 1 << 30)
    taken = torch.tensor([above < end - start <= at_most for start, end in zip(starts, ends)])
    return outside & taken[:, None]


def test_tiles_outside_the_window():
    """The tiles the exact pass recomputes, from the scale bytes: one byte past either end of the
    window flags its group's 128 columns, the window's own ends do not, and columns past a
    multiple of 128 always do."""
    scales = torch.full((3, 320, 4), mxfp4_fp8mma.CENTER, dtype=torch.uint8)
    scales[0, 5, 1] = mxfp4_fp8mma.LOW - 1
    scales[1, 130, 3] = mxfp4_fp8mma.HIGH + 1
    scales[2, 0, 0], scales[2, 255, 3] = mxfp4_fp8mma.LOW, mxfp4_fp8mma.HIGH
    expected = torch.tensor([[1, 0, 1], [0, 1, 1], [0, 0, 1]], dtype=torch.bool)
    assert torch.equal(mxfp4_fp8mma.tiles_outside_window(scales), expected)
    assert torch.equal(mxfp4_fp8mma.tiles_outside_window(scales[:, :256].transpose(1, 2).contiguous().transpose(1, 2)),
                       expected[:, :2])
    with pytest.raises(ValueError, match="scales must be"):
        mxfp4_fp8mma.tiles_outside_window(scales.int())


@on_hopper
def test_the_split_on_the_gpu_gives_the_rows_back():
    """The GPU's casts: ``hi + lo`` rebuilds each row to within e4m3's smallest step of its largest, and
    the factors are the torch definition's."""
    from flatep.kernels.fp8_split import split_rows, split_rows_triton

    generator = torch.Generator(device="cuda").manual_seed(9)
    x = (torch.randn(300, 3584, device="cuda", generator=generator)
         * torch.logspace(-3, 3, 300, device="cuda")[:, None]).bfloat16()
    hi_lo, factor = split_rows_triton(x, mxfp4_fp8mma.CENTER)
    assert torch.equal(factor, split_rows(x, mxfp4_fp8mma.CENTER)[1])
    rebuilt = (hi_lo[:300].float() + hi_lo[300:].float()) * factor[:, None] * 2.0 ** (127 - mxfp4_fp8mma.CENTER)
    largest = x.float().abs().amax(1, keepdim=True)
    assert ((rebuilt - x.float()).abs() <= largest * 2.0**-16).all()
