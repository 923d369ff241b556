"""Prototype, measured but not used by FlatEP's layers: mxfp4 weights times fp8 activations on
Hopper's fp8 warp-group MMA, for groups of at most 16, 32 or 64 rows (one launch per row tile).

FlatEP's mxfp4 kernels multiply bf16 activations by weights decoded to bf16 in registers, and on
Hopper that decode, not memory, bounds them at decode sizes. Here the decode makes e4m3 bytes instead,
four weights a byte permute:

- Weights in a word layout of their own (:func:`to_mma_words`): per row and 32-wide scale block,
  lane ``q``'s 32-bit word holds columns ``4q .. 4q+3`` (``a_j``) and ``4q+16 .. 4q+19`` (``b_j``), the
  K positions the fp8 MMA's first operand gives that lane; the magnitude bits of ``a_j`` at bits
  ``4j .. 4j+2``, its sign at bit ``8j+7``, those of ``b_j`` at bits ``16+4j ..`` and ``8j+3``.
- A word decodes (:data:`DECODE_PTX`, 7 instructions for 8 weights) by two ``prmt`` byte permutes
  through an 8-byte table, the e4m3 bytes of the 8 e2m1 magnitudes times ``2**(scale - CENTER)``, built
  per row and block with two integer multiply-adds from the e8m0 scale byte; the signs are ORed in.
  Exact (e4m3 holds every e2m1 value times a power of two in its normal range) for scale bytes
  ``LOW .. HIGH``; a launch that reads any other byte sets its flag (``check=True``), and the caller
  must then compute it another way (the prototype has no second pass).
- Activations ``x [M, K]`` bf16 become ``hi = e4m3(x * 2**t)`` and ``lo = e4m3(x * 2**t - hi)`` with a
  power of two ``2**t`` per row (:func:`split_rows`, or :mod:`split` on the GPU), so that ``hi + lo``
  carry bf16's 8 significant bits (exactly, where ``lo`` is a normal e4m3); the MMA sums both, and the
  epilogue multiplies by ``2**(CENTER - 127 - t)``.

A persistent, warp-specialized Gluon kernel like :mod:`flatep.kernels.mxfp4_swap` (the product
transposed: the weights' 64-column halves on the MMA's M side, from registers; the rows on its N
side from shared memory), but its activations come by TMA straight into the MMA's shared-memory
operand (no copy into a permuted K order), and its MMAs are fp8 (k = 32, one scale block).
``python bench/scripts/fp8mma/checks.py`` checks it against a dense fp32 product and times it
against FlatEP's kernels; the K loop's instruction counts come from a local sm_90 compile
(``tests/bench/test_fp8mma_prototype.py``).
"""
from __future__ import annotations

import torch
import triton

from flatep.kernels.fp8_wgmma import gluon

if gluon is not None:
    from flatep.kernels.fp8_wgmma import (TensorDescriptor, _find_tile, _tma_load, gl, mbarrier, warpgroup_mma,
                                          warpgroup_mma_wait)
    from flatep.kernels.mxfp4_wgmma import _tiles

HALF_N = 64
BLOCK_N = 128
NUM_WARPS = 4
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


def to_mma_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 nibbles ``[..., K]`` uint8 (``0..15``, sign in bit 3), K a multiple of 32 -> words
    ``[..., K/8]`` int32 in this kernel's layout (see the module docstring): word ``4 * block + q``
    of a row holds columns ``32 * block + 4q + j`` and ``32 * block + 16 + 4q + j``, ``j`` in 0..3."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 32:
        raise ValueError(f"codes must be [..., K] uint8 with K a multiple of 32, got {codes.dtype} {list(codes.shape)}")
    *lead, k = codes.shape
    c = codes.reshape(*lead, k // 32, 2, 4, 4).to(torch.int64)  # [.., block, h, q, j]: column 16h + 4q + j
    a, b = c[..., 0, :, :], c[..., 1, :, :]  # [.., block, q, j]
    j = torch.arange(4, device=codes.device)
    word = (((a & 7) << (4 * j)) | ((a >> 3) << (8 * j + 7)) | ((b & 7) << (16 + 4 * j))
            | ((b >> 3) << (8 * j + 3))).sum(-1)
    word = torch.where(word >= 1 << 31, word - (1 << 32), word)
    return word.to(torch.int32).reshape(*lead, k // 8)


def split_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [M, K]`` bf16 -> ``hi_lo [2M, K]`` fp8 e4m3 (``hi`` rows, then ``lo`` rows) and ``factor [M]``
    fp32, ``2**(CENTER - 127 - t)``: each row times ``2**t`` has its largest magnitude in ``(128, 256]``."""
    x = rows.float()
    amax = x.abs().amax(1).clamp_min(2.0 ** -100)
    t = 8 - torch.ceil(torch.log2(amax))
    scaled = x * torch.exp2(t)[:, None]
    hi = scaled.to(torch.float8_e4m3fn)
    lo = (scaled - hi.float()).to(torch.float8_e4m3fn)
    return torch.cat([hi, lo]), torch.exp2(CENTER - 127 - t)


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
    def _produce(a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M,
                 K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr):
        """The producer warp: each K step's hi and lo row tiles (rows ``first`` and ``M + first`` of
        ``hi_lo``), weight words and scales copied by TMA into the ring of stages."""
        out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split, split_start, N, stride_om, rows_above, \
            rows_at_most = scalars
        STAGES: gl.constexpr = a_bufs[0].shape[0]
        TILE_M: gl.constexpr = a_bufs[0].shape[1]
        BLOCK_K: gl.constexpr = a_bufs[0].shape[2]
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                TILE_M, _BLOCK_N, GROUPS, True, 1)
        starts, ends, tiles, passed, total = table
        step_bytes: gl.constexpr = 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
        count = 0
        while tile < total:
            group, first, _, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, TILE_M, _BLOCK_N,
                                                       GROUP_M)
            word_row = group * N + first_column
            scale_row = group * (K // 32)
            for step in range(K // BLOCK_K):
                stage = count % STAGES
                mbarrier.wait(load_empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = load_ready.index(stage)
                mbarrier.expect(bar, step_bytes)
                _tma_load(a_desc, [first, step * BLOCK_K], bar, a_bufs[0].index(stage))
                _tma_load(a_desc, [M + first, step * BLOCK_K], bar, a_bufs[1].index(stage))
                _tma_load(w_desc, [word_row, step * (BLOCK_K // 8)], bar, w_bufs.index(stage))
                _tma_load(s_desc, [scale_row + step * (BLOCK_K // 32), first_column], bar, s_bufs.index(stage))
                count += 1
            tile += gl.num_programs(0)

    @gluon.jit
    def _operand_weights(words_buf, scales_buf, smallest, largest, a_op: gl.constexpr, WL: gl.constexpr,
                         SL: gl.constexpr, BLOCK_K: gl.constexpr, CHECK: gl.constexpr):
        """A half's words ``[64, BLOCK_K / 8]`` int32 and scales ``[BLOCK_K / 32, 64]`` uint8 in shared
        memory -> fp8 ``[64, BLOCK_K]`` in the MMA's operand layout ``a_op`` (K in natural order), and
        the smallest and largest scale bytes read so far (``CHECK``)."""
        exponent = scales_buf.load(SL).to(gl.int32)
        if CHECK:
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
    def _consume(a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M,
                 K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr,
                 CHECK: gl.constexpr):
        """The consumer warp group: per K step, the two halves' weights decoded, each half's MMAs on
        the hi and the lo rows, the stage handed back once they finished; per tile, the halves stored."""
        out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split, split_start, N, stride_om, rows_above, \
            rows_at_most = scalars
        STAGES: gl.constexpr = a_bufs[0].shape[0]
        TILE_M: gl.constexpr = a_bufs[0].shape[1]
        BLOCK_K: gl.constexpr = a_bufs[0].shape[2]
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, TILE_M, 32])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=4)
        g, table, tile = _tiles(offsets_ptr, redo_ptr, groups, split, split_start, N, rows_above, rows_at_most,
                                TILE_M, _BLOCK_N, GROUPS, True, 4)
        starts, ends, tiles, passed, total = table
        smallest = gl.full([BLOCK_K // 32, _HALF_N], 255, gl.int32, SL)
        largest = gl.zeros([BLOCK_K // 32, _HALF_N], gl.int32, SL)
        count = 0
        while tile < total:
            _, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, TILE_M, _BLOCK_N,
                                                      GROUP_M)
            acc0 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            acc1 = gl.zeros([_HALF_N, TILE_M], gl.float32, mma_layout)
            for step in range(K // BLOCK_K):
                stage = count % STAGES
                mbarrier.wait(load_ready.index(stage), (count // STAGES) & 1)
                words, scales = w_bufs.index(stage), s_bufs.index(stage)
                hi = a_bufs[0].index(stage).permute((1, 0))
                lo = a_bufs[1].index(stage).permute((1, 0))
                w0, smallest, largest = _operand_weights(words.slice(0, _HALF_N), scales.slice(0, _HALF_N, 1),
                                                         smallest, largest, a_op, WL, SL, BLOCK_K, CHECK)
                w1, smallest, largest = _operand_weights(words.slice(_HALF_N, _HALF_N),
                                                         scales.slice(_HALF_N, _HALF_N, 1), smallest, largest, a_op,
                                                         WL, SL, BLOCK_K, CHECK)
                acc0 = warpgroup_mma(w0, hi, acc0, is_async=True)
                acc0 = warpgroup_mma(w0, lo, acc0, is_async=True)
                acc1 = warpgroup_mma(w1, hi, acc1, is_async=True)
                acc1 = warpgroup_mma(w1, lo, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
                mbarrier.arrive(load_empty.index(stage), count=1)
                count += 1
            _store_half(acc0, out_ptr, factor_ptr, stride_om, first, last, first_column, N, mma_layout)
            _store_half(acc1, out_ptr, factor_ptr, stride_om, first, last, first_column + _HALF_N, N, mma_layout)
            tile += gl.num_programs(0)
        if CHECK:
            lowest = gl.min(gl.min(smallest, axis=1), axis=0)
            if (lowest < _LOW) | (gl.max(gl.max(largest, axis=1), axis=0) > _HIGH):
                gl.store(redo_ptr, 1)

    @gluon.jit
    def _fp8mma_kernel(a_desc, w_desc, s_desc, out_ptr, offsets_ptr, redo_ptr, factor_ptr, groups, split,
                       split_start, N, stride_om, rows_above, rows_at_most, M,
                       K: gl.constexpr, GROUP_M: gl.constexpr, GROUPS: gl.constexpr, STAGES: gl.constexpr,
                       PRODUCER_REGISTERS: gl.constexpr, WL: gl.constexpr, SL: gl.constexpr, CHECK: gl.constexpr,
                       num_warps: gl.constexpr):
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
            (_consume, (a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M, K,
                        GROUP_M, GROUPS, WL, SL, CHECK)),
            (_produce, (a_desc, w_desc, s_desc, a_bufs, w_bufs, s_bufs, load_ready, load_empty, scalars, M, K,
                        GROUP_M, GROUPS)),
        ], [1], [PRODUCER_REGISTERS])
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(load_ready.index(i))
            mbarrier.invalidate(load_empty.index(i))


def descriptors(hi_lo: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, block_m: int, block_k: int) -> tuple:
    """TMA descriptors of ``hi_lo [2M, K]`` fp8, ``words [G, N, K/8]`` int32 and ``scales [G, K/32, N]``
    uint8 (column-fastest, as pools hold them) for row tiles of ``block_m`` and K steps of ``block_k``."""
    def descriptor(tensor, box, dtype):
        layout = gl.NVMMASharedLayout.get_default_for(list(box), dtype)
        return TensorDescriptor(tensor, list(tensor.shape), list(tensor.stride()), box, layout)
    return (descriptor(hi_lo, [block_m, block_k], gl.float8e4nv),
            descriptor(words.flatten(0, 1), [BLOCK_N, block_k // 8], gl.int32),
            descriptor(scales.flatten(0, 1), [block_k // 32, BLOCK_N], gl.uint8))


def _check_operands(hi_lo: torch.Tensor, factor: torch.Tensor, words: torch.Tensor, scales: torch.Tensor,
                    out: torch.Tensor, offsets: torch.Tensor, block_m: int, block_k: int) -> None:
    """Raise ``ValueError`` naming the first operand of :func:`launch` that does not fit."""
    if block_m not in (16, 32, 64) or block_k not in (64, 128):
        raise ValueError(f"block_m must be 16, 32 or 64 and block_k 64 or 128, got {block_m} and {block_k}")
    if words.dtype != torch.int32 or words.dim() != 3 or not words.is_contiguous():
        raise ValueError(f"words must be a contiguous [G, N, K/8] int32 tensor, got {words.dtype} {list(words.shape)}")
    groups, columns, inner = words.shape[0], words.shape[1], 8 * words.shape[2]
    rows = out.shape[0]
    expected = {
        "hi_lo": (hi_lo, torch.float8_e4m3fn, (2 * rows, inner)), "factor": (factor, torch.float32, (rows,)),
        "scales": (scales, torch.uint8, (groups, inner // 32, columns)), "offsets": (offsets, torch.int32, (groups,)),
    }
    for name, (tensor, dtype, shape) in expected.items():
        if tensor.dtype != dtype or tuple(tensor.shape) != shape or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {list(shape)} {dtype} tensor, got {tensor.dtype} "
                             f"{list(tensor.shape)}")
    if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[1] != columns or out.stride(1) != 1:
        raise ValueError(f"out must be a [M, {columns}] bfloat16 tensor with unit column stride, got {out.dtype} "
                         f"{list(out.shape)}")
    if inner % block_k:
        raise ValueError(f"K = {inner} must be a multiple of block_k = {block_k}")


def launch(hi_lo: torch.Tensor, factor: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
           offsets: torch.Tensor, block_m: int = 32, block_k: int = 128, stages: int = 3, check: bool = True,
           programs_per_sm: int = 3, max_registers: int = 80, producer_registers: int = 40, group_m: int = 8,
           group_rows: tuple[int, int] | None = None) -> torch.Tensor:
    """``out[i] = rows[i] @ W[g(i)].T`` as bf16 for the groups (``offsets [G]`` int32 inclusive ends) of
    more than ``group_rows[0]`` and at most ``group_rows[1]`` rows (default ``(0, block_m)``), in row tiles
    of ``block_m``, from :func:`split_rows`'s ``hi_lo`` and ``factor`` and the weights ``words [G, N,
    K/8]`` (:func:`to_mma_words`) with ``scales [G, K/32, N]`` uint8; ``programs_per_sm`` programs an SM
    at ``max_registers`` a thread. Returns the one-element int32 flag: 1 where ``check`` found a scale
    byte outside ``LOW .. HIGH`` (those products are wrong)."""
    _check_operands(hi_lo, factor, words, scales, out, offsets, block_m, block_k)
    M = out.shape[0]
    rows_above, rows_at_most = group_rows or (0, block_m)
    redo = torch.zeros(1, dtype=torch.int32, device=out.device)
    groups = offsets.shape[0]
    programs = programs_per_sm * torch.cuda.get_device_properties(out.device).multi_processor_count
    _fp8mma_kernel[(programs, )](
        *descriptors(hi_lo, words, scales, block_m, block_k), out, offsets, redo, factor, groups, groups, 0,
        words.shape[1], out.stride(0), rows_above, rows_at_most, M, K=hi_lo.shape[1], GROUP_M=group_m,
        GROUPS=triton.next_power_of_2(groups), STAGES=stages, PRODUCER_REGISTERS=producer_registers,
        WL=words_layout(block_k), SL=scales_layout(block_k), CHECK=check, num_warps=NUM_WARPS, maxnreg=max_registers)
    return redo
