"""The swapped Gluon mxfp4 kernel (groups of at most 32 rows): compiled for sm_90 without a GPU (its
MMAs take the decoded weights from registers, no spills, its shared memory within Hopper's), and on
a Hopper GPU against the Triton short tiles and the dequantized weights."""
from __future__ import annotations

import re

import pytest
import torch

from flatep.kernels import fp8_wgmma, mxfp4_swap
from tests.helpers import sm90_build, write_compiled
from tests.kernels.mxfp4_gluon_checks import check_against_a_tile_with_slots_in_a_graph, compile_for_sm90, \
    random_experts

pytestmark = pytest.mark.skipif(fp8_wgmma.gluon is None, reason="this Triton has no Gluon Hopper API")
CHUNKS = (mxfp4_swap.CHUNK_STEPS, 4)
"""K steps a chunk the GPU tests run: the default and the overlapped candidate (bench/scripts/mxfp4_swap_chunks.py)."""
on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_wgmma.available(torch.device("cuda"))),
                               reason="the Gluon kernel runs on a Hopper (sm_90) GPU")


def _compile_for_sm90(inner: int, block_m: int, stages: int, one_multiply: bool, chunk: int):
    constants = {"STAGES": stages, "ONE_MULTIPLY": one_multiply, "PRODUCER_REGISTERS": mxfp4_swap.PRODUCER_REGISTERS,
                 "CHUNK": chunk}
    return compile_for_sm90(mxfp4_swap._mxfp4_swap_kernel, inner, block_m, mxfp4_swap.BLOCK_N, constants,
                            mxfp4_swap.NUM_WARPS, mxfp4_swap.max_registers(mxfp4_swap.PROGRAMS_PER_SM[block_m]))


def _write_compiled(inner: int, block_m: int, stages: int, one_multiply: bool, chunk: int, directory: str) -> None:
    write_compiled(_compile_for_sm90(inner, block_m, stages, one_multiply, chunk), directory)


@pytest.mark.parametrize("inner, block_m, stages, one_multiply, chunk", [
    (3584, 32, mxfp4_swap.LOAD_STAGES, True, mxfp4_swap.CHUNK_STEPS),
    (3072, 16, max(mxfp4_swap.STAGES), False, mxfp4_swap.CHUNK_STEPS),
    (3584, 32, mxfp4_swap.LOAD_STAGES, True, 4),
    (640, 16, mxfp4_swap.LOAD_STAGES, False, 4),  # 10 K steps: two chunks and a tail of 2
    (3584, 64, mxfp4_swap.LOAD_STAGES, True, mxfp4_swap.CHUNK_STEPS),
    (3072, 64, mxfp4_swap.LOAD_STAGES, False, 4),
])
def test_compiles_for_sm90_with_the_weights_in_registers(inner, block_m, stages, one_multiply, chunk, tmp_path):
    """Kimi-K3's gate/up and down K, both passes, both row tiles, K steps one by one and in chunks:
    the compile itself checks that the decoded weights are in the MMA's operand layout with no data
    movement (``assert_trivial``); every warp-group MMA takes its first operand from registers, two
    halves of four 16-wide chunks a K step; no registers spill; the shared memory fits Hopper's 227
    KiB. In chunks, the SASS keeps the waits for all but the last issued MMA (two a step but the
    chunk's first and last) and waits for none in flight only at a chunk's end: ptxas did not
    serialize the MMAs, which it does where one is in flight across a loop's back edge or registers
    run short. The compile runs in a process of its own (:func:`tests.helpers.sm90_build`)."""
    shared, ptx, sass, usage = sm90_build(
        f"from tests.kernels.test_mxfp4_swap import _write_compiled; "
        f"_write_compiled({inner}, {block_m}, {stages}, {one_multiply}, {chunk}, {str(tmp_path)!r})", tmp_path)
    assert shared <= 227 * 1024
    if stages == mxfp4_swap.LOAD_STAGES:  # the default's programs all fit an SM (1 KiB of each reserved)
        assert mxfp4_swap.PROGRAMS_PER_SM[block_m] * (shared + 1024) <= 228 * 1024
    mmas = re.findall(rf"HGMMA\.64x{block_m}x16\.F32\.BF16 R\d+, (\S+), gdesc", sass)
    assert mmas and all(operand.startswith("R") for operand in mmas)
    assert len(mmas) == 8 * (chunk + (inner // mxfp4_swap.BLOCK_K) % chunk)  # a chunk's steps and the tail's
    waits = re.findall(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x\d+)", sass)
    assert waits.count("0x0") <= 2  # a chunk's end and its tail's; one a step with chunks of one
    assert waits.count("0x1") >= 2 * chunk - 2
    assert "STACK:0" in usage and "LOCAL:0" in usage  # no spills


def test_bad_configs_are_refused():
    from flatep.kernels.packed_tiles import MXFP4_SWAP, GemmConfig
    from flatep.kernels.quant_gemm import _check_mxfp4_wgmma

    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="block_m in"):
        _check_mxfp4_wgmma(GemmConfig(128, 128, 64, num_warps=4, swap_ab=True, wgmma=True), cpu)
    with pytest.raises(ValueError, match="num_stages"):
        _check_mxfp4_wgmma(GemmConfig(32, 128, 64, num_warps=4, num_stages=1, swap_ab=True, wgmma=True), cpu)
    with pytest.raises(ValueError, match="Hopper"):
        _check_mxfp4_wgmma(MXFP4_SWAP[16], cpu)


@on_hopper
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("block_m", mxfp4_swap.BLOCK_M)
@pytest.mark.parametrize("hidden, columns", [(64, 128), (640, 384)])
def test_identity_rows_read_back_each_decoded_weight(block_m, hidden, columns, chunk, monkeypatch):
    """Rows of one-hots: the output is the decoded weights as the MMA read them, exactly (one product
    per output). A value or scale read from the wrong place, or a K position the weights and the
    rows permute differently, shows as a mismatch. K steps one by one and in chunks (1 and 10
    steps: a tail alone, and two chunks and a tail)."""
    monkeypatch.setattr(mxfp4_swap, "CHUNK_STEPS", chunk)
    from flatep.kernels.packed_tiles import MXFP4_SWAP
    from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

    generator = torch.Generator(device="cuda").manual_seed(hidden + columns + block_m)
    weights = random_experts(1, columns, hidden, generator)
    dense = weights.dequantize()[0]  # [N, K]
    offsets = torch.tensor([block_m], dtype=torch.int32, device="cuda")
    for start in range(0, hidden, block_m):
        rows = torch.zeros(block_m, hidden, dtype=torch.bfloat16, device="cuda")
        rows[:, start:start + block_m] = torch.eye(block_m, dtype=torch.bfloat16, device="cuda")
        out = torch.full((block_m, columns), float("inf"), dtype=torch.bfloat16, device="cuda")
        mxfp4_grouped_mm_triton(rows, weights.values, weights.scales, offsets, MXFP4_SWAP[block_m], out=out)
        assert torch.equal(out.float(), dense[:, start:start + block_m].T)


@on_hopper
@pytest.mark.parametrize("chunk", CHUNKS)
@pytest.mark.parametrize("block_m", mxfp4_swap.BLOCK_M)
@pytest.mark.parametrize("hidden, columns", [(640, 384), (3584, 512)])
@pytest.mark.parametrize("group_rows", [None, (16, 32)])
@pytest.mark.parametrize("large_scale", [False, True])
def test_against_the_triton_tile_with_slots_in_a_graph(block_m, hidden, columns, group_rows, large_scale, chunk,
                                                       monkeypatch):
    """Groups of 0 to 40 rows and slots, all or only the groups of 17 to 32 rows, in a CUDA graph with
    host syncs raising; with a scale byte past 128 (the second pass) or not. Against the torch path
    and the Triton tile of the same height (the 64 x 256 one for 64 rows); rows of no computed group
    stay as they were. K steps one by one and in chunks."""
    monkeypatch.setattr(mxfp4_swap, "CHUNK_STEPS", chunk)
    from flatep.kernels.packed_tiles import MXFP4_SHORT, MXFP4_SWAP, MXFP4_TALL

    check_against_a_tile_with_slots_in_a_graph(MXFP4_SWAP[block_m], MXFP4_SHORT.get(block_m, MXFP4_TALL),
                                               [20, 0, 33, 1, 16, 17, 32, 40], [9, 5], hidden, columns, group_rows,
                                               large_scale, seed=hidden + columns + large_scale + block_m)
