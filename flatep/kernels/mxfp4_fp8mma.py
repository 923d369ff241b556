"""The mxfp4 grouped GEMM with fp8 activations, for Hopper (sm_90), in Gluon: mxfp4 weights decoded
into e4m3 and multiplied by the rows split into two e4m3 parts on the fp8 warp-group MMA, for expert
pools that hold the ``mma`` layout (:data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`).

FlatEP's bf16 mxfp4 kernels (:mod:`flatep.kernels.mxfp4_swap`, the Triton tiles) decode each weight
into bf16 in registers, and on Hopper that decode, not memory, bounds them at decode sizes. Here the
decode makes e4m3 bytes, four weights a byte permute:

- The weights lie in the ``mma`` layout (:func:`flatep.quant.mxfp4.to_mma_layout`): per row and
  32-wide scale block, lane ``q``'s 32-bit word holds columns ``4q .. 4q+3`` (``a_j``) and
  ``4q+16 .. 4q+19`` (``b_j``), the K positions the fp8 MMA's first operand gives that lane; the
  magnitude bits of ``a_j`` at bits ``4j .. 4j+2``, its sign at bit ``8j+7``, those of ``b_j`` at
  bits ``16+4j ..`` and ``8j+3``.
- A word decodes (:data:`DECODE_PTX`, 7 instructions for 8 weights, against 13 for the bf16 decode)
  by two ``prmt`` byte permutes through an 8-byte table, the e4m3 bytes of the 8 e2m1 magnitudes
  times ``2**(scale - CENTER)``, built per row and block with two integer multiply-adds from the
  e8m0 scale byte; the signs are ORed in. Exact (e4m3 holds every e2m1 value times a power of two in
  its normal range) for scale bytes ``LOW .. HIGH``. A tile that reads any other byte flags its group's
  128 columns, and :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` then computes those
  columns again in bf16 (the Triton tiles' exact pass over the same layout), on the device, with no
  sync: a checkpoint's rare outlying blocks cost the tiles that read them, not the launch.
- The rows ``x [M, K]`` bf16 come as ``hi = e4m3(x * 2**t)`` and ``lo = e4m3(x * 2**t - hi)``, a power
  of two ``2**t`` per row (:func:`flatep.kernels.fp8_split.split_rows_triton`), so that ``hi + lo``
  carry bf16's 8 significant bits (exactly for values at least ``2**-9`` of their row's largest); the
  MMA sums both, and the epilogue multiplies by the row's ``2**(CENTER - 127 - t)``.

A persistent, warp-specialized kernel like :mod:`flatep.kernels.mxfp4_swap` (the product transposed:
the weights' 64-column halves on the MMA's M side, from registers; the rows on its N side from shared
memory), with the same tile numbering and borrow slots, but its activations come by TMA straight into
the MMA's shared-memory operand (no copy into a permuted K order), and its MMAs are fp8 (k = 32, one
scale block). A producer warp copies each K step's hi and lo rows, words and scales into a ring of
stages; the consumer warp group decodes both halves' weights and issues four MMAs a step, and by
default (:data:`CHUNK_STEPS` = 1) waits for them before the next step. With ``CHUNK_STEPS`` of 2 it
decodes each half while the MMAs issued before it run (:func:`_overlapped_steps`, as
:mod:`flatep.kernels.mxfp4_swap` does): a candidate, not yet run on a GPU, that compiles without
spills only at 128 registers a thread (2 programs an SM for the 32-row tile;
``bench/scripts/chunk_candidate.py``).

Measured as a prototype on an H100 (bench/results/2026-12-07-h100-j and -k; the split not included):
one Kimi-K3 rank's gate/up GEMM at 32 rows per expert took 502-509 us against 563-564 us for
:mod:`flatep.kernels.mxfp4_swap`, the down GEMM 259 against 278-282 us, and at 64 rows (64-row tiles,
2 programs an SM) 617-622 us against 760-827 us for the Triton 64-row tile; relative error against a
dense fp32 product 2.2-2.3e-3, against 1.65e-3 for the bf16 kernels. Gluon has no interpreter: this
kernel runs on Hopper GPUs only; the CPU tests compile it for sm_90.
"""
from __future__ import annotations

import torch
import triton

from flatep.kernels.backend import tma_fits
from flatep.kernels.fp8_wgmma import gluon

if gluon is not None:
    from flatep.kernels.fp8_wgmma import _find_tile, gl, mbarrier, warpgroup_mma, warpgroup_mma_wait
    from flatep.kernels.mxfp4_wgmma import _load_steps, _tiles
    from flatep.kernels.mxfp4_wgmma import descriptors as tma_descriptors

HALF_N = 64
BLOCK_N = 128
BLOCK_M = (16, 32, 64)
"""Row tiles this kernel takes (the warp-group MMA's N side)."""
BLOCK_K = (64, 128)
NUM_WARPS = 4  # the consumer warp group's (the default partition's)
PRODUCER_REGISTERS = 40
CHUNK_STEPS = 1
"""K steps the consumer unrolls into one chunk, each half's decode beside the MMAs issued before it
(:func:`_overlapped_steps`; a candidate, not yet run on a GPU); 1: every step waits for its own MMAs
before the next step's decode."""
CENTER = 123
"""The scale byte whose table is the e2m1 magnitudes themselves."""
LOW, HIGH = CENTER - 5, CENTER + 6
"""Scale bytes the decode is exact for: ``0.5 * 2**(LOW - CENTER)`` is e4m3's smallest normal power of
two (``2**-6``), ``6 * 2**(HIGH - CENTER)`` = 384 stays below its largest finite value, 448."""
E2M1_E4M3 = (0x00, 0x30, 0x38, 0x3C, 0x40, 0x44, 0x48, 0x4C)
"""The e4m3 bytes of the e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6: a scale byte ``CENTER + d`` adds
``8 * d`` to each nonzero one (its exponent field), which no byte carries out of within ``LOW .. HIGH``."""


def _as_int32(bits: int) -> int:
    bits &= 0xFFFFFFFF
    return bits - (1 << 32) if bits >= 1 << 31 else bits


def _table_word(entries: tuple[int, ...]) -> int:
    return sum(entry << (8 * index) for index, entry in enumerate(entries))


# Table words for scale byte s: s * STEP + BASE (int32 wrap-around), entries 0-3 and 4-7.
STEP0, STEP1 = 0x08080800, 0x08080808  # entry 0 (zero) stays zero
TABLE0 = _as_int32(_table_word(E2M1_E4M3[:4]) - CENTER * STEP0)
TABLE1 = _as_int32(_table_word(E2M1_E4M3[4:]) - CENTER * STEP1)

DECODE_PTX = """{
.reg .b32 x, s, m;
and.b32 x, $2, 0x77777777;
prmt.b32 m, $3, $4, x;
lop3.b32 $0, m, $2, 0x80808080, 0xF8;
shr.b32 x, x, 16;
prmt.b32 m, $3, $4, x;
shl.b32 s, $2, 4;
lop3.b32 $1, m, s, 0x80808080, 0xF8;
}"""


def words_layout(block_k: int):
    """A half's words ``[64 columns, block_k / 8]`` as the fp8 operand layout wants them: word ``4 * block +
    q`` to lane ``q`` of each four (lane bits 0-1), lane bits 2-4 the column within 8, the warps the
    16-column quarters; a thread's registers: its word of each block, of columns ``c`` and ``c + 8``."""
    blocks = [[0, 4 << i] for i in range((block_k // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=blocks + [[8, 0]], lane_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[HALF_N, block_k // 8])


def scales_layout(block_k: int):
    """A half's scales ``[block_k / 32 blocks, 64 columns]`` as each thread's words need them (the four
    lanes of a column share its bytes)."""
    blocks = [[1 << i, 0] for i in range((block_k // 32).bit_length() - 1)]
    return gl.DistributedLinearLayout(
        reg_bases=blocks + [[0, 8]], lane_bases=[[0, 0], [0, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 16], [0, 32]], block_bases=[], shape=[block_k // 32, HALF_N])


if gluon is not None:
    _DECODE_PTX = gl.constexpr(DECODE_PTX)
    _HALF_N = gl.constexpr(HALF_N)
    _BLOCK_N = gl.constexpr(BLOCK_N)
    _TABLE0 = gl.constexpr(TABLE0)
    _STEP0 = gl.constexpr(STEP0)
    _STEP1 = gl.constexpr(STEP1)
    _TABLE1 = gl.constexpr(TABLE1)
    _LOW = gl.constexpr(LOW)
    _HIGH = gl.constexpr(HIGH)

    @gluon.jit
    def _produce(descriptors, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M,
                 K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr):
        """The producer warp: :func:`flatep.kernels.mxfp4_wgmma._load_steps` with each K step's hi and lo
        row tiles (rows ``first`` and ``M + first`` of ``hi_lo``)."""
        out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split, split_start, N, stride_om, rows_above, \
            rows_at_most = scalars
        _load_steps(descriptors, a_bufs[0], w_bufs, s_bufs, load_ready, load_empty,
                    (out_ptr, offsets_ptr, redo_ptr, groups, split, split_start, N, stride_om, rows_above,
                     rows_at_most), K, GROUP_M, GROUPS, True, a_bufs[1], M)

    @gluon.jit
    def _operand_weights(words_buf, scales_buf, smallest, largest, a_op: gl.constexpr, WL: gl.constexpr,
                         SL: gl.constexpr, BLOCK_K: gl.constexpr):
        """A half's words ``[64, BLOCK_K / 8]`` int32 and scales ``[BLOCK_K / 32, 64]`` uint8 in shared
        memory -> fp8 ``[64, BLOCK_K]`` in the MMA's operand layout ``a_op`` (K in natural order), and
        the smallest and largest scale bytes read so far."""
        exponent = scales_buf.load(SL).to(gl.int32)
        smallest = gl.minimum(smallest, exponent)
        largest = gl.maximum(largest, exponent)
        t0 = exponent * _STEP0 + _TABLE0
        t1 = exponent * _STEP1 + _TABLE1
        words = gl.reshape(words_buf.load(WL), [_HALF_N, BLOCK_K // 32, 4])  # [col, block, q]
        slice_layout: gl.constexpr = gl.SliceLayout(2, words.type.layout)
        t0 = gl.convert_layout(gl.permute(t0, (1, 0)), slice_layout, assert_trivial=True)
        t1 = gl.convert_layout(gl.permute(t1, (1, 0)), slice_layout, assert_trivial=True)
        words, t0 = gl.broadcast(words, gl.expand_dims(t0, 2))
        words, t1 = gl.broadcast(words, gl.expand_dims(t1, 2))
        a, b = gl.inline_asm_elementwise(_DECODE_PTX, "=r,=r,r,r,r", [words, t0, t1], dtype=(gl.int32, gl.int32),
                                         is_pure=True, pack=1)
        a0 = a.to(gl.int8)
        a1 = (a >> 8).to(gl.int8)
        a2 = (a >> 16).to(gl.int8)
        a3 = (a >> 24).to(gl.int8)
        b0 = b.to(gl.int8)
        b1 = (b >> 8).to(gl.int8)
        b2 = (b >> 16).to(gl.int8)
        b3 = (b >> 24).to(gl.int8)
        abytes = gl.join(gl.join(a0, a2), gl.join(a1, a3))  # [col, block, q, 2, 2] -> j = 2i + o
        bbytes = gl.join(gl.join(b0, b2), gl.join(b1, b3))
        abytes = gl.reshape(abytes, [_HALF_N, BLOCK_K // 32, 4, 4])
        bbytes = gl.reshape(bbytes, [_HALF_N, BLOCK_K // 32, 4, 4])
        values = gl.join(abytes, bbytes)  # [col, block, q, j, h]
        values = gl.reshape(gl.permute(values, (0, 1, 4, 2, 3)), [_HALF_N, BLOCK_K])  # K = 32blk + 16h + 4q + j
        values = values.to(gl.float8e4nv, bitcast=True)
        return gl.convert_layout(values, a_op, assert_trivial=True), smallest, largest

    @gluon.jit
    def _store_half(acc, out_ptr, factor_ptr, stride_om, first, last, column_start, N, mma_layout: gl.constexpr):
        """One half's transposed product ``acc [64 columns, TILE_M rows]`` times the rows' factors, as bf16."""
        TILE_M: gl.constexpr = acc.shape[1]
        column = column_start + gl.arange(0, _HALF_N, layout=gl.SliceLayout(1, mma_layout))
        row = first + gl.arange(0, TILE_M, layout=gl.SliceLayout(0, mma_layout))
        factor = gl.load(factor_ptr + row, mask=row < last, other=0.0)
        out = out_ptr + row.to(gl.int64)[None, :] * stride_om + column[:, None]
        gl.store(out, (acc * factor[None, :]).to(out_ptr.dtype.element_ty),
                 mask=(row < last)[None, :] & (column < N)[:, None])

    @gluon.jit
    def _overlapped_steps(a_bufs, w_bufs, s_bufs, load_ready, load_empty, acc0, acc1, smallest, largest, count,
                          STEPS: gl.constexpr, a_op: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
                          BLOCK_K: gl.constexpr):
        """The program's K steps ``count .. count + STEPS - 1`` of a tile, unrolled, each half's decode
        beside the MMAs issued before it: step ``i`` decodes its first half while the previous step's
        second-half MMAs run and issues that half's MMAs (hi and lo rows), then waits for the previous
        step's, hands its stage back, and decodes its second half while its first half's MMAs run. At
        most one half's decoded weights are in flight beside the half being decoded, as in the plain
        step. Ends with no MMA in flight: ptxas serializes every warp-group MMA of a kernel where one
        is in flight across a loop's back edge (:mod:`flatep.kernels.fp8_wgmma`)."""
        STAGES: gl.constexpr = a_bufs[0].shape[0]
        previous_stage = count % STAGES
        for i in gl.static_range(STEPS):
            stage = (count + i) % STAGES
            mbarrier.wait(load_ready.index(stage), ((count + i) // STAGES) & 1)
            words, scales = w_bufs.index(stage), s_bufs.index(stage)
            hi = a_bufs[0].index(stage).permute((1, 0))
            lo = a_bufs[1].index(stage).permute((1, 0))
            w0, smallest, largest = _operand_weights(words.slice(0, _HALF_N), scales.slice(0, _HALF_N, 1),
                                                     smallest, largest, a_op, WL, SL, BLOCK_K)
            acc0 = warpgroup_mma(w0, hi, acc0, is_async=True)
            acc0 = warpgroup_mma(w0, lo, acc0, is_async=True)
            if i > 0:  # the previous step's second half: its stage and its weights' registers are free again
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
                mbarrier.arrive(load_empty.index(previous_stage), count=1)
            w1, smallest, largest = _operand_weights(words.slice(_HALF_N, _HALF_N), scales.slice(_HALF_N, _HALF_N, 1),
                                                     smallest, largest, a_op, WL, SL, BLOCK_K)
            acc1 = warpgroup_mma(w1, hi, acc1, is_async=True)
            acc1 = warpgroup_mma(w1, lo, acc1, is_async=True)
            if i + 1 < STEPS:  # this step's first half: its registers are free for the next step's
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=2, deps=(acc0, acc1))
            previous_stage = stage
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        mbarrier.arrive(load_empty.index(previous_stage), count=1)
        return acc0, acc1, smallest, largest

    @gluon.jit
    def _consume(a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M,
                 K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
                 CHUNK: gl.constexpr):
        """The consumer warp group: per K step (``CHUNK`` 1), the two halves' weights decoded, each half's
        MMAs on the hi and the lo rows, the stage handed back once they finished; or the steps in
        unrolled chunks of ``CHUNK`` (:func:`_overlapped_steps`); per tile, the halves stored."""
        out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split, split_start, N, stride_om, rows_above, \
            rows_at_most = scalars
        STAGES: gl.constexpr = a_bufs[0].shape[0]
        TILE_M: gl.constexpr = a_bufs[0].shape[1]
        BLOCK_K: gl.constexpr = a_bufs[0].shape[2]
        CHUNKS: gl.constexpr = K // BLOCK_K // CHUNK
        TAIL: gl.constexpr = K // BLOCK_K % CHUNK
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TILE_M, 32])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                TILE_M, _BLOCK_N, GROUPS, True, 4)
        starts, ends, tiles, passed, total = table
        count = 0
        while tile < total:
            group, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, TILE_M, _BLOCK_N,
                                                          GROUP_M)
            smallest = gl.full([BLOCK_K // 32, _HALF_N], 255, gl.int32, SL)
            largest = gl.zeros([BLOCK_K // 32, _HALF_N], gl.int32, SL)
            acc0 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            acc1 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            if CHUNK == 1:
                for step in range(K // BLOCK_K):
                    stage = count % STAGES
                    mbarrier.wait(load_ready.index(stage), (count // STAGES) & 1)
                    words, scales = w_bufs.index(stage), s_bufs.index(stage)
                    hi = a_bufs[0].index(stage).permute((1, 0))
                    lo = a_bufs[1].index(stage).permute((1, 0))
                    w0, smallest, largest = _operand_weights(words.slice(0, _HALF_N), scales.slice(0, _HALF_N, 1),
                                                             smallest, largest, a_op, WL, SL, BLOCK_K)
                    w1, smallest, largest = _operand_weights(words.slice(_HALF_N, _HALF_N),
                                                             scales.slice(_HALF_N, _HALF_N, 1), smallest, largest,
                                                             a_op, WL, SL, BLOCK_K)
                    acc0 = warpgroup_mma(w0, hi, acc0, is_async=True)
                    acc0 = warpgroup_mma(w0, lo, acc0, is_async=True)
                    acc1 = warpgroup_mma(w1, hi, acc1, is_async=True)
                    acc1 = warpgroup_mma(w1, lo, acc1, is_async=True)
                    acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
                    mbarrier.arrive(load_empty.index(stage), count=1)
                    count += 1
            else:
                for _ in range(CHUNKS):
                    acc0, acc1, smallest, largest = _overlapped_steps(
                        a_bufs, w_bufs, s_bufs, load_ready, load_empty, acc0, acc1, smallest, largest, count, CHUNK,
                        a_op, WL, SL, BLOCK_K)
                    count += CHUNK
                if TAIL > 0:
                    acc0, acc1, smallest, largest = _overlapped_steps(
                        a_bufs, w_bufs, s_bufs, load_ready, load_empty, acc0, acc1, smallest, largest, count, TAIL,
                        a_op, WL, SL, BLOCK_K)
                    count += TAIL
            _store_half(acc0, out_ptr, factor_ptr, stride_om, first, last, first_column, N, mma_layout)
            _store_half(acc1, out_ptr, factor_ptr, stride_om, first, last, first_column + _HALF_N, N, mma_layout)
            lowest = gl.min(gl.min(smallest, axis=1), axis=0)
            if (lowest < _LOW) | (gl.max(gl.max(largest, axis=1), axis=0) > _HIGH):
                gl.store(redo_ptr, 1)
                gl.store(redo_ptr + 1 + group * ((N + _BLOCK_N - 1) // _BLOCK_N) + first_column // _BLOCK_N, 1)
            tile += gl.num_programs(0)

    @gluon.jit
    def _fp8mma_kernel(a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc, out_ptr, offsets_ptr, redo_ptr, factor_ptr,
                       groups, split, split_start, N, stride_om, rows_above, rows_at_most, M,
                       K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr,
                       PRODUCER_REGISTERS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
                       CHUNK: gl.constexpr, num_warps: gl.constexpr):
        """Groups ``[0, split)`` read ``w_desc`` and ``s_desc``, groups ``[split, groups)`` the slot
        descriptors from row ``split_start``; ``a_desc``'s box is a row tile of one K step of ``hi_lo``
        (the hi rows, then from row ``M`` the lo rows)."""
        TILE_M: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
        gl.static_assert(K % BLOCK_K == 0, "K must be a multiple of BLOCK_K")
        a_bufs = (gl.allocate_shared_memory(a_desc.dtype, [STAGES, TILE_M, BLOCK_K], a_desc.layout),
                  gl.allocate_shared_memory(a_desc.dtype, [STAGES, TILE_M, BLOCK_K], a_desc.layout))
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, _BLOCK_N, BLOCK_K // 8], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(s_desc.dtype, [STAGES, BLOCK_K // 32, _BLOCK_N], s_desc.layout)
        load_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        load_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(load_ready.index(i), count=1)
            mbarrier.init(load_empty.index(i), count=1)
        scalars = (out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split, split_start, N, stride_om, rows_above,
                   rows_at_most)
        gl.warp_specialize([
            (_consume, (a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M, K, GROUP_M, GROUPS, WL, SL,
                        CHUNK)),
            (_produce, ((a_desc, w_desc, s_desc, slot_w_desc, slot_s_desc), a_bufs, w_bufs, s_bufs, load_ready,
                        load_empty, scalars, M, K, GROUP_M, GROUPS)),
        ], [1], [PRODUCER_REGISTERS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(load_ready.index(i))
            mbarrier.invalidate(load_empty.index(i))


def flag_count(groups: int, columns: int) -> int:
    """Elements of a launch's flags over ``groups`` groups of ``columns`` output columns: one for the
    launch, then one per group and :data:`BLOCK_N` columns (:func:`mxfp4_fp8mma_launch`)."""
    return 1 + groups * -(-columns // BLOCK_N)


def tiles_outside_window(scales: torch.Tensor) -> torch.Tensor:
    """Which of this kernel's tiles the exact pass computes again, for ``scales [G, N, K/32]`` uint8
    (e8m0 bytes, any strides): ``[G, ceil(N / BLOCK_N)]`` bool, true where a group's 128 columns hold
    a scale byte outside ``LOW .. HIGH`` or reach past ``N`` (where the kernel's copies read zeros).
    What the kernel flags, computed on the weights alone, before any step."""
    if scales.dim() != 3 or scales.dtype != torch.uint8:
        raise ValueError(f"scales must be [G, N, K/32] uint8, got {scales.dtype} {list(scales.shape)}")
    columns = scales.shape[1]
    outside = ((scales < LOW) | (scales > HIGH)).any(2)  # [G, N]
    outside = torch.nn.functional.pad(outside, (0, -columns % BLOCK_N), value=True)
    return outside.unflatten(1, (-1, BLOCK_N)).any(2)


def fits(hi_lo: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block_k: int) -> bool:
    """Whether this kernel's copies take these operands: ``K`` a multiple of ``block_k``, TMA-copyable
    ``hi_lo [2M, K]``, contiguous values ``[G, N, K/2]`` and column-fastest scales ``[G, N, K/32]``
    whose ``[G, K/32, N]`` view is contiguous (as pools hold them), ``out`` with unit column stride.
    ``N`` need not be a multiple of :data:`BLOCK_N`: a tile's copy of scales past ``N`` reads zeros,
    bytes outside the window, so the last 128 columns of such a GEMM are always flagged and computed
    by the exact pass."""
    by_block = scales.transpose(1, 2)
    return (hi_lo.shape[1] % block_k == 0 and values.is_contiguous() and by_block.is_contiguous()
            and all(tma_fits(t) for t in (hi_lo, values, by_block)) and out.stride(1) == 1)


def mxfp4_fp8mma_launch(
    hi_lo: torch.Tensor, factor: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, slot_values: torch.Tensor,
    slot_scales: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, redo: torch.Tensor, split: int,
    slot_base: int, rows_above: int, rows_at_most: int, block_m: int, block_k: int, group_m: int, stages: int,
    programs: int, max_registers: int,
) -> None:
    """The kernel on operands :func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton` has checked
    (and :func:`fits` accepted, slots too): ``hi_lo [2M, K]`` fp8 e4m3 and ``factor [M]`` fp32 (the
    split rows), ``values [G, N, K/2]`` uint8 in the ``mma`` layout with ``scales [G, N, K/32]`` uint8
    column-fastest (and the slots' alike, from group ``split`` on, their rows from ``slot_base``),
    ``out [M, N]`` bf16, ``offsets [groups]`` int32; the groups of more than ``rows_above`` and at
    most ``rows_at_most`` rows, in row tiles of ``block_m`` and K steps of ``block_k``, ``stages``
    copies in flight, over ``programs`` programs of ``max_registers`` registers a thread. ``redo [1 +
    groups * ceil(N / BLOCK_N)]`` int32 (zeros) flags the tiles that read a scale byte outside ``LOW ..
    HIGH``: element ``1 + group * ceil(N / BLOCK_N) + column // BLOCK_N`` for the group's columns from
    ``column``, and element 0 for any (:func:`flag_count` elements)."""
    if block_m not in BLOCK_M or block_k not in BLOCK_K:
        raise ValueError(f"block_m must be one of {BLOCK_M} and block_k one of {BLOCK_K}, got {block_m} and {block_k}")
    groups = offsets.shape[0]
    if redo.dtype != torch.int32 or tuple(redo.shape) != (flag_count(groups, values.shape[1]), ):
        raise ValueError(f"redo must be int32 [{flag_count(groups, values.shape[1])}], got {redo.dtype} "
                         f"{list(redo.shape)}")
    _fp8mma_kernel[(programs, )](
        *tma_descriptors(hi_lo, values, scales, slot_values, slot_scales, block_m, BLOCK_N, block_k), out, offsets,
        redo, factor, groups, split, slot_base, values.shape[1], out.stride(0), rows_above, rows_at_most, out.shape[0],
        K=hi_lo.shape[1], GROUP_M=group_m, GROUPS=triton.next_power_of_2(groups), STAGES=stages,
        PRODUCER_REGISTERS=PRODUCER_REGISTERS, WL=words_layout(block_k), SL=scales_layout(block_k),
        CHUNK=CHUNK_STEPS, num_warps=NUM_WARPS, maxnreg=max_registers)
