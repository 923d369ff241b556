"""Grouped GEMMs over packed weights: fp8 e4m3 with 128x128 block scales, and mxfp4.

Same contract as ``torch._grouped_mm(rows, weights.T, offs=offsets)``: ``offsets [G]`` int32 holds
the inclusive end row of each group, group ``g`` owns rows ``[offsets[g-1], offsets[g])``, and
rows at and past ``offsets[-1]`` are neither read nor written. Nothing is read on the host, so a
call can be captured in a CUDA graph. The grid is persistent: a fixed number of programs (two per
SM, fewer for small shapes) loop over the tiles the offsets hold, ``program, program + P, ...``;
each finds its group, row tile and column block from a running sum of the groups' tiles. Nothing
is launched per row of the buffer: a layer's shard is sized for the step's worst case (classic EP:
every entry of the group on one rank), and a grid sized from it launched mostly programs that
found no tile and returned (on the H200 at Kimi-K2, s = 128, about 90 us of a rank's experts for
the tens of thousands of such programs of an auto shard).

A launch may cover a second set of weights of the same shape and format (a layer's borrow slots,
``slots=`` with ``slot_base=``): groups ``G ..`` read it and start at row ``slot_base`` rather than
where the previous group ends, so a rank's home experts and its slots share each launch.

Tiles are numbered group by group and, within a group, in bands of ``group_m`` row tiles
(:mod:`flatep.kernels.grouped_tiles`); :mod:`flatep.kernels.packed_tiles` chooses the tiles.

- fp8 (:func:`fp8_grouped_mm_triton`): the rows are first quantized per token per 128 columns
  (``scale = max(amax, 1e-10) / 448``, e4m3 rounded to nearest and saturated), as DeepSeek-V3 runs
  its FP8 experts; the GEMM then multiplies e4m3 tiles (the tensor cores sum within a K step, fp32
  registers across steps: see ``GemmConfig.rescale``, :mod:`flatep.kernels.packed_tiles`, on
  their precision) and applies the row's
  activation scale and the column's weight block scale per 128-wide K step. A tile's columns lie in
  one 128-column scale block (``block_n`` divides 128), so the weight scale is one scalar per step
  and folds into the row scales: one FMA per output element and step (a local sm_90 compile of the
  128 x 128 tile: 203 instructions per K step against 314 with a weight scale per column, most of
  the difference per-column scale loads and their predicates). The scales of each step are loaded
  one step ahead: Triton pipelines only the loads that feed the MMA, and in a local sm_90 compile
  the row and weight scale loads were issued in their own step and waited for right after its MMA
  (the weight scale a miss to memory, as no other tile reads it); loaded ahead, a whole step hides
  them (on an H100, against the kernel before, in one run: Kimi-K2 experts at s = 8192 0.992x bf16
  against 1.035x; at decode within 2%, no gain a single run can separate from noise;
  bench/results/2026-12-06-h100). Each step's product waits for its warp-group MMA before it is
  scaled (Triton 3.6 waits for a ``tl.dot`` whose result feeds anything but the next dot's
  accumulator right after issuing it: scaling the previous step's product after issuing this step's,
  or two 64-row halves as two dots, still compiled to a wait for no outstanding MMA after each, in
  local sm_90 compiles), and it takes registers of its own beside the accumulator: tiles taller than
  64 x 128 on 4 warps (254 registers a thread in a local sm_90 compile, Triton 3.6) or 128 x 128 on
  8 (248) do not fit. ``GemmConfig.rescale`` instead scales the accumulator into the step's units
  and lets the MMA add in place (one accumulator: 256 x 128 on 8 warps in 249 registers), for tiles
  that load fewer bytes per product at prefill sizes; a tile-sweep candidate. On Hopper GPUs
  ``GemmConfig.wgmma`` runs a Gluon kernel instead (:mod:`flatep.kernels.fp8_wgmma`), which does
  overlap the scaling with the next MMA: :func:`flatep.kernels.packed_tiles.default_config`
  takes it from :data:`flatep.kernels.packed_tiles.WGMMA_ROWS` rows per group.
- mxfp4 (:func:`mxfp4_grouped_mm_triton`): reads the packed values as int32 words (8 columns each,
  in FlatEP's word layout) and their e8m0 scales, and decodes them in registers into bf16, exactly
  (e2m1 times a power of two), for bf16 tensor-core dots (:mod:`flatep.kernels.mxfp4_decode`: two
  weights an instruction, and one packed bf16x2 multiply by the block's scale per pair). That one
  multiply is exact only up to scale byte 128 (weights up to 12, which real checkpoints stay well
  under): a tile that reads a byte past 128 sets a flag (each thread keeps the largest byte it read:
  one integer maximum per scale value), and a second launch, which returns at once while the flag is
  clear, computes the launch's tiles again with two multiplies per pair, exact at every byte. The
  flag follows the scale bytes, not the products: the padding rows of a layer's shard are never
  written (:mod:`flatep.kernels.dispatch`) and may hold NaN, which makes their own products
  non-finite; a flag on non-finite products sent such steps through both passes, twice the time
  (Kimi-K3 experts phase on an H200, bench/results/2026-12-05-f). Short tiles run the dot over K in
  the order the words decode to and permute the activations alike as they are loaded (in
  registers); tall unswapped tiles (a warp-group MMA, whose weight operand goes through shared
  memory anyway) put the decoded weights back in column order and take the activations as they are
  (local sm_90 compile of the 128-row tile's K step: 196 instructions in 153 registers a thread,
  against 246 in 211 with permuted activations). The scales may lie in any strides. Pools hold them
  column-fastest (:func:`flatep.quant.columns_fastest`): a K step's scales of a tile's columns are
  then contiguous bytes, which Triton copies asynchronously in the software pipeline with the words.
  In the checkpoint's order a step takes a few bytes per column, too few for an asynchronous copy (4
  bytes at least), and the decode, which needs them before the step's dot, waits on a synchronous
  global load and a shared-memory exchange each step (local sm_90 compile, Triton 3.6 and 3.9: the
  16- and 32-row default tiles then hold no synchronous load in their K loop; the 64-row tile, with
  2 scale bytes a thread, keeps one). On Hopper GPUs unswapped tiles copy the rows, the words and
  column-fastest scales by tensor descriptor (TMA, :func:`_mxfp4_descriptors`): one thread issues a
  step's copies, where the pointer copies (``cp.async``) kept addresses in every thread's registers
  until each copy had read them. In Nsight Compute on an H100 those registers' reuse held 13-17% of
  the short tiles' warp stalls (bench/results/2026-12-06-h100-d); with descriptors the 16-row tile
  takes 142 registers instead of 168 and 26-28% less time, the 32-row tile in the lane order 198
  instead of 214 and 10-11% less (bench/results/2026-12-06-h100-e). Other inputs (scales in the
  checkpoint's order, unaligned rows, older GPUs) keep the pointer copies, with the same bits. On
  Hopper GPUs groups of 17-32 rows run a swapped Gluon kernel by default
  (:mod:`flatep.kernels.mxfp4_swap`), and groups of more than 32 rows can run a warp-specialized
  one (:mod:`flatep.kernels.mxfp4_wgmma`; opt-in, as it is slower than the Triton tile): the same
  decode and passes (``GemmConfig.wgmma``; :mod:`flatep.kernels.packed_tiles` says when each runs).
  ``tl.dot_scaled`` (bf16 times e2m1) would be the alternative; on Hopper Triton 3.6 upcasts its
  e2m1 operand itself and measured no faster, and its interpreter has no ``dot_scaled``.

``K`` is a compile-time constant of the GEMM kernels (one compilation per layer shape): the K loop
stays a ``for`` loop over constant bounds, which Triton software-pipelines (``num_stages``; it does
not pipeline ``while`` loops) and Triton 3.6's interpreter runs (it takes no tensor as a ``range``
bound, and kernel arguments are tensors there).

Under ``TRITON_INTERPRET=1`` the operands are upcast to fp32 before the dots and results are rounded
to the bf16 / e4m3 grids before the casts (the interpreter's low-precision arithmetic and casts are
not the hardware's: it truncates); the products are exact either way. The outputs are bf16.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import interpreting, tma_fits
from flatep.kernels import fp8_wgmma, mxfp4_fp8mma, mxfp4_swap, mxfp4_wgmma
from flatep.kernels.e2m1_ptx import ONE_MULTIPLY_MAX_BYTE
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.fp8_split import split_rows_triton
from flatep.kernels.grouped_checks import check_group_rows, check_groups, check_rows_and_values, output_for
from flatep.kernels.grouped_tiles import locate_tile, persistent_grid, store_tile, tile_dot, tile_table
from flatep.kernels.mxfp4_decode import decoded_tile, lane_word_order, mma_decoded_tile
from flatep.kernels.packed_tiles import (
    FP8_TALL,
    FP8MMA,
    MXFP4_SHORT,
    MXFP4_TALL,
    GemmConfig,
    check_layout,
    default_config,
)
from flatep.quant.fp8 import FP8_BLOCK

_ONE_MULTIPLY_MAX_BYTE = tl.constexpr(ONE_MULTIPLY_MAX_BYTE)


@triton.jit
def _fp8_grouped_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, slot_w_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups, split,
    split_start, N, stride_om, stride_am, stride_as, rows_above, rows_at_most,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    GROUPS: tl.constexpr, SWAP_AB: tl.constexpr, RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Groups ``[0, split)`` read ``w``, groups ``[split, groups)`` read ``slot_w`` from row ``split_start``."""
    starts, ends, tiles, passed, total = tile_table(offsets_ptr, groups, split, split_start, N, rows_above,
                                                    rows_at_most, BLOCK_M, BLOCK_N, GROUPS)
    tile = tl.program_id(0)
    while tile < total:
        group, first, last, first_column = locate_tile(tile, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N, GROUP_M, GROUPS)
        # One call of the tile with the group's weights chosen (not one call per branch: the tile's
        # code inlined once).
        expert, weights, weight_scales = group, w_ptr, w_scale_ptr
        if group >= split:
            expert, weights, weight_scales = group - split, slot_w_ptr, slot_w_scale_ptr
        _fp8_tile(a_ptr, a_scale_ptr, weights, weight_scales, out_ptr, expert, first, last, first_column, N, stride_om,
                  stride_am, stride_as, K, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, RESCALE, INTERPRET)
        tile += tl.num_programs(0)


@triton.jit
def _fp8_tile(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, group, first, last, first_column, N, stride_om, stride_am, stride_as,
    K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
    RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Rows ``[first, min(first + BLOCK_M, last))`` times columns ``[first_column, + BLOCK_N)`` of
    expert ``group`` of the weights at ``w_ptr`` (scales at ``w_scale_ptr``)."""
    k_blocks: tl.constexpr = K // BLOCK_K
    n_blocks = tl.cdiv(N, BLOCK_K)
    row = first + tl.arange(0, BLOCK_M)
    row_mask = row < last
    column = first_column + tl.arange(0, BLOCK_N)
    column_mask = column < N
    inner = tl.arange(0, BLOCK_K)
    expert = group.to(tl.int64)
    # Both operands K-contiguous (the fp8 tensor-core MMA takes them K-major). A group's weights
    # exceed 2**31 bytes at real sizes: offsets in int64.
    a_tile = a_ptr + row.to(tl.int64)[:, None] * stride_am + inner[None, :]
    w_tile = w_ptr + expert * N * K + column.to(tl.int64)[:, None] * K + inner[None, :]
    a_scales = a_scale_ptr + row.to(tl.int64) * stride_as
    # BLOCK_N divides 128 and first_column is a multiple of it: the tile's columns share one
    # weight scale block, so each K step takes one scalar weight scale (one uniform load, and one
    # FMA per output element with the row scales folded in).
    w_scales = w_scale_ptr + expert * n_blocks * k_blocks + (first_column // BLOCK_K) * k_blocks
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if RESCALE:
        previous = tl.full([BLOCK_M], 1.0, tl.float32)  # the scales acc is in units of
    # Each step's scales are loaded a step ahead. Triton pipelines only the loads that feed the
    # MMA; loaded in their own step, these plain loads (the weight scale a miss to memory: no
    # other tile reads it) would be waited for right after the step's MMA, every step.
    next_a_scale = tl.load(a_scales, mask=row_mask, other=1.0)
    next_w_scale = tl.load(w_scales)
    for step in range(0, k_blocks):
        a = tl.load(a_tile + step * BLOCK_K, mask=row_mask[:, None], other=0.0)
        w = tl.load(w_tile + step * BLOCK_K, mask=column_mask[:, None], other=0.0)
        # One K step is one scale block of both operands: scale the block's partial product.
        scale = next_a_scale * next_w_scale
        ahead = tl.minimum(step + 1, k_blocks - 1)  # the last step loads its own again, unused
        next_a_scale = tl.load(a_scales + ahead, mask=row_mask, other=1.0)
        next_w_scale = tl.load(w_scales + ahead)
        if RESCALE:
            # acc * previous is the sum so far: in units of this step's scales it is acc * ratio,
            # and the MMA adds the step's product to it in place.
            ratio = previous / scale
            previous = scale
            if SWAP_AB:
                acc = tile_dot(a, w, SWAP_AB, INTERPRET, acc * ratio[None, :])
            else:
                acc = tile_dot(a, w, SWAP_AB, INTERPRET, acc * ratio[:, None])
        else:
            product = tile_dot(a, w, SWAP_AB, INTERPRET)
            if SWAP_AB:
                acc += product * scale[None, :]
            else:
                acc += product * scale[:, None]
    if RESCALE:
        if SWAP_AB:
            acc = acc * previous[None, :]
        else:
            acc = acc * previous[:, None]
    store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB, INTERPRET)


@triton.jit
def _mxfp4_grouped_kernel(
    a_src, w_src, s_src, slot_w_src, slot_s_src, out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N,
    stride_am, stride_om, stride_se, stride_sn, stride_sk, rows_above, rows_at_most, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GROUPS: tl.constexpr,
    SWAP_AB: tl.constexpr, NATURAL_K: tl.constexpr, LANE_WORDS: tl.constexpr, ONE_MULTIPLY: tl.constexpr,
    TMA: tl.constexpr, INTERPRET: tl.constexpr, MMA: tl.constexpr,
):
    """Groups ``[0, split)`` read ``w`` and ``s``, groups ``[split, groups)`` read ``slot_w`` and
    ``slot_s`` from row ``split_start``: pointers, or with ``TMA`` tensor descriptors (the rows
    ``[M, K]``, the words ``[G, N, K/8]`` and the scales ``[G, K/32, N]``; see
    :func:`_mxfp4_descriptors`). ``ONE_MULTIPLY``: the first pass, which sets ``redo_ptr[0]`` to 1
    where a tile reads a scale byte past 128; else the second pass, which computes every tile again
    if ``redo_ptr[0]`` is set and none otherwise (see :func:`mxfp4_grouped_mm_triton`), or with
    ``MMA`` only the tiles over a group's 128 columns that the fp8 kernel flagged (its flags, from
    ``redo_ptr[1]``: :func:`flatep.kernels.mxfp4_fp8mma.mxfp4_fp8mma_launch`)."""
    starts, ends, tiles, passed, total = tile_table(offsets_ptr, groups, split, split_start, N, rows_above,
                                                    rows_at_most, BLOCK_M, BLOCK_N, GROUPS)
    tile = tl.program_id(0)
    if not ONE_MULTIPLY:
        if tl.load(redo_ptr) == 0:
            tile = total
    while tile < total:
        group, first, last, first_column = locate_tile(tile, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N, GROUP_M, GROUPS)
        compute = True
        if MMA:  # the tiles over a group's flagged 128 columns, no others
            SPAN: tl.constexpr = (BLOCK_N + _FP8MMA_COLUMNS - 1) // _FP8MMA_COLUMNS
            blocks = tl.cdiv(N, _FP8MMA_COLUMNS)
            block = first_column // _FP8MMA_COLUMNS + tl.arange(0, SPAN)
            flags = tl.load(redo_ptr + 1 + group * blocks + block, mask=block < blocks, other=0)
            compute = tl.max(flags, axis=0) != 0
        if compute:
            if TMA:  # a descriptor is not a value that a branch can choose: one call per weight set
                if group < split:
                    _mxfp4_tile(a_src, w_src, s_src, out_ptr, redo_ptr, group, first, last, first_column, N,
                                stride_am, stride_om, stride_se, stride_sn, stride_sk, K, BLOCK_M, BLOCK_N, BLOCK_K,
                                SWAP_AB, NATURAL_K, LANE_WORDS, ONE_MULTIPLY, TMA, INTERPRET, MMA)
                else:
                    _mxfp4_tile(a_src, slot_w_src, slot_s_src, out_ptr, redo_ptr, group - split, first, last,
                                first_column, N, stride_am, stride_om, stride_se, stride_sn, stride_sk, K, BLOCK_M,
                                BLOCK_N, BLOCK_K, SWAP_AB, NATURAL_K, LANE_WORDS, ONE_MULTIPLY, TMA, INTERPRET, MMA)
            else:
                expert, words, exponents = group, w_src, s_src  # the group's weights, as in _fp8_grouped_kernel
                if group >= split:
                    expert, words, exponents = group - split, slot_w_src, slot_s_src
                _mxfp4_tile(a_src, words, exponents, out_ptr, redo_ptr, expert, first, last, first_column, N,
                            stride_am, stride_om, stride_se, stride_sn, stride_sk, K, BLOCK_M, BLOCK_N, BLOCK_K,
                            SWAP_AB, NATURAL_K, LANE_WORDS, ONE_MULTIPLY, TMA, INTERPRET, MMA)
        tile += tl.num_programs(0)


_FP8MMA_COLUMNS = tl.constexpr(mxfp4_fp8mma.BLOCK_N)
@triton.jit
def _mxfp4_tile(
    a_src, w_src, s_src, out_ptr, redo_ptr, group, first, last, first_column, N, stride_am, stride_om, stride_se,
    stride_sn, stride_sk, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, NATURAL_K: tl.constexpr,
    LANE_WORDS: tl.constexpr, ONE_MULTIPLY: tl.constexpr, TMA: tl.constexpr, INTERPRET: tl.constexpr,
    MMA: tl.constexpr,
):
    """Rows ``[first, min(first + BLOCK_M, last))`` times columns ``[first_column, + BLOCK_N)`` of ``group``;
    ``w_src`` is the packed values read as int32 words (8 nibbles each), by pointer or (``TMA``) by
    descriptor, as are the rows ``a_src`` and the scales ``s_src``. The weights are decoded with one
    multiply per pair (``ONE_MULTIPLY``, which sets ``redo_ptr[0]`` to 1 if the tile reads a scale
    byte past 128) or two (see :func:`flatep.kernels.mxfp4_decode.decoded_tile`); with ``MMA`` the
    words are in the ``mma`` layout, decoded exactly in column order
    (:func:`flatep.kernels.mxfp4_decode.mma_decoded_tile`; ``NATURAL_K`` set, ``ONE_MULTIPLY`` and
    ``LANE_WORDS`` not)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    words_k = K // 8
    scales_k = K // 32
    row = first + tl.arange(0, BLOCK_M)
    row_mask = row < last
    column = first_column + tl.arange(0, BLOCK_N)
    column_mask = column < N
    inner = tl.arange(0, BLOCK_K)
    word = tl.arange(0, WORDS)
    block = tl.arange(0, BLOCKS)
    if not TMA:
        expert = group.to(tl.int64)
        a_tile = a_src + row.to(tl.int64)[:, None] * stride_am + inner[None, :]
        w_tile = w_src + expert * N * words_k + column.to(tl.int64)[:, None] * words_k + word[None, :]
        # Scales in any strides; with the columns' stride 1 (pools hold them so) a step's scales of the
        # tile's columns are contiguous bytes, which Triton loads asynchronously in the pipeline with the
        # words. With the checkpoint's order (a column's blocks contiguous) a step takes a few bytes per
        # column, too few for an asynchronous copy: a synchronous load that the step's decode waits for.
        s_tile = s_src + expert * stride_se + column.to(tl.int64)[:, None] * stride_sn + block[None, :] * stride_sk
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    largest = tl.zeros([BLOCK_N, BLOCKS], dtype=tl.int32)  # the largest scale byte read, per position
    for k in range(0, K, BLOCK_K):
        # K is a multiple of 32, not necessarily of BLOCK_K: the last step may be partial.
        if TMA:  # out-of-bounds rows and K columns read as zeros; the rows of the next group are not stored
            a = a_src.load([first, k])
        else:
            a = tl.load(a_tile + k, mask=row_mask[:, None] & (k + inner < K)[None, :], other=0.0)
        # A word decodes to columns 0 4 1 5 2 6 3 7. Short tiles (mma.sync) run the dot over K in that
        # order (LANE_WORDS: with the step's words in lane_word_order's order, in which a lane's words
        # share scale blocks) and permute the activations alike (in registers, as they are loaded: the
        # permutation builds the MMA's operand registers, which an unpermuted load would copy into place
        # instead). Tall unswapped tiles (NATURAL_K: a warp-group MMA, whose weight operand goes through
        # shared memory anyway) put the decoded weights back in column order instead, and the
        # activations go to the MMA from shared memory as they are.
        if LANE_WORDS:
            a = lane_word_order(a, BLOCK_M, WORDS, 8)
        if not NATURAL_K:
            a = tl.reshape(tl.permute(tl.reshape(a, [BLOCK_M, WORDS, 2, 4]), (0, 1, 3, 2)), [BLOCK_M, BLOCK_K])
        if TMA:
            words = tl.reshape(w_src.load([group, first_column, k // 8]), [BLOCK_N, WORDS])
            exponent = tl.trans(tl.reshape(s_src.load([group, k // 32, first_column]), [BLOCKS, BLOCK_N]))
        else:
            words = tl.load(w_tile + k // 8, mask=column_mask[:, None] & (k // 8 + word < words_k)[None, :], other=0)
            exponent = tl.load(s_tile + (k // 32) * stride_sk,
                               mask=column_mask[:, None] & (k // 32 + block < scales_k)[None, :], other=0)
        if LANE_WORDS:
            words = lane_word_order(words, BLOCK_N, WORDS, 1)
        exponent = exponent.to(tl.int32)
        if ONE_MULTIPLY:
            largest = tl.maximum(largest, exponent)
        if MMA:
            w = mma_decoded_tile(words, exponent, BLOCK_N, BLOCK_K, INTERPRET)
        else:
            w = decoded_tile(words, exponent, BLOCK_N, BLOCK_K, NATURAL_K, INTERPRET, ONE_MULTIPLY, LANE_WORDS)
        acc += tile_dot(a, w, SWAP_AB, INTERPRET)
    # A block with a scale byte past 128 decodes to +-inf or NaN in the one-multiply pass: the flag
    # has the second pass compute the tile again. The flag follows the scale bytes, not the
    # products: padding rows, which dispatch leaves unwritten (NaN included), make their own
    # products non-finite, and would otherwise send every step through both passes.
    if ONE_MULTIPLY:
        if tl.max(largest) > _ONE_MULTIPLY_MAX_BYTE:
            tl.store(redo_ptr, 1)
    store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB, INTERPRET)


def _check_wgmma(config: GemmConfig, device: torch.device) -> None:
    fixed = (fp8_wgmma.BLOCK_M, fp8_wgmma.BLOCK_N, fp8_wgmma.NUM_WARPS)
    if (config.block_m, config.block_n, config.num_warps) != fixed or config.swap_ab or config.rescale:
        raise ValueError(f"a wgmma config takes block_m, block_n, num_warps = {fixed}, unswapped and not rescaled, "
                         f"got {config}")
    if not 5 <= config.num_stages <= 6:
        # 5 and 6 were timed (6 slower for gate/up on an H100) and compile without spills or
        # serialized MMAs (tests/kernels/test_fp8_wgmma.py); 7 would not fit the SM's 227 KiB of
        # shared memory beside the output tiles. Fewer have not run since the kernel was
        # warp-specialized (before, 3 and 4 ran its registers out).
        raise ValueError(f"a wgmma config's num_stages (32 KiB of shared memory each) must be 5 or 6, got "
                         f"{config.num_stages}")
    _check_hopper(device)


def _check_hopper(device: torch.device) -> None:
    if not fp8_wgmma.available(device):
        raise ValueError(f"a wgmma config needs a Hopper (sm_90) CUDA GPU and Triton's Gluon, got {device}")


def _check_mxfp4_wgmma(config: GemmConfig, device: torch.device) -> None:
    """A Gluon mxfp4 config: one of the swapped kernel's tiles (16, 32 or 64 rows,
    :data:`flatep.kernels.packed_tiles.MXFP4_SWAP`) or the unswapped warp-specialized one's
    (:data:`flatep.kernels.packed_tiles.MXFP4_WGMMA`), on a Hopper GPU."""
    kernel, name, heights = ((mxfp4_swap, "a swapped mxfp4 wgmma config", mxfp4_swap.BLOCK_M) if config.swap_ab
                             else (mxfp4_wgmma, "an mxfp4 wgmma config", (mxfp4_wgmma.WG_M, )))
    fixed = (kernel.BLOCK_N, kernel.BLOCK_K, kernel.NUM_WARPS)
    if config.block_m not in heights or (config.block_n, config.block_k, config.num_warps) != fixed \
            or config.lane_words:
        raise ValueError(f"{name} takes block_m in {heights} and block_n, block_k, num_warps = {fixed}, in column "
                         f"order (no lane_words), got {config}")
    if config.num_stages not in kernel.STAGES:
        raise ValueError(f"{name}'s num_stages (its copies' ring) must be one of {list(kernel.STAGES)}, got "
                         f"{config.num_stages}")
    _check_hopper(device)


def fp8_grouped_mm_triton(
    rows: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    config: GemmConfig | None = None,
    out: torch.Tensor | None = None,
    activations: tuple[torch.Tensor, torch.Tensor] | None = None,
    group_rows: tuple[int, int] | None = None,
    *,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_base: int = 0,
) -> torch.Tensor:
    """``out[i] = q(rows[i]) @ W[g(i)].T`` with fp8 block-scaled ``W`` and per-token-group quantized rows.

    Args:
        rows: ``[M, K]`` bf16 (unit column stride), ``K`` a multiple of 128.
        values: ``[G, N, K]`` float8_e4m3fn, contiguous.
        scales: ``[G, ceil(N/128), K/128]`` float32, contiguous.
        offsets: ``[G]`` int32 inclusive end row of each group.
        config: tiles (default :func:`flatep.kernels.packed_tiles.default_config`); ``block_k`` must
            be 128.
        out: optional ``[M, N]`` bf16 (unit column stride) to write into; default a new tensor.
        activations: optional ``q(rows)`` already made: ``(values [M, K] float8_e4m3fn, scales
            [M, K/128] float32)``, each with unit column stride (any row stride: e.g. the views of
            packed fp8 dispatch rows, :mod:`flatep.kernels.fp8_rows`); ``rows`` is then not read.
        group_rows: ``(rows_above, rows_at_most)``: compute only the groups holding more than
            ``rows_above`` and at most ``rows_at_most`` rows (None: every group; see
            :func:`flatep.kernels.packed_tiles.packed_launches`).
        slots: optional ``(values [G2, N, K], scales [G2, ceil(N/128), K/128])``, a second set of
            experts (a layer's borrow slots) for groups ``G .. G+G2-1`` (``offsets`` then holds
            ``G+G2`` ends), whose rows start at row ``slot_base``: both sets in one launch.
        slot_base: first row of group ``G`` (with ``slots``).

    Returns:
        ``out`` or a new ``[M, N]`` bf16 tensor; rows at and past ``offsets[-1]``, and the rows of
        groups outside ``group_rows``, are not written.
    """
    check_rows_and_values(rows, values)
    groups, columns, inner = values.shape
    if values.dtype != torch.float8_e4m3fn or inner != rows.shape[1] or inner % FP8_BLOCK:
        raise ValueError(f"values must be [G, N, K={rows.shape[1]}] float8_e4m3fn with K a multiple of 128, got "
                         f"{values.dtype} {list(values.shape)}")
    expected = (groups, triton.cdiv(columns, FP8_BLOCK), inner // FP8_BLOCK)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous {list(expected)} float32 tensor, got {scales.dtype} {list(scales.shape)}")
    slot_values, slot_scales = check_groups(rows, values, scales, offsets, slots, slot_base)
    groups = offsets.shape[0]
    config = config or default_config(rows.shape[0], groups, "fp8", rows.device)
    if config.block_k != FP8_BLOCK:
        raise ValueError(f"fp8 block_k must be {FP8_BLOCK} (one scale block), got {config.block_k}")
    if config.block_n > FP8_BLOCK or FP8_BLOCK % config.block_n:
        raise ValueError(f"fp8 block_n must divide {FP8_BLOCK} (one weight scale block per tile), got {config.block_n}")
    if config.lane_words:
        raise ValueError(f"lane_words is an mxfp4 tile option (fp8 has no words to reorder), got {config}")
    if config.wgmma:
        _check_wgmma(config, rows.device)
    rows_above, rows_at_most = check_group_rows(group_rows)
    out = output_for(rows, columns, out)
    if activations is None:
        quantized, row_scales = quantize_fp8_activations_triton(rows, offsets[-1:])
    else:
        quantized, row_scales = activations
        if (quantized.dtype != torch.float8_e4m3fn or tuple(quantized.shape) != tuple(rows.shape)
                or row_scales.dtype != torch.float32 or tuple(row_scales.shape) != (rows.shape[0], inner // FP8_BLOCK)
                or quantized.stride(1) != 1 or row_scales.stride(1) != 1):
            raise ValueError(f"activations must be [M, K] float8_e4m3fn and [M, K/128] float32 with unit column "
                             f"strides for rows {list(rows.shape)}, got {quantized.dtype} {list(quantized.shape)} and "
                             f"{row_scales.dtype} {list(row_scales.shape)}")
    if config.wgmma and slot_values.numel() == 0:  # no slot groups: the kernel never reads the slot set
        slot_values, slot_scales = values, scales
    if config.wgmma and not (fp8_wgmma.descriptors_fit(quantized, values, out)
                             and fp8_wgmma.descriptors_fit(quantized, slot_values, out)
                             and inner // FP8_BLOCK >= config.num_stages):
        config = dataclasses.replace(FP8_TALL, group_m=config.group_m)
    programs = persistent_grid(rows.shape[0], groups, columns, config, rows.device)
    if config.wgmma:
        fp8_wgmma.fp8_wgmma_launch(quantized, row_scales, values, scales, slot_values, slot_scales, out, offsets,
                                   values.shape[0], slot_base, rows_above, rows_at_most, config.group_m,
                                   config.num_stages, programs[0])
        return out
    _fp8_grouped_kernel[programs](
        quantized, row_scales, values, scales, slot_values, slot_scales, out, offsets, groups, values.shape[0],
        slot_base, columns, out.stride(0), quantized.stride(0), row_scales.stride(0), rows_above, rows_at_most, inner,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=FP8_BLOCK, GROUP_M=config.group_m,
        GROUPS=triton.next_power_of_2(groups), SWAP_AB=config.swap_ab, RESCALE=config.rescale,
        INTERPRET=interpreting(),
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers,
    )
    return out


def mxfp4_grouped_mm_triton(
    rows: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor,
    config: GemmConfig | None = None,
    out: torch.Tensor | None = None,
    group_rows: tuple[int, int] | None = None,
    *,
    slots: tuple[torch.Tensor, torch.Tensor] | None = None,
    slot_base: int = 0,
    layout: str = "words",
    fp8_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``out[i] = rows[i] @ W[g(i)].T`` with mxfp4 ``W`` decoded in registers.

    Two launches: the first decodes with one multiply per pair of weights and flags (in a
    one-element device tensor) any tile that reads a scale byte past 128, whose one-multiply
    products are then not finite (rows that hold NaN, such as a shard's unwritten padding rows, do
    not flag it); the second returns at once unless flagged, and then computes every tile again
    with two multiplies per pair, exact at any scale (see :mod:`flatep.kernels.mxfp4_decode`). Both read the flag
    on the device: nothing syncs with the host.

    With ``layout="mma"`` (pools made with :data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`) and a
    :data:`flatep.kernels.packed_tiles.FP8MMA` config (on a Hopper GPU) the first launch is
    :mod:`flatep.kernels.mxfp4_fp8mma`'s, on the rows split into two e4m3 parts
    (:mod:`flatep.kernels.fp8_split`), which flags each group's 128 columns whose tiles read a scale
    byte outside its window (:data:`flatep.kernels.mxfp4_fp8mma.LOW` to ``HIGH``); the second is a
    Triton tile of the same height that decodes that layout exactly into bf16
    (:func:`flatep.kernels.mxfp4_decode.mma_decoded_tile`), on the rows as they are, and computes
    those flagged tiles alone (where ``N`` is not a multiple of 128, always the last 128 columns).
    ``K`` not a multiple of 128 takes K steps of 64. Any other config, or operands the fp8 kernel's
    copies cannot take, runs that exact tile alone.

    Args:
        rows: ``[M, K]`` bf16 (unit column stride), ``K`` a multiple of 32.
        values: ``[G, N, K/2]`` uint8 in FlatEP's word layout (the values of a
            ``QuantizedTensor`` with ``layout="words"``, as pools hold them;
            :func:`flatep.quant.mxfp4.to_word_layout` of checkpoint-order values), contiguous.
        scales: ``[G, N, K/32]`` uint8 e8m0, in any strides. Stored column-fastest (``stride(1) ==
            1``, as pools and ``QuantizedTensor.in_layout("words")`` hold them) they load
            asynchronously in the kernel's pipeline; in the checkpoint's order each K step waits
            for a synchronous load of a few bytes per column.
        offsets: ``[G]`` int32 inclusive end row of each group.
        config: tiles (default :func:`flatep.kernels.packed_tiles.default_config`); ``block_k`` a power
            of two, at least 32.
        out: optional ``[M, N]`` bf16 (unit column stride) to write into; default a new tensor.
        group_rows: compute only the groups of more than ``group_rows[0]`` and at most
            ``group_rows[1]`` rows (see :func:`fp8_grouped_mm_triton`).
        slots, slot_base: a second set of experts, ``(values [G2, N, K/2], scales [G2, N, K/32])``
            in the same layout (scales in the same strides), whose groups start at row
            ``slot_base`` (see :func:`fp8_grouped_mm_triton`).
        layout: ``values``' (and the slots') layout: ``words`` or ``mma`` (see above).
        fp8_rows: ``mma`` only: the rows already split, ``(hi_lo [2M, K] float8_e4m3fn, factor [M]
            float32)`` (:func:`flatep.kernels.fp8_split.split_rows_triton` with
            :data:`flatep.kernels.mxfp4_fp8mma.CENTER`), shared by a GEMM's launches; default: split
            here, over the rows before ``offsets[-1]`` (and not between the home and slot groups).

    Returns:
        ``out`` or a new ``[M, N]`` bf16 tensor; rows at and past ``offsets[-1]``, and the rows of
        groups outside ``group_rows``, are not written.
    """
    check_rows_and_values(rows, values)
    check_layout(layout, "mxfp4", ("words", "mma"))
    groups, columns, half = values.shape
    inner = rows.shape[1]
    if values.dtype != torch.uint8 or 2 * half != inner or inner % 32:
        raise ValueError(f"values must be [G, N, K/2={inner // 2}] uint8 with K a multiple of 32, got {values.dtype} "
                         f"{list(values.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (groups, columns, inner // 32):
        raise ValueError(f"scales must be a [{groups}, {columns}, {inner // 32}] uint8 tensor, got "
                         f"{scales.dtype} {list(scales.shape)}")
    slot_values, slot_scales = check_groups(rows, values, scales, offsets, slots, slot_base)
    groups = offsets.shape[0]
    config = config or default_config(rows.shape[0], groups, "mxfp4", rows.device, layout)
    if config.block_k < 32 or config.block_k & (config.block_k - 1):
        raise ValueError(f"mxfp4 block_k must be a power of two, at least 32, got {config.block_k}")
    if config.rescale:
        raise ValueError(f"rescale is an fp8 tile option (mxfp4 has no per-step scales of the product), got {config}")
    if layout == "mma":
        return _mxfp4_mma_grouped_mm(rows, values, scales, offsets, config, output_for(rows, columns, out),
                                     check_group_rows(group_rows), slot_values, slot_scales, slot_base, fp8_rows)
    if fp8_rows is not None:
        raise ValueError("fp8_rows are the rows split for the mma layout; words take the rows as they are")
    if config.wgmma:
        _check_mxfp4_wgmma(config, rows.device)
    natural_k = not config.swap_ab and config.block_m >= 64
    if config.lane_words and (natural_k or config.block_k < 64):
        raise ValueError(f"lane_words needs a tile whose weights are a register operand (block_m below 64, or "
                         f"swap_ab) and block_k of 64 or more (one 32-column chunk a step has one order), got {config}")
    rows_above, rows_at_most = check_group_rows(group_rows)
    out = output_for(rows, columns, out)
    if config.wgmma:
        if slot_values.numel() == 0:  # no slot groups: the kernel never reads the slot set
            slot_values, slot_scales = values, scales
        if mxfp4_wgmma.fits(rows, values, scales, out) and mxfp4_wgmma.fits(rows, slot_values, slot_scales, out):
            programs = persistent_grid(rows.shape[0], groups, columns, config, rows.device)[0]
            if config.swap_ab:
                mxfp4_swap.mxfp4_swap_launch(rows, values, scales, slot_values, slot_scales, out, offsets,
                                             values.shape[0], slot_base, rows_above, rows_at_most, config.block_m,
                                             config.group_m, config.num_stages, programs, config.programs_per_sm)
            else:
                mxfp4_wgmma.mxfp4_wgmma_launch(rows, values, scales, slot_values, slot_scales, out, offsets,
                                               values.shape[0], slot_base, rows_above, rows_at_most, config.group_m,
                                               config.num_stages, programs)
            return out
        if config.block_m in MXFP4_SHORT:  # the Triton short tile of the same height
            config = dataclasses.replace(MXFP4_SHORT[config.block_m], group_m=config.group_m)
        else:
            config = dataclasses.replace(MXFP4_TALL, group_m=config.group_m)
            natural_k = True
    # Two passes (see the module docstring): the second computes the tiles again, with two
    # multiplies per pair, only if the first flagged a tile that read a scale byte past 128.
    redo = torch.zeros(1, dtype=torch.int32, device=rows.device)
    grid = persistent_grid(rows.shape[0], groups, columns, config, rows.device)
    descriptors = _mxfp4_descriptors(rows, values, scales, slot_values, slot_scales, config)
    # K/2 is a multiple of 16 bytes: int32 words.
    sources = descriptors or (rows, values.view(torch.int32), scales, slot_values.view(torch.int32), slot_scales)
    for one_multiply in (True, False):
        _mxfp4_grouped_kernel[grid](
            *sources, out, offsets, redo, groups, values.shape[0], slot_base, columns, rows.stride(0), out.stride(0),
            *scales.stride(), rows_above, rows_at_most, inner,
            BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
            GROUPS=triton.next_power_of_2(groups), SWAP_AB=config.swap_ab, NATURAL_K=natural_k,
            LANE_WORDS=config.lane_words, ONE_MULTIPLY=one_multiply, TMA=descriptors is not None,
            INTERPRET=interpreting(), MMA=False,
            num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers,
        )
    return out


def _mxfp4_mma_grouped_mm(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, config: GemmConfig,
    out: torch.Tensor, group_rows: tuple[int, int], slot_values: torch.Tensor, slot_scales: torch.Tensor,
    slot_base: int, fp8_rows: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """:func:`mxfp4_grouped_mm_triton` on checked operands in the ``mma`` layout: the fp8 kernel's pass
    where ``config`` is one of :data:`flatep.kernels.packed_tiles.FP8MMA` and its copies take the
    operands, then the exact Triton pass (every tile if the fp8 pass did not run, else only the tiles
    it flagged)."""
    groups, columns = offsets.shape[0], values.shape[1]
    rows_above, rows_at_most = group_rows
    exact = GemmConfig(config.block_m, 128, 64, num_warps=4, num_stages=3, group_m=config.group_m)
    fp8_pass = False
    if config.wgmma:
        if config not in FP8MMA.values():
            raise ValueError(f"an mma-layout wgmma config must be one of FP8MMA's, got {config}")
        _check_hopper(rows.device)
        if fp8_rows is None:
            skip = (offsets[values.shape[0] - 1:values.shape[0]], slot_base) if slot_values.shape[0] else None
            fp8_rows = split_rows_triton(rows, mxfp4_fp8mma.CENTER, offsets[-1:], skip)
        hi_lo, factor = fp8_rows
        if (hi_lo.dtype != torch.float8_e4m3fn or tuple(hi_lo.shape) != (2 * rows.shape[0], rows.shape[1])
                or factor.dtype != torch.float32 or tuple(factor.shape) != (rows.shape[0],)):
            raise ValueError(f"fp8_rows must be (hi_lo [{2 * rows.shape[0]}, {rows.shape[1]}] float8_e4m3fn, factor "
                             f"[{rows.shape[0]}] float32), got {hi_lo.dtype} {list(hi_lo.shape)} and {factor.dtype} "
                             f"{list(factor.shape)}")
        if not slot_values.shape[0]:  # no slot groups: the kernel never reads the slot set
            slot_values, slot_scales = values, scales
        # K steps of 64 where K is not a multiple of 128 (gpt-oss's 2880)
        block_k = config.block_k if rows.shape[1] % config.block_k == 0 else min(mxfp4_fp8mma.BLOCK_K)
        fp8_pass = all(mxfp4_fp8mma.fits(hi_lo, pool_values, pool_scales, out, block_k)
                       for pool_values, pool_scales in ((values, scales), (slot_values, slot_scales)))
        if fp8_pass:  # set where a tile reads a scale byte outside the window
            redo = torch.zeros(mxfp4_fp8mma.flag_count(groups, columns), dtype=torch.int32, device=rows.device)
            programs = persistent_grid(rows.shape[0], groups, columns, config, rows.device)[0]
            mxfp4_fp8mma.mxfp4_fp8mma_launch(
                hi_lo, factor, values, scales, slot_values, slot_scales, out, offsets, redo, values.shape[0],
                slot_base, rows_above, rows_at_most, config.block_m, block_k, config.group_m,
                config.num_stages, programs, mxfp4_swap.max_registers(config.programs_per_sm))
    elif config.swap_ab or config.lane_words:
        raise ValueError(f"the mma layout's Triton tiles are unswapped, in column order (no lane_words), got {config}")
    else:
        exact = config
    if not fp8_pass:  # the exact pass computes every tile
        redo = torch.ones(mxfp4_fp8mma.flag_count(groups, columns), dtype=torch.int32, device=rows.device)
    return _mxfp4_mma_exact_pass(rows, values, scales, offsets, exact, out, group_rows, slot_values, slot_scales,
                                 slot_base, redo)


def _mxfp4_mma_exact_pass(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, config: GemmConfig,
    out: torch.Tensor, group_rows: tuple[int, int], slot_values: torch.Tensor, slot_scales: torch.Tensor,
    slot_base: int, redo: torch.Tensor,
) -> torch.Tensor:
    """The Triton tiles that decode the ``mma`` layout into bf16 (``config``: unswapped), on the tiles
    over what ``redo`` flags (int32 ``[mxfp4_fp8mma.flag_count(groups, N)]``: element 0 for any, then
    one per group and 128 columns; see :func:`flatep.kernels.mxfp4_fp8mma.mxfp4_fp8mma_launch`); the
    other tiles' rows of ``out`` are left as they are."""
    groups, columns = offsets.shape[0], values.shape[1]
    grid = persistent_grid(rows.shape[0], groups, columns, config, rows.device)
    descriptors = _mxfp4_descriptors(rows, values, scales, slot_values, slot_scales, config)
    sources = descriptors or (rows, values.view(torch.int32), scales, slot_values.view(torch.int32), slot_scales)
    _mxfp4_grouped_kernel[grid](
        *sources, out, offsets, redo, groups, values.shape[0], slot_base, columns, rows.stride(0), out.stride(0),
        *scales.stride(), *group_rows, rows.shape[1],
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        GROUPS=triton.next_power_of_2(groups), SWAP_AB=False, NATURAL_K=True, LANE_WORDS=False, ONE_MULTIPLY=False,
        TMA=descriptors is not None, INTERPRET=interpreting(), MMA=True,
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=config.max_registers,
    )
    return out


def _mxfp4_descriptors(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_values: torch.Tensor,
    slot_scales: torch.Tensor, config: GemmConfig,
) -> tuple | None:
    """Tensor descriptors of an mxfp4 GEMM's operands, or None where the copies need pointers: the
    rows ``[M, K]`` (tiles ``[block_m, block_k]``), the words ``[G, N, K/8]`` int32 (``[1, block_n,
    block_k/8]``) and the scales as they lie column-fastest, ``[G, K/32, N]`` (``[1, block_k/32,
    block_n]``), then the slots' words and scales.

    On a Hopper GPU (or later) the copies are then TMA's: no address registers a thread, which the
    asynchronous copies of the pointer loads hold until the copy has read them (Nsight Compute on an
    H100: 13-17% of the short tiles' warp stalls). The interpreter runs descriptors too, so CPU tests
    cover this path. Pointers serve the other tiles and inputs: swapped tiles, tiles whose copies
    are not whole multiples of 128 bytes (the scales of fewer than 128 columns at 64 K columns a
    step), scales in the checkpoint's order, rows whose stride or base is not 16-byte aligned, and
    GPUs before Hopper (and ROCm's)."""
    words, blocks = config.block_k // 8, config.block_k // 32
    boxes = (config.block_m * config.block_k * 2, config.block_n * words * 4, config.block_n * blocks)  # bytes
    # Each stage's copy lands in its own shared-memory buffer, which TMA needs 128-byte aligned: a
    # box of, say, 64 bytes of scales (32 columns, 2 blocks) put the second stage at a misaligned
    # address (CUDA "misaligned address" on an H100).
    if config.swap_ab or any(box % 128 for box in boxes):
        return None
    hopper = rows.is_cuda and torch.version.hip is None and torch.cuda.get_device_capability(rows.device)[0] >= 9
    if not interpreting() and not hopper:
        return None
    by_block = [weights_scales.transpose(1, 2) for weights_scales in (scales, slot_scales)]  # [G, K/32, N]
    operands = (rows, values, slot_values, *by_block)
    if not all(tma_fits(operand) for operand in operands) or not all(part.is_contiguous() for part in by_block):
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:  # a Triton without host-side descriptors
        return None
    return (TensorDescriptor.from_tensor(rows, [config.block_m, config.block_k]),
            TensorDescriptor.from_tensor(values.view(torch.int32), [1, config.block_n, words]),
            TensorDescriptor.from_tensor(by_block[0], [1, blocks, config.block_n]),
            TensorDescriptor.from_tensor(slot_values.view(torch.int32), [1, config.block_n, words]),
            TensorDescriptor.from_tensor(by_block[1], [1, blocks, config.block_n]))
