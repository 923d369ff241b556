"""The mxfp4 grouped GEMM for groups of more than 32 rows, for Hopper (sm_90), in Gluon.

Same contract and tile numbering as :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` (it
calls this kernel for :class:`flatep.kernels.packed_tiles.GemmConfig` tiles with ``wgmma=True``), with
the weights' decode in warps of its own, beside the warp-group MMAs that use them. Hopper has no FP4
tensor cores: each weight is decoded to bf16 before a bf16 MMA reads it. In a Triton tile the same
warps decode a K step's weights, store them to shared memory and run the MMA on them, one after
the other; at 96-128 rows per expert the 64 x 256 Triton tile read a Kimi-K3 rank's packed weights
at about 30% of the device's read ceiling (bench/results/2026-12-06-h100-k).

A persistent, warp-specialized kernel (``gl.warp_specialize``): per tile of 64 rows and 256
columns,

- a producer warp copies each 64-wide K step's rows (bf16), weight words (int32, 8 e2m1 codes each
  in FlatEP's word layout) and e8m0 scales (column-fastest, as pools hold them) with TMA into a
  ring of ``LOAD_STAGES`` stages; a stage's "ready" mbarrier completes with the copies' bytes, its
  "empty" one once the MMA that read it is done;
- a decoder warp group waits for a stage, decodes its 256 x 64 weights in registers (the PTX of
  :mod:`flatep.kernels.e2m1_ptx`, in column order: ``natural``), stores them as bf16 into one of
  ``DECODE_STAGES`` shared-memory tiles in the warp-group MMA's swizzled layout, and arrives on
  that tile's "decoded" mbarrier;
- the consumer warp group (the default partition) waits for a decoded tile and issues the step's
  64 x 256 x 64 MMA asynchronously into its fp32 accumulator; once the MMA before it is done, it
  hands that step's stage and decoded tile back; after the last step it stores the tile (masked to
  its group and to ``N``) as bf16.

So the decode of step ``k + 1`` runs while step ``k``'s MMA does and later steps' copies land, where
the Triton tile's warps take them in turn. Per K step and SM on an H100 (3.1 TB/s read, 132 SMs,
about 1.8 GHz): the step's 8.7 KB of packed weights take about 650 cycles to read, its MMA (1M
multiply-adds at 2048 a cycle) 512, and its decode about 300 issue cycles of the decoder's four
warps; overlapped, the read bounds it. Two consumers sharing a decoded tile (128-row tiles) would
decode a hot group's weights once instead of twice, but they need 16 warps, at most 128 registers
a thread, too few for a 64 x 256 fp32 accumulator, and the MMA bounds such groups anyway (twice
the MMA work per weight byte). The decode is the Triton tiles' (exact: e2m1 times a power of two),
including their two launches: the first decodes with one multiply a pair of weights and flags a
scale byte past 128, the second computes every tile again with two multiplies only if flagged (see
:mod:`flatep.kernels.quant_gemm`). The products accumulate in fp32 in the MMA, over K in column
order, as the Triton tall tiles' do.

Gluon (``triton.experimental.gluon``) has no interpreter: this kernel runs on Hopper GPUs only
(:func:`flatep.kernels.fp8_wgmma.available`). The CPU tests compile it for sm_90 with the installed
Triton (tests/kernels/test_mxfp4_wgmma.py: its MMAs stay in flight, no spills, its shared memory
fits) and check the Triton kernel of the same contract; its GPU tests compare it with that kernel
and with the dequantized weights, and pass on an H100. Measured there it is slower than the Triton
64 x 256 tile (1.22-1.30x its time at 64-192 rows per expert, 4 stages; its reads reach 47-50% of
the ceiling even at one 64-row pass a group, bench/results/2026-12-07-h100), likely because one
decoder warp a scheduler cannot hide its shared-memory latency. So it is opt-in
(:data:`flatep.kernels.packed_tiles.MXFP4_WGMMA`, or ``FLATEP_MXFP4_WGMMA=1`` for the default);
``bench/scripts/mxfp4_wgmma_checks.sh`` runs its GPU tests and times it in a step and per GEMM.
"""
from __future__ import annotations

import functools

import torch
import triton

from flatep.kernels.backend import tma_fits
from flatep.kernels.e2m1_ptx import INF_PAIR, ONE_MULTIPLY_BIAS, ONE_MULTIPLY_MAX_BYTE, SCALE_PAIR, scaled_pairs_ptx
from flatep.kernels.fp8_wgmma import gluon

if gluon is not None:
    from flatep.kernels.fp8_wgmma import (
        TensorDescriptor,
        _find_tile,
        _group_tiles,
        _tma_load,
        fence_async_shared,
        gl,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

WG_M = 64  # rows of a warp-group MMA: one consumer's
BLOCK_N = 256
BLOCK_K = 64
NUM_WARPS = 4  # the consumer warp group's (the default partition's)
LOAD_STAGES = 4
"""The default stages of the copies' ring (16.5 KiB each); ``GemmConfig.num_stages`` picks any of
:data:`STAGES`."""
STAGES = range(3, 7)
"""Stages that fit beside the decoded tiles (2 x 32 KiB) in Hopper's 227 KiB of shared memory."""
DECODE_STAGES = 2
DECODE_WARPS = 4
CHUNK = 4  # K steps a consumer unrolls between points with no MMA in flight
PRODUCER_REGISTERS = 32
MAX_REGISTERS = 168
DECODER_REGISTERS = 160
"""A thread's registers at launch (12 warps a program: the producer's warp rounded up to a warp
group), which ``setmaxnreg`` moves to ``DECODER_REGISTERS`` for the decoders and
``PRODUCER_REGISTERS`` for the producer; the consumer keeps the rest (local sm_90 compile, Triton
3.6: no spills, where the producer spilled 12 bytes at 24 registers)."""


if gluon is not None:
    _NATURAL_PTX = gl.constexpr(scaled_pairs_ptx(False, natural=True))
    _ONE_MULTIPLY_NATURAL_PTX = gl.constexpr(scaled_pairs_ptx(True, natural=True))
    _SCALE_PAIR = gl.constexpr(SCALE_PAIR)
    _ONE_MULTIPLY_BIAS = gl.constexpr(ONE_MULTIPLY_BIAS)
    _ONE_MULTIPLY_MAX_BYTE = gl.constexpr(ONE_MULTIPLY_MAX_BYTE)
    _INF_PAIR = gl.constexpr(INF_PAIR)
    _WG_M = gl.constexpr(WG_M)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _BLOCK_K = gl.constexpr(BLOCK_K)
    _DECODE_WARPS = gl.constexpr(DECODE_WARPS)
    _CHUNK = gl.constexpr(CHUNK)

    # Gluon's CTA barrier: thread_barrier in Triton 3.6, barrier from 3.7 on.
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):  # Triton 3.7 on; 3.6 names it _reinterpret
        @gluon.jit
        def _as_bf16(tile, layout: gl.constexpr):
            """The int32 ``[rows, columns]`` tile's bytes as bf16 ``[rows, 2 * columns]``."""
            return tile.reinterpret(gl.bfloat16, [tile.shape[0], 2 * tile.shape[1]], layout)
    else:
        @gluon.jit
        def _as_bf16(tile, layout: gl.constexpr):
            """The int32 ``[rows, columns]`` tile's bytes as bf16 ``[rows, 2 * columns]``."""
            return tile._reinterpret(gl.bfloat16, [tile.shape[0], 2 * tile.shape[1]], layout)

    @gluon.jit
    def _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, GROUPS: gl.constexpr, ONE_MULTIPLY: gl.constexpr, WARPS: gl.constexpr):
        """The tile table (see :func:`flatep.kernels.grouped_tiles.group_tiles`) and the program's first
        tile: past the last in the second pass unless the first flagged a scale byte past 128."""
        g = gl.arange(0, GROUPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
        starts, ends, tiles, passed, total = _group_tiles(offsets_ptr, g, groups, split, split_start, N, rows_above,
                                                         rows_at_most, BLOCK_M, BLOCK_N)
        tile = gl.program_id(0)
        if not ONE_MULTIPLY:
            if gl.load(redo_ptr) == 0:
                tile = total
        return g, (starts, ends, tiles, passed, total), tile

    @gluon.jit
    def _load_steps(descriptors, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, K: gl.constexpr,
                    GROUP_M: gl.constexpr, GROUPS: gl.constexpr, ONE_MULTIPLY: gl.constexpr, second_bufs=None,
                    second_row=0):
        """A producer warp's loop (this kernel's, :mod:`flatep.kernels.mxfp4_swap`'s and
        :mod:`flatep.kernels.mxfp4_fp8mma`'s): every K step of the program's tiles (``a_bufs [stages,
        rows, K step]``, ``w_bufs [stages, columns, K step / 8]``) copied by TMA into the ring of stages,
        each stage once the consumer handed it back. With ``second_bufs``, each step also copies the
        row tile ``second_row`` rows further down ``a_desc`` into them (the fp8 kernel's ``lo`` rows)."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc = descriptors
        out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most = scalars
        STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        STEP: gl.constexpr = a_bufs.shape[2]
        TILE_N: gl.constexpr = w_bufs.shape[1]
        WORDS: gl.constexpr = STEP // 8
        BLOCKS: gl.constexpr = STEP // 32
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                TILE_M, TILE_N, GROUPS, ONE_MULTIPLY, 1)
        starts, ends, tiles, passed, total = table
        ROW_TILES: gl.constexpr = 1 if second_bufs is None else 2
        step_bytes: gl.constexpr = (ROW_TILES * a_desc.block_type.nbytes + w_desc.block_type.nbytes
                                    + s_desc.block_type.nbytes)
        count = 0
        while tile < total:
            group, first, _, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, TILE_M, TILE_N,
                                                       GROUP_M)
            is_slot = group >= split
            expert = gl.where(is_slot, group - split, group)
            word_row = expert * N + first_column
            scale_row = expert * (K // 32)
            for step in range(K // STEP):
                stage = count % STAGES
                # A fresh barrier counts as having completed the phase before its first: the first
                # pass through the ring does not wait.
                mbarrier.wait(load_empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = load_ready.index(stage)
                mbarrier.expect(bar, step_bytes)
                _tma_load(a_desc, [first, step * STEP], bar, a_bufs.index(stage))
                if second_bufs is not None:
                    _tma_load(a_desc, [second_row + first, step * STEP], bar, second_bufs.index(stage))
                if is_slot:
                    _tma_load(slot_w_desc, [word_row, step * WORDS], bar, w_bufs.index(stage))
                    _tma_load(slot_s_desc, [scale_row + step * BLOCKS, first_column], bar, s_bufs.index(stage))
                else:
                    _tma_load(w_desc, [word_row, step * WORDS], bar, w_bufs.index(stage))
                    _tma_load(s_desc, [scale_row + step * BLOCKS, first_column], bar, s_bufs.index(stage))
                count += 1
            tile += gl.num_programs(0)

    @gluon.jit
    def _produce(operands, scalars, K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
                 ONE_MULTIPLY: gl.constexpr):
        """The producer warp: :func:`_load_steps`."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, d_bufs, bars = operands
        load_ready, load_empty, decoded, decode_empty = bars
        _load_steps((a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc), a_bufs, w_bufs, s_bufs, load_ready, load_empty,
                    scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)

    @gluon.jit
    def _scale_pairs(exponent, largest, ONE_MULTIPLY: gl.constexpr):
        """e8m0 scale bytes (int32) -> the pairs of bf16 scales the decode multiplies by (see
        :mod:`flatep.kernels.e2m1_ptx`), and ``largest`` raised to them; in the first pass (one
        multiply) biased and capped at infinity, in the second exact."""
        if ONE_MULTIPLY:
            largest = gl.maximum(largest, exponent)
            pairs = (exponent * _SCALE_PAIR + _ONE_MULTIPLY_BIAS * _SCALE_PAIR).to(gl.uint32, bitcast=True)
            pairs = gl.minimum(pairs, _INF_PAIR).to(gl.int32, bitcast=True)
        else:
            pairs = exponent * _SCALE_PAIR
        return pairs, largest

    @gluon.jit
    def _decode_step(words_buf, scales_buf, largest, ONE_MULTIPLY: gl.constexpr):
        """One stage's weights: int32 words ``[BLOCK_N, BLOCK_K/8]`` and uint8 e8m0 scales ``[BLOCK_K/32,
        BLOCK_N]`` in shared memory -> ``[BLOCK_N, BLOCK_K/2]`` int32, each two bf16 weights in column
        order; ``largest`` ``[BLOCK_N, BLOCK_K/32]``, the largest scale byte each position has read."""
        ROWS: gl.constexpr = words_buf.shape[0]
        WORDS: gl.constexpr = words_buf.shape[1]
        BLOCKS: gl.constexpr = WORDS // 4
        flat: gl.constexpr = gl.BlockedLayout([1, WORDS], [32, 1], [_DECODE_WARPS, 1], [1, 0])
        by_block: gl.constexpr = gl.BlockedLayout([1, BLOCKS, 4], [32, 1, 1], [_DECODE_WARPS, 1, 1], [2, 1, 0])
        words = gl.convert_layout(gl.reshape(words_buf.load(flat), [ROWS, BLOCKS, 4]), by_block)
        # The scales load as stored, [BLOCKS, ROWS], and turn in registers: a load through the
        # descriptor's permute read them as if stored [ROWS, BLOCKS] (Triton 3.6, on an H100).
        by_column: gl.constexpr = gl.BlockedLayout([BLOCKS, 1], [1, 32], [1, _DECODE_WARPS], [0, 1])
        exponent = gl.convert_layout(gl.permute(scales_buf.load(by_column), (1, 0)),
                                     gl.SliceLayout(2, by_block)).to(gl.int32)
        pairs, largest = _scale_pairs(exponent, largest, ONE_MULTIPLY)
        if ONE_MULTIPLY:
            ptx: gl.constexpr = _ONE_MULTIPLY_NATURAL_PTX
        else:
            ptx: gl.constexpr = _NATURAL_PTX
        words, pairs = gl.broadcast(words, gl.expand_dims(pairs, 2))
        c01, c23, c45, c67 = gl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r,r", [words, pairs],
                                                       dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                       pack=1)
        return gl.reshape(gl.join(gl.join(c01, c45), gl.join(c23, c67)), [ROWS, 4 * WORDS]), largest

    @gluon.jit
    def _decode(operands, scalars, K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
                ONE_MULTIPLY: gl.constexpr):
        """The decoder warp group: every stage's weights into the decoded tiles, in the program's step
        order; then, in the first pass, the flag if any scale byte read was past 128."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, d_bufs, bars = operands
        load_ready, load_empty, decoded, decode_empty = bars
        out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most = scalars
        LOAD_STAGES: gl.constexpr = a_bufs.shape[0]
        DECODE_STAGES: gl.constexpr = d_bufs.shape[0]
        BLOCKS: gl.constexpr = _BLOCK_K // 32
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                _WG_M, _BLOCK_N, GROUPS, ONE_MULTIPLY, _DECODE_WARPS)
        total = table[4]
        by_block: gl.constexpr = gl.BlockedLayout([1, BLOCKS, 4], [32, 1, 1], [_DECODE_WARPS, 1, 1], [2, 1, 0])
        largest = gl.zeros([_BLOCK_N, BLOCKS], gl.int32, gl.SliceLayout(2, by_block))
        count = 0
        while tile < total:
            for step in range(K // _BLOCK_K):
                stage = count % LOAD_STAGES
                slot = count % DECODE_STAGES
                mbarrier.wait(load_ready.index(stage), (count // LOAD_STAGES) & 1)
                weights, largest = _decode_step(w_bufs.index(stage), s_bufs.index(stage), largest, ONE_MULTIPLY)
                mbarrier.wait(decode_empty.index(slot), ((count // DECODE_STAGES) & 1) ^ 1)
                d_bufs.index(slot).store(weights)
                # The MMAs read the tile through the async proxy, after every decoder thread's stores.
                fence_async_shared()
                _cta_barrier()
                mbarrier.arrive(decoded.index(slot), count=1)
                count += 1
            tile += gl.num_programs(0)
        if ONE_MULTIPLY:
            if gl.max(gl.max(largest, axis=1), axis=0) > _ONE_MULTIPLY_MAX_BYTE:
                gl.store(redo_ptr, 1)

    @gluon.jit
    def _mma_chunk(a_bufs, d_bufs, bars, acc, base, STEPS: gl.constexpr):
        """The program's steps ``[base, base + STEPS)``: each step's MMA issued into
        ``acc`` as soon as its decoded tile is ready, the step before it then waited for and its
        stage and decoded tile handed back. Unrolled, and ending with no MMA in flight (ptxas
        serializes every warp-group MMA of the kernel where one is in flight across a loop's back
        edge: notice C7514)."""
        load_ready, load_empty, decoded, decode_empty = bars
        LOAD_STAGES: gl.constexpr = a_bufs.shape[0]
        DECODE_STAGES: gl.constexpr = d_bufs.shape[0]
        weight_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        previous_stage = 0
        previous_slot = 0
        for i in gl.static_range(STEPS):
            count = base + i
            stage = count % LOAD_STAGES
            slot = count % DECODE_STAGES
            # The decoder waited for this stage too; waiting here as well orders the rows' copy
            # before the MMA reads them.
            mbarrier.wait(load_ready.index(stage), (count // LOAD_STAGES) & 1)
            mbarrier.wait(decoded.index(slot), (count // DECODE_STAGES) & 1)
            weights = _as_bf16(d_bufs.index(slot), weight_layout)
            acc = warpgroup_mma(a_bufs.index(stage), weights.permute((1, 0)), acc, is_async=True)
            if i > 0:  # the previous step's MMA is done: its stage and decoded tile go back
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                mbarrier.arrive(load_empty.index(previous_stage), count=1)
                mbarrier.arrive(decode_empty.index(previous_slot), count=1)
            previous_stage = stage
            previous_slot = slot
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(load_empty.index(previous_stage), count=1)
        mbarrier.arrive(decode_empty.index(previous_slot), count=1)
        return acc

    @gluon.jit
    def _consume(operands, scalars, K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
                 ONE_MULTIPLY: gl.constexpr):
        """The consumer warp group: each tile's K steps' MMAs into one fp32 accumulator, then the tile's
        rows stored (masked to its group and to ``N``)."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, d_bufs, bars = operands
        out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most = scalars
        K_STEPS: gl.constexpr = K // _BLOCK_K
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, _BLOCK_N, 16])
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                _WG_M, _BLOCK_N, GROUPS, ONE_MULTIPLY, 4)
        starts, ends, tiles, passed, total = table
        count = 0
        while tile < total:
            _, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, _WG_M, _BLOCK_N,
                                                      GROUP_M)
            acc = gl.zeros([_WG_M, _BLOCK_N], gl.float32, mma_layout)
            for chunk in range(K_STEPS // _CHUNK):
                acc = _mma_chunk(a_bufs, d_bufs, bars, acc, count + chunk * _CHUNK, _CHUNK)
            if K_STEPS % _CHUNK:
                acc = _mma_chunk(a_bufs, d_bufs, bars, acc, count + K_STEPS - K_STEPS % _CHUNK, K_STEPS % _CHUNK)
            count += K_STEPS
            row = first + gl.arange(0, _WG_M, layout=gl.SliceLayout(1, mma_layout))
            # A whole block's first column: each thread's two adjacent columns leave in one store.
            column = gl.multiple_of(first_column, _BLOCK_N) + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
            out = out_ptr + row.to(gl.int64)[:, None] * stride_om + column[None, :]
            gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(row < last)[:, None] & (column < N)[None, :])
            tile += gl.num_programs(0)

    @gluon.jit
    def _mxfp4_wgmma_kernel(
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, out_ptr, offsets_ptr, redo_ptr, groups, split, split_start,
        N, stride_om, rows_above, rows_at_most,
        K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
        LOAD_STAGES: gl.constexpr, DECODE_STAGES: gl.constexpr, ONE_MULTIPLY: gl.constexpr,
        DECODER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Groups ``[0, split)`` read ``w_desc`` and ``s_desc``, groups ``[split, groups)`` the slot
        descriptors from row ``split_start``; the word descriptors view the words as ``[experts * N,
        K/8]`` int32, the scale descriptors the scales as ``[experts * K/32, N]`` uint8. ``num_warps``:
        the default partition's (the consumer warp group)."""
        gl.static_assert(K % _BLOCK_K == 0, "K must be a multiple of BLOCK_K")
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [LOAD_STAGES, _WG_M, _BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [LOAD_STAGES, _BLOCK_N, _BLOCK_K // 8], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [LOAD_STAGES, _BLOCK_K // 32, _BLOCK_N], s_desc.layout)
        decoded_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        d_bufs = gl.allocate_shared_memory(gl.int32, [DECODE_STAGES, _BLOCK_N, _BLOCK_K // 2], decoded_layout)
        load_ready = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        load_empty = gl.allocate_shared_memory(gl.int64, [LOAD_STAGES, 1], mbarrier.MBarrierLayout())
        decoded = gl.allocate_shared_memory(gl.int64, [DECODE_STAGES, 1], mbarrier.MBarrierLayout())
        decode_empty = gl.allocate_shared_memory(gl.int64, [DECODE_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(LOAD_STAGES):
            mbarrier.init(load_ready.index(i), count=1)
            mbarrier.init(load_empty.index(i), count=1)
        for i in gl.static_range(DECODE_STAGES):
            mbarrier.init(decoded.index(i), count=1)
            mbarrier.init(decode_empty.index(i), count=1)
        operands = (a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, d_bufs,
                    (load_ready, load_empty, decoded, decode_empty))
        scalars = (out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most)
        gl.warp_specialize([
            (_consume, (operands, scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)),
            (_decode, (operands, scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)),
            (_produce, (operands, scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)),
        ], [_DECODE_WARPS, 1], [DECODER_REGISTERS, PRODUCER_REGISTERS])
        for i in gl.static_range(LOAD_STAGES):
            mbarrier.invalidate(load_ready.index(i))
            mbarrier.invalidate(load_empty.index(i))
        for i in gl.static_range(DECODE_STAGES):
            mbarrier.invalidate(decoded.index(i))
            mbarrier.invalidate(decode_empty.index(i))


def fits(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether this kernel takes these operands: ``K`` a multiple of :data:`BLOCK_K`, ``N`` a multiple
    of 16, and TMA-copyable (16-byte aligned) rows ``[M, K]`` with unit column stride, contiguous
    words ``[G, N, K/2]`` uint8 and column-fastest scales ``[G, N, K/32]`` whose ``[G, K/32, N]``
    view is contiguous (as pools hold them); ``out [M, N]`` with unit column stride."""
    by_block = scales.transpose(1, 2)
    return (rows.shape[1] % BLOCK_K == 0 and values.shape[1] % 16 == 0 and values.is_contiguous()
            and by_block.is_contiguous() and all(tma_fits(t) for t in (rows, values, by_block))
            and out.stride(1) == 1)


@functools.cache
def _shared_layout(box: tuple[int, int], dtype):
    """The shared-memory layout of a TMA box (cached: the launches build descriptors each call)."""
    return gl.NVMMASharedLayout.get_default_for(list(box), dtype)


def descriptors(rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_values: torch.Tensor,
                slot_scales: torch.Tensor, block_m: int = WG_M, block_n: int = BLOCK_N,
                block_k: int = BLOCK_K) -> tuple:
    """The TMA descriptors a launch takes (this kernel's, :mod:`flatep.kernels.mxfp4_swap`'s and
    :mod:`flatep.kernels.mxfp4_fp8mma`'s): ``rows [M, K]`` bf16 (fp8 e4m3: the fp8 kernel's ``hi_lo``
    rows) in boxes of ``[block_m, block_k]``; then for the home pool and the slots, the words
    ``values [G, N, K/2]`` viewed as ``[G * N, K/8]`` int32 in boxes of ``[block_n, block_k/8]`` and the
    column-fastest ``scales [G, N, K/32]`` viewed as ``[G * K/32, N]`` uint8 in boxes of
    ``[block_k/32, block_n]``."""
    def descriptor(tensor: torch.Tensor, box: list[int], dtype) -> TensorDescriptor:
        layout = _shared_layout(tuple(box), dtype)
        return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box, layout)

    pools = []
    for pool_values, pool_scales in ((values, scales), (slot_values, slot_scales)):
        pools.append(descriptor(pool_values.view(torch.int32).flatten(0, 1), [block_n, block_k // 8], gl.int32))
        pools.append(descriptor(pool_scales.transpose(1, 2).flatten(0, 1), [block_k // 32, block_n], gl.uint8))
    rows_type = gl.float8e4nv if rows.dtype == torch.float8_e4m3fn else gl.bfloat16
    return (descriptor(rows, [block_m, block_k], rows_type), *pools)


def mxfp4_wgmma_launch(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_values: torch.Tensor,
    slot_scales: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, split: int, slot_base: int,
    rows_above: int, rows_at_most: int, group_m: int, stages: int, programs: int,
) -> None:
    """Both passes of the kernel on operands :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton`
    has checked (and :func:`fits` accepted, slots too): ``rows [M, K]`` bf16, ``values [G, N, K/2]``
    uint8 words with ``scales [G, N, K/32]`` uint8 (and the slots' alike), ``out [M, N]`` bf16,
    ``offsets [groups]`` int32; ``stages`` of copies in flight, over ``programs`` programs."""
    operands = descriptors(rows, values, scales, slot_values, slot_scales)
    redo = torch.zeros(1, dtype=torch.int32, device=rows.device)
    groups = offsets.shape[0]
    for one_multiply in (True, False):
        _mxfp4_wgmma_kernel[(programs, )](
            *operands, out, offsets, redo, groups, split, slot_base, values.shape[1], out.stride(0), rows_above,
            rows_at_most, K=rows.shape[1], GROUP_M=group_m, GROUPS=triton.next_power_of_2(groups),
            LOAD_STAGES=stages, DECODE_STAGES=DECODE_STAGES, ONE_MULTIPLY=one_multiply,
            DECODER_REGISTERS=DECODER_REGISTERS, PRODUCER_REGISTERS=PRODUCER_REGISTERS, num_warps=NUM_WARPS,
            maxnreg=MAX_REGISTERS,
        )
