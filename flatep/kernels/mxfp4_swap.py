"""The mxfp4 grouped GEMM for groups of at most 32 rows (and, opt-in, more), for Hopper (sm_90), in
Gluon: the product transposed, the decoded weights fed to the warp-group MMA from registers.

Same contract and tile numbering as :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton`. The
Triton short tiles (16 and 32 rows) decode a whole K step's weight tile into registers before their
``mma.sync`` dots: 238 registers a thread for the 32 x 256 x 128 tile (local sm_90 compile, Triton
3.6), two programs of 4 warps an SM, and their weights read at 68-83% of the read ceiling on an
H100 (bench/results/2026-12-07-h100-b). Hopper's warp-group MMA takes its first operand from
registers; with the product transposed, ``out.T = W @ rows.T``, the weights' 64 columns a warp
group fill the MMA's 64-row side and the tile's 16 or 32 rows its N side. Triton 3.6 compiles such a
swapped tile with the decoded weights stored to shared memory and loaded back into the MMA's operand
layout; here each thread decodes straight into its operand registers. On an H100 a Kimi-K3 rank's
GEMMs at 32 rows per expert took 0.85-0.87x the Triton 32-row tile's time (74% of the read ceiling;
0.83-0.85x with 6 stages of copies, bench/results/2026-12-07-h100-g),
at 16 rows 1.01-1.02x the 16-row tile's (bench/results/2026-12-07-h100-c), so it runs groups of
17-32 rows only: by default on Hopper (:data:`flatep.kernels.packed_tiles.MXFP4_SWAP_DEFAULT`;
``FLATEP_MXFP4_SWAP=0`` turns it off). With it issue #15's Kimi-K3 cell took 0.363-0.365x bf16's time
at maxvio 0 against the Triton tile's 0.420-0.423x in the same runs (bench/results/2026-12-07-h100-d).
A 64-row tile, at 2 programs an SM for its sums' registers, is a candidate for the groups of more
than 32 rows (:data:`flatep.kernels.packed_tiles.MXFP4_SWAP64_DEFAULT`, ``FLATEP_MXFP4_SWAP64=1``),
not yet run on a GPU.

The operand layout gives lane ``q`` of each four the K positions ``2q, 2q + 1, 2q + 8, 2q + 9`` of
every 16-wide chunk (two bf16 a register), of two rows. A word of FlatEP's layout holds 8
consecutive K columns and decodes into four registers, pair ``p`` holding columns ``p`` and
``p + 4`` (:mod:`flatep.kernels.e2m1_ptx`). The MMA sums over K in a permuted order, the same for
weights and activations, so each sum has the same terms: within a 64-wide step, position
``L = e + 2 * h + 8 * l + 16 * p`` (``e``, ``l`` in 0..1; ``h``, ``p`` in 0..3) holds column
``8 * (l + 2 * h) + p + 4 * e``, so that each thread's eight registers of a row are the four pairs
of words ``2h`` and ``2h + 1`` (``h`` its lane in the four), converted to the operand layout with
no data movement (``convert_layout(..., assert_trivial=True)``). TMA cannot permute the activations
so (the MMA reads 8 K-adjacent values as 16 contiguous bytes), so each step's rows pass through
registers into a second shared-memory tile in that order.

A persistent, warp-specialized kernel (``gl.warp_specialize``): per tile of ``BLOCK_M`` rows (16 or
32) and :data:`BLOCK_N` weight columns (two 64-column halves, one accumulator each),

- a producer warp copies each 64-wide K step's rows (bf16), weight words (int32) and e8m0 scales
  (column-fastest, as pools hold them) with TMA into a ring of stages;
- the consumer warp group (the default partition) loads a stage's rows, words and scales into
  registers and hands the stage back, decodes the words into operand registers, stores the permuted
  rows, and issues the step's two MMAs.

By default (:data:`CHUNK_STEPS` = 1) the consumer waits for a step's MMAs before it decodes the next
step, so within a program the decode and the MMAs take turns (other programs on the SM fill the
gaps). With ``CHUNK_STEPS`` of 2 or more it unrolls that many steps and decodes each half of the
weights while the MMA issued before it runs (:func:`_overlapped_steps`): the same MMAs in the same
order, so the same bits, with no more registers or instructions a step (local sm_90 compiles,
Triton 3.6 and 3.9: about 180 instructions a step against the plain step's 187, no spills at 80
registers a thread at launch) and 4 KiB more shared memory for a second buffer of rows. That is a
candidate, not yet run on a GPU: ``bench/scripts/mxfp4_chunk_checks.sh`` runs its GPU tests and times
it against the default.

The decode is the Triton tiles' (exact: e2m1 times a power of two), with their two launches: the
first decodes with one multiply a pair and flags a scale byte past 128, the second computes every
tile again with two multiplies only if flagged (see :mod:`flatep.kernels.quant_gemm`). Gluon has no
interpreter: this kernel runs on Hopper GPUs only; the CPU tests compile it for sm_90.
"""
from __future__ import annotations

import torch
import triton

from flatep.kernels.e2m1_ptx import ONE_MULTIPLY_MAX_BYTE, scaled_pairs_ptx
from flatep.kernels.fp8_wgmma import gluon

if gluon is not None:
    from flatep.kernels.fp8_wgmma import (
        _find_tile,
        fence_async_shared,
        gl,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from flatep.kernels.mxfp4_wgmma import _cta_barrier, _load_steps, _scale_pairs, _tiles, descriptors

BLOCK_M = (16, 32, 64)
"""Row tiles this kernel takes (the warp-group MMA's N side). The 64-row tile's sums take twice the
registers: it runs at 2 programs an SM (:data:`PROGRAMS_PER_SM`, :func:`max_registers`)."""
HALF_N = 64  # weight columns of one warp-group MMA (its M side)
BLOCK_N = 2 * HALF_N
BLOCK_K = 64
NUM_WARPS = 4  # the consumer warp group's (the default partition's)
LOAD_STAGES = 6
"""Stages of copies in flight by default: 55 KiB of shared memory a program at 32 rows, so
:data:`PROGRAMS_PER_SM` still fit an SM. On an H100, a Kimi-K3 rank's GEMMs at 32 rows per expert took
564-568 us (gate/up) and 280-282 us (down) with 6 stages against 588 and 288 us with 4, in one run;
the producer warp's registers (40, 32 or 24) changed them by less than 1% (bench/results/2026-12-07-h100-g)."""
STAGES = range(2, 9)
CHUNK_STEPS = 1
"""K steps the consumer unrolls into one chunk, each step's decode beside the previous step's MMAs
(:func:`_overlapped_steps`); 1: every step waits for its own MMAs before the next step's decode
(:func:`_step`)."""
PROGRAMS_PER_SM = {16: 3, 32: 3, 64: 2}
"""Programs an SM by row tile, at :func:`max_registers` each: 80 registers a thread at 3 (local sm_90
compile, Triton 3.6: no spills at 16 and 32 rows; the 64-row tile spills 168 bytes there), 128 at 2."""
PRODUCER_REGISTERS = 40


def max_registers(programs_per_sm: int) -> int:
    """A thread's registers at launch for ``programs_per_sm`` programs an SM: a program is 8 warps (the
    producer's warp padded to a warp group) of Hopper's 64K registers an SM, rounded down to a multiple
    of 8 (``setmaxnreg`` then moves registers from the producer's warp group to the consumer's)."""
    return min(255, 65536 // (2 * 128 * programs_per_sm) // 8 * 8)


if gluon is not None:
    _PTX = gl.constexpr(scaled_pairs_ptx(False))
    _ONE_MULTIPLY_PTX = gl.constexpr(scaled_pairs_ptx(True))
    _ONE_MULTIPLY_MAX_BYTE = gl.constexpr(ONE_MULTIPLY_MAX_BYTE)
    _HALF_N = gl.constexpr(HALF_N)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _BLOCK_K = gl.constexpr(BLOCK_K)

    # A half's words [64 columns, 8 words] as the operand layout wants them: lane bits 2-4 and the
    # register bit 8 pick the row within 16 (the warp bits the 16-row quarter), lane bits 0-1 the
    # word pair, the other register bit the word of the pair.
    _WORDS_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HALF_N, BLOCK_K // 8]))

    # A half's scales [2 blocks, 64 columns] as each thread's words need them: the block of its word
    # pair (lane bit 1), both rows of its operand registers; lane bit 0 takes the same bytes.
    _SCALES_LAYOUT = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 8]], lane_bases=[[0, 0], [1, 0], [0, 1], [0, 2], [0, 4]], warp_bases=[[0, 16], [0, 32]],
        block_bases=[], shape=[BLOCK_K // 32, HALF_N]))

    @gluon.jit
    def _produce(operands, scalars, K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
                 ONE_MULTIPLY: gl.constexpr):
        """The producer warp: :func:`flatep.kernels.mxfp4_wgmma._load_steps`."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, p_bufs, bars = operands
        load_ready, load_empty = bars
        _load_steps((a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc), a_bufs, w_bufs, s_bufs, load_ready, load_empty,
                    scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)

    @gluon.jit
    def _permuted_rows(a_buf, TILE_M: gl.constexpr):
        """A stage's rows ``[TILE_M, 64]`` bf16 in the MMA's K order (see the module docstring): column
        ``8 * (l + 2 * h) + p + 4 * e`` to position ``e + 2 * h + 8 * l + 16 * p``."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        rows = gl.reshape(a_buf.load(layout), [TILE_M, 4, 2, 2, 4])  # [.., h, l, e, p]
        return gl.reshape(gl.permute(rows, (0, 4, 2, 1, 3)), [TILE_M, _BLOCK_K])  # [.., p, l, h, e]

    @gluon.jit
    def _operand_weights(words_buf, scales_buf, largest, a_op: gl.constexpr, ONE_MULTIPLY: gl.constexpr):
        """A half's weights: int32 words ``[64, 8]`` and uint8 e8m0 scales ``[2, 64]`` (blocks by columns)
        in shared memory -> bf16 ``[64, 64]`` in the MMA's K order, in the operand layout ``a_op``;
        ``largest`` ``[2, 64]``, the largest scale byte each position has read."""
        exponent = scales_buf.load(_SCALES_LAYOUT).to(gl.int32)
        pairs, largest = _scale_pairs(exponent, largest, ONE_MULTIPLY)
        if ONE_MULTIPLY:
            ptx: gl.constexpr = _ONE_MULTIPLY_PTX
        else:
            ptx: gl.constexpr = _PTX
        # Word w of a step lies in scale block w // 4.
        words = gl.reshape(words_buf.load(_WORDS_LAYOUT), [_HALF_N, 2, 4])
        pairs = gl.convert_layout(gl.permute(pairs, (1, 0)), gl.SliceLayout(2, words.type.layout), assert_trivial=True)
        words, pairs = gl.broadcast(words, gl.expand_dims(pairs, 2))
        p0, p1, p2, p3 = gl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r,r", [words, pairs],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32), is_pure=True,
                                                   pack=1)
        # join(join(p0, p2), join(p1, p3)) puts pair p at position p of the last dimension.
        pair = gl.reshape(gl.join(gl.join(p0, p2), gl.join(p1, p3)), [_HALF_N, 8, 4])  # [.., w, p]
        low = pair.to(gl.int16).to(gl.bfloat16, bitcast=True)
        high = (pair >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)
        values = gl.reshape(gl.join(low, high), [_HALF_N, 4, 2, 4, 2])  # [.., h, l, p, e]
        values = gl.reshape(gl.permute(values, (0, 3, 2, 1, 4)), [_HALF_N, _BLOCK_K])  # [.., p, l, h, e]
        return gl.convert_layout(values, a_op, assert_trivial=True), largest

    @gluon.jit
    def _store_half(acc, out_ptr, stride_om, first, last, column_start, N, mma_layout: gl.constexpr):
        """The transposed product of one half ``acc [64 columns, TILE_M rows]`` fp32 into ``out`` as bf16,
        masked to the tile's group (rows before ``last``) and to ``N``."""
        TILE_M: gl.constexpr = acc.shape[1]
        column = column_start + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, mma_layout))
        row = first + gl.arange(0, TILE_M, layout=gl.SliceLayout(0, mma_layout))
        out = out_ptr + row.to(gl.int64)[None, :] * stride_om + column[:, None]
        gl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(row < last)[None, :] & (column < N)[:, None])

    @gluon.jit
    def _step(a_bufs, w_bufs, s_bufs, p_bufs, load_ready, load_empty, acc0, acc1, largest, count,
              a_op: gl.constexpr, ONE_MULTIPLY: gl.constexpr):
        """The program's K step ``count`` of a tile: the stage's rows (permuted into ``p_bufs[0]``),
        words and scales into registers, the stage handed back, the two halves' MMAs, waited for."""
        STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        stage = count % STAGES
        mbarrier.wait(load_ready.index(stage), (count // STAGES) & 1)
        rows = _permuted_rows(a_bufs.index(stage), TILE_M)
        words, scales = w_bufs.index(stage), s_bufs.index(stage)
        w0, largest = _operand_weights(words.slice(0, _HALF_N), scales.slice(0, _HALF_N, 1), largest, a_op,
                                       ONE_MULTIPLY)
        w1, largest = _operand_weights(words.slice(_HALF_N, _HALF_N), scales.slice(_HALF_N, _HALF_N, 1), largest,
                                       a_op, ONE_MULTIPLY)
        # The previous step's MMAs finished before it ended: the buffer is free.
        p_buf = p_bufs.index(0)
        p_buf.store(rows)
        fence_async_shared()
        _cta_barrier()  # every thread's loads are done and its rows stored
        mbarrier.arrive(load_empty.index(stage), count=1)
        acc0 = warpgroup_mma(w0, p_buf.permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(w1, p_buf.permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        return acc0, acc1, largest

    @gluon.jit
    def _overlapped_steps(a_bufs, w_bufs, s_bufs, p_bufs, load_ready, load_empty, acc0, acc1, largest, count,
                          STEPS: gl.constexpr, a_op: gl.constexpr, ONE_MULTIPLY: gl.constexpr):
        """The program's K steps ``count .. count + STEPS - 1`` of a tile, unrolled, each half's decode
        beside the MMA issued before it: step ``i`` stores its permuted rows in ``p_bufs[i % 2]``
        (the MMAs of step ``i - 2``, which read that buffer, are done), decodes its first half while
        the previous step's second-half MMA runs and issues that half's MMA, then waits for the
        previous step's MMA and decodes its second half while its first-half MMA runs. At most one
        half's decoded weights are in flight in an MMA beside the half being decoded: the registers
        of the plain step (:func:`_step`). Ends with no MMA in flight: ptxas serializes every
        warp-group MMA of a kernel where one is in flight across a loop's back edge
        (:mod:`flatep.kernels.fp8_wgmma`)."""
        STAGES: gl.constexpr = a_bufs.shape[0]
        TILE_M: gl.constexpr = a_bufs.shape[1]
        for i in gl.static_range(STEPS):
            stage = (count + i) % STAGES
            mbarrier.wait(load_ready.index(stage), ((count + i) // STAGES) & 1)
            p_buf = p_bufs.index(i % 2)
            p_buf.store(_permuted_rows(a_bufs.index(stage), TILE_M))
            words, scales = w_bufs.index(stage), s_bufs.index(stage)
            w0, largest = _operand_weights(words.slice(0, _HALF_N), scales.slice(0, _HALF_N, 1), largest, a_op,
                                           ONE_MULTIPLY)
            fence_async_shared()
            _cta_barrier()  # every thread's rows stored
            acc0 = warpgroup_mma(w0, p_buf.permute((1, 0)), acc0, is_async=True)
            if i > 0:  # the previous step's second half: its weights' registers are free again
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, acc1))
            w1, largest = _operand_weights(words.slice(_HALF_N, _HALF_N), scales.slice(_HALF_N, _HALF_N, 1),
                                           largest, a_op, ONE_MULTIPLY)
            _cta_barrier()  # every thread's loads of the stage are done
            mbarrier.arrive(load_empty.index(stage), count=1)
            acc1 = warpgroup_mma(w1, p_buf.permute((1, 0)), acc1, is_async=True)
            if i + 1 < STEPS:  # this step's first half: its registers are free for the next step's
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=1, deps=(acc0, acc1))
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        return acc0, acc1, largest

    @gluon.jit
    def _consume(operands, scalars, K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr,
                 ONE_MULTIPLY: gl.constexpr, CHUNK: gl.constexpr):
        """The consumer warp group: per tile, the K steps one by one (``CHUNK`` 1, :func:`_step`) or in
        unrolled chunks of ``CHUNK`` (:func:`_overlapped_steps`), then the two halves stored; then, in
        the first pass, the flag if any scale byte read was past 128."""
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, p_bufs, bars = operands
        load_ready, load_empty = bars
        out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most = scalars
        TILE_M: gl.constexpr = a_bufs.shape[1]
        CHUNKS: gl.constexpr = K // _BLOCK_K // CHUNK
        TAIL: gl.constexpr = K // _BLOCK_K % CHUNK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TILE_M, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                TILE_M, _BLOCK_N, GROUPS, ONE_MULTIPLY, 4)
        starts, ends, tiles, passed, total = table
        largest = gl.zeros([_BLOCK_K // 32, _HALF_N], gl.int32, _SCALES_LAYOUT)
        count = 0
        while tile < total:
            _, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, TILE_M, _BLOCK_N,
                                                      GROUP_M)
            acc0 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            acc1 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            if CHUNK == 1:
                for _ in range(K // _BLOCK_K):
                    acc0, acc1, largest = _step(a_bufs, w_bufs, s_bufs, p_bufs, load_ready, load_empty, acc0, acc1,
                                                largest, count, a_op, ONE_MULTIPLY)
                    count += 1
            else:
                for _ in range(CHUNKS):
                    acc0, acc1, largest = _overlapped_steps(a_bufs, w_bufs, s_bufs, p_bufs, load_ready, load_empty,
                                                            acc0, acc1, largest, count, CHUNK, a_op, ONE_MULTIPLY)
                    count += CHUNK
                if TAIL > 0:
                    acc0, acc1, largest = _overlapped_steps(a_bufs, w_bufs, s_bufs, p_bufs, load_ready, load_empty,
                                                            acc0, acc1, largest, count, TAIL, a_op, ONE_MULTIPLY)
                    count += TAIL
            _store_half(acc0, out_ptr, stride_om, first, last, first_column, N, mma_layout)
            _store_half(acc1, out_ptr, stride_om, first, last, first_column + _HALF_N, N, mma_layout)
            tile += gl.num_programs(0)
        if ONE_MULTIPLY:
            if gl.max(gl.max(largest, axis=1), axis=0) > _ONE_MULTIPLY_MAX_BYTE:
                gl.store(redo_ptr, 1)

    @gluon.jit
    def _mxfp4_swap_kernel(
        a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, out_ptr, offsets_ptr, redo_ptr, groups, split, split_start,
        N, stride_om, rows_above, rows_at_most,
        K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr,
        ONE_MULTIPLY: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Groups ``[0, split)`` read ``w_desc`` and ``s_desc``, groups ``[split, groups)`` the slot
        descriptors from row ``split_start``; the word descriptors view the words as ``[experts * N,
        K/8]`` int32, the scale descriptors the scales as ``[experts * K/32, N]`` uint8; ``a_desc``'s
        box is the row tile, ``[BLOCK_M, 64]``."""
        gl.static_assert(K % _BLOCK_K == 0, "K must be a multiple of BLOCK_K")
        TILE_M: gl.constexpr = a_desc.block_type.shape[0]
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, TILE_M, _BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, _BLOCK_N, _BLOCK_K // 8], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES, _BLOCK_K // 32, _BLOCK_N], s_desc.layout)
        # One buffer of permuted rows per step an MMA may still read while the next step stores its own.
        p_bufs = gl.allocate_shared_memory(gl.bfloat16, [2 if CHUNK > 1 else 1, TILE_M, _BLOCK_K], a_desc.layout)
        load_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        load_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(load_ready.index(i), count=1)
            mbarrier.init(load_empty.index(i), count=1)
        operands = (a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, a_bufs, w_bufs, s_bufs, p_bufs,
                    (load_ready, load_empty))
        scalars = (out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above, rows_at_most)
        gl.warp_specialize([
            (_consume, (operands, scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY, CHUNK)),
            (_produce, (operands, scalars, K, GROUP_M, GROUPS, ONE_MULTIPLY)),
        ], [1], [PRODUCER_REGISTERS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(load_ready.index(i))
            mbarrier.invalidate(load_empty.index(i))


def mxfp4_swap_launch(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_values: torch.Tensor,
    slot_scales: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, split: int, slot_base: int,
    rows_above: int, rows_at_most: int, block_m: int, group_m: int, stages: int, programs: int,
    programs_per_sm: int,
) -> None:
    """Both passes of the kernel on checked operands (those :func:`flatep.kernels.mxfp4_wgmma.fits`
    accepts, slots too): ``rows [M, K]`` bf16, ``values [G, N, K/2]`` uint8 words with ``scales [G,
    N, K/32]`` uint8 column-fastest (and the slots' alike), ``out [M, N]`` bf16, ``offsets [groups]``
    int32; row tiles of ``block_m`` (one of :data:`BLOCK_M`) rows, ``stages`` of copies in flight,
    over ``programs`` programs of :func:`max_registers` ``(programs_per_sm)`` registers a thread."""
    if block_m not in BLOCK_M:
        raise ValueError(f"block_m must be one of {BLOCK_M}, got {block_m}")
    operands = descriptors(rows, values, scales, slot_values, slot_scales, block_m, BLOCK_N)
    redo = torch.zeros(1, dtype=torch.int32, device=rows.device)
    groups = offsets.shape[0]
    for one_multiply in (True, False):
        _mxfp4_swap_kernel[(programs, )](
            *operands, out, offsets, redo, groups, split, slot_base, values.shape[1], out.stride(0), rows_above,
            rows_at_most, K=rows.shape[1], GROUP_M=group_m, GROUPS=triton.next_power_of_2(groups), STAGES=stages,
            ONE_MULTIPLY=one_multiply, PRODUCER_REGISTERS=PRODUCER_REGISTERS, CHUNK=CHUNK_STEPS, num_warps=NUM_WARPS,
            maxnreg=max_registers(programs_per_sm),
        )
