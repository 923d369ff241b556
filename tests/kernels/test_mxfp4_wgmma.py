"""The Gluon mxfp4 kernel: compiled for sm_90 without a GPU (its MMAs overlapped, no spills, its
shared memory within Hopper's), and on a Hopper GPU against the Triton tile of the same contract
and the dequantized weights."""
from __future__ import annotations

import pytest
import torch

from flatep.kernels import fp8_wgmma, mxfp4_wgmma
from tests.helpers import relative_error, sm90_build, write_compiled
from tests.kernels.mxfp4_gluon_checks import check_against_a_tile_with_slots_in_a_graph, compile_for_sm90, \
    random_experts

pytestmark = pytest.mark.skipif(fp8_wgmma.gluon is None, reason="this Triton has no Gluon Hopper API")
on_hopper = pytest.mark.skipif(not (torch.cuda.is_available() and fp8_wgmma.available(torch.device("cuda"))),
                               reason="the Gluon kernel runs on a Hopper (sm_90) GPU")


def _compile_for_sm90(inner: int, stages: int, one_multiply: bool):
    constants = {"LOAD_STAGES": stages, "DECODE_STAGES": mxfp4_wgmma.DECODE_STAGES, "ONE_MULTIPLY": one_multiply,
                 "DECODER_REGISTERS": mxfp4_wgmma.DECODER_REGISTERS,
                 "PRODUCER_REGISTERS": mxfp4_wgmma.PRODUCER_REGISTERS}
    return compile_for_sm90(mxfp4_wgmma._mxfp4_wgmma_kernel, inner, mxfp4_wgmma.WG_M, mxfp4_wgmma.BLOCK_N, constants,
                            mxfp4_wgmma.NUM_WARPS, mxfp4_wgmma.MAX_REGISTERS)


def _write_compiled(inner: int, stages: int, one_multiply: bool, directory: str) -> None:
    write_compiled(_compile_for_sm90(inner, stages, one_multiply), directory)


@pytest.mark.parametrize("inner, stages, one_multiply", [(3584, mxfp4_wgmma.LOAD_STAGES, True),
                                                         (3072, max(mxfp4_wgmma.STAGES), False)])
def test_compiles_for_sm90_with_overlapped_mmas(inner, stages, one_multiply, tmp_path):
    """Kimi-K3's gate/up and down K, both passes, at the default and the most stages: the shared
    memory fits Hopper's 227 KiB a block; the consumer waits for all but the last issued MMA, and
    (where Triton's bundled cuobjdump can read the cubin) the SASS keeps that wait (ptxas did not
    serialize the MMAs, which it does where one is in flight across a loop's back edge); no
    registers spill at the partitions' register counts.

    The compile runs in a process of its own (:func:`tests.helpers.sm90_build`)."""
    shared, ptx, sass, usage = sm90_build(f"from tests.kernels.test_mxfp4_wgmma import _write_compiled; "
                                          f"_write_compiled({inner}, {stages}, {one_multiply}, {str(tmp_path)!r})",
                                          tmp_path)
    assert shared <= 227 * 1024
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x1") >= mxfp4_wgmma.CHUNK - 1
    assert "STACK:0" in usage  # no spills


@on_hopper
@pytest.mark.parametrize("hidden, columns", [(64, 256), (640, 384)])
def test_identity_rows_read_back_each_decoded_weight(hidden, columns):
    """Rows of one-hots: row ``i`` of the block of rows starting at column ``start`` picks weight column
    ``start + i`` of every output column, so the output is the decoded weights as the MMA read them,
    exactly (e2m1 times a power of two is a bf16, one product per output). A value or scale read from
    the wrong place shows as a mismatch; a wrong scale as a power-of-two ratio over its block of 32."""
    from flatep.kernels.packed_tiles import MXFP4_WGMMA
    from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

    generator = torch.Generator(device="cuda").manual_seed(hidden + columns)
    weights = random_experts(1, columns, hidden, generator)
    dense = weights.dequantize()[0]  # [N, K]
    offsets = torch.tensor([64], dtype=torch.int32, device="cuda")
    for start in range(0, hidden, 64):
        rows = torch.zeros(64, hidden, dtype=torch.bfloat16, device="cuda")
        rows[:, start:start + 64] = torch.eye(64, dtype=torch.bfloat16, device="cuda")
        out = torch.full((64, columns), float("inf"), dtype=torch.bfloat16, device="cuda")
        mxfp4_grouped_mm_triton(rows, weights.values, weights.scales, offsets, MXFP4_WGMMA, out=out)
        assert torch.equal(out.float(), dense[:, start:start + 64].T)


@on_hopper
@pytest.mark.parametrize("hidden, columns", [(640, 384), (3584, 512)])
@pytest.mark.parametrize("group_rows", [None, (32, 2**31 - 1)])
@pytest.mark.parametrize("large_scale", [False, True])
def test_against_the_triton_tile_with_slots_in_a_graph(hidden, columns, group_rows, large_scale):
    """K of 10 steps (two chunks and a partial one) and of 56 (Kimi-K3's gate/up), ``N`` with a
    partial 256-column block, groups of 0 to 200 rows and slots, all or only the groups of more
    than 32 rows, in a CUDA graph with host syncs raising; with a scale byte past 128 (the second
    pass) or not. Against the torch path and the Triton 64 x 256 tile; rows of no computed group
    stay as they were (the gap between home rows and slot rows holds NaN, which the tiles copy in)."""
    from flatep.kernels.packed_tiles import MXFP4_TALL, MXFP4_WGMMA

    check_against_a_tile_with_slots_in_a_graph(MXFP4_WGMMA, MXFP4_TALL, [200, 0, 33, 1, 64, 65, 128, 47], [96, 5],
                                               hidden, columns, group_rows, large_scale,
                                               seed=hidden + columns + large_scale)


@on_hopper
def test_the_default_and_the_fallback_where_tma_cannot_copy():
    """With ``MXFP4_WGMMA_DEFAULT`` the mxfp4 default and a decode step's hot launch take the Gluon
    kernel past 32 rows per group on a Hopper GPU (and its middle launch the swapped one with
    ``MXFP4_SWAP_DEFAULT``); scales in the checkpoint's order (not
    column-fastest) run the Triton tile instead, with the same result."""
    from flatep.kernels.packed_tiles import (
        MXFP4_SWAP_DEFAULT, MXFP4_WGMMA, MXFP4_WGMMA_DEFAULT, default_config, packed_launches,
    )
    from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

    device = torch.device("cuda")
    assert default_config(33 * 4, 4, "mxfp4", device).wgmma == MXFP4_WGMMA_DEFAULT
    assert default_config(32 * 4, 4, "mxfp4", device).wgmma == MXFP4_SWAP_DEFAULT
    assert not default_config(16 * 4, 4, "mxfp4", device).wgmma and not default_config(33 * 4, 4, "mxfp4").wgmma
    assert [config.wgmma for config, _ in packed_launches(18 * 112, 112, "mxfp4", device)] == \
        [False, MXFP4_SWAP_DEFAULT, MXFP4_WGMMA_DEFAULT]
    sizes, columns, hidden = [100, 0, 40], 256, 1024
    generator = torch.Generator(device="cuda").manual_seed(7)
    weights = random_experts(len(sizes), columns, hidden, generator)
    x = torch.randn(sum(sizes), hidden, device="cuda", generator=generator).bfloat16()
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    column_fastest = mxfp4_grouped_mm_triton(x, weights.values, weights.scales, offsets, MXFP4_WGMMA)
    checkpoint_order = mxfp4_grouped_mm_triton(x, weights.values, weights.scales.contiguous(), offsets, MXFP4_WGMMA)
    assert relative_error(column_fastest, checkpoint_order) < 4e-3
