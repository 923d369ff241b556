"""The fp8 block-scaled grouped GEMM at prefill sizes, for Hopper (sm_90), in Gluon.

Same contract and tile numbering as :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton` (it calls
this kernel for :class:`flatep.kernels.quant_gemm.GemmConfig` tiles with ``wgmma=True``), with
each K step's product scaled while the next step's MMA runs, which Triton's own ``tl.dot``
does not do on Hopper (Triton 3.6 waits for a warp-group MMA right after issuing it when its
result feeds anything but the next MMA's accumulator; see :mod:`flatep.kernels.quant_gemm`).

Per tile of ``BLOCK_M`` rows (two warp groups of 64 rows on 8 warps) and ``BLOCK_N`` columns:

- TMA copies each 128-wide K step's activation and weight tiles into a ring of ``NUM_STAGES``
  shared-memory stages, each with an mbarrier that the copy's bytes complete. A program's stages
  run on across its tiles: the last steps of a tile load the next tile's first steps, so the
  pipeline does not drain and refill at each tile (and those copies overlap the epilogue);
- each step's MMA runs in two 64-column halves, each issued asynchronously into registers of its
  own (the MMA starts from zero: ``use_acc=False``). After issuing a half the kernel waits until
  only it is outstanding, then adds the previous half's product times its row and weight block
  scales into that half's fp32 sums while this one runs (DeepSeek-V3's fine-grained quantization,
  its promotion to fp32 registers per 128-wide K step; the tensor cores' own sums stay within one
  step, as in FlatEP's Triton tiles: the same relative error, 6.9e-4 at Kimi-K2's shapes). When a
  step's first half is issued, the previous step is done and its stage takes a later step's tiles;
- a whole tile (all its rows in its group, all its columns in N) leaves through two asynchronous
  TMA stores of its bf16 column halves from shared memory, which run on while the next tile's MMAs
  do (the next tile's epilogue waits for them before it reuses that memory); a partial tile is
  stored row-masked to its group (its rows past the group, which TMA also copies in, are other
  groups' or unused rows: a GEMM's output row reads only its own row). At Kimi-K2's shapes, 1024
  rows per expert on an H100, the TMA stores took gate/up from 0.78x to 0.70x bf16's time and
  down from 0.92x to 0.76x (a development A/B against the masked stores, bf16 in the same run).

What shaped it (local sm_90 compiles, Triton 3.6 and its ptxas; ``ptxas -v`` prints the notices):

- halves: the sums and two whole 64 x 128 products took all 255 registers a thread, and ptxas then
  serializes every warp-group MMA of the kernel (notice C7512): halves need 128 registers for
  the four 64 x 64 sets instead of 192;
- unrolled chunks of ``CHUNK`` steps that end with no MMA outstanding: with an MMA in flight across
  a loop's back edge ptxas serialized them all too (C7514, reads of the other product's registers
  it could not place); 8-step chunks ran out of registers (C7512);
- 5 or 6 stages: at 3 the kernel took 255 registers and C7512, at 4 254, at 5 and 6 235-237; with
  the 32 KiB output tile, 6 stages take 224 KiB of shared memory, within Hopper's 227 KiB.

On an H100 (``bench/results/2026-12-06-h100-b``, the bf16 arm in the same run), a Kimi-K2 rank's
experts phase at s = 8192 took 0.814x bf16's time (maxvio 0) and 0.829x (maxvio 10), against
0.992x and 1.11-1.22x with the Triton 64 x 128 tile in earlier sets. One 8-warp program runs per
SM; the compiler puts a CTA barrier around each TMA copy (its shared-memory hazard analysis),
which holds the two warp groups in step.

Gluon (``triton.experimental.gluon``) is Triton's lower-level language with explicit layouts,
shared memory, barriers and asynchronous MMAs; it has no interpreter, so this kernel runs on
Hopper GPUs only (:func:`available`). The CPU tests check the Triton kernel of the same contract,
and compile this one for sm_90 with the installed Triton (tests/kernels/test_fp8_wgmma.py: its
MMAs stay overlapped, no spills). It has run on a GPU with Triton 3.6 (torch 2.11); Triton 3.9
compiles it alike (248 registers a thread, no serialized MMAs), untimed and untested on a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton

from flatep.kernels.grouped_tiles import find_tile, group_tiles

try:  # Gluon is experimental: its module paths moved between Triton releases.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # Triton 3.6 names the TMA copies async_copy_global_to_shared and async_copy_shared_to_global;
    # later releases name them async_load and async_store and raise on the old names.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
except ImportError:  # pragma: no cover - depends on the installed Triton
    gluon = None

FP8_BLOCK = 128
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
CHUNK = 4
"""The tile: 128 x 128 outputs on two warp groups (each 64 x 128, the warp-group MMA's 64 rows), 128-wide
K steps (one scale block); the stages (32 KiB each: activation plus weight tiles) come from
:class:`flatep.kernels.quant_gemm.GemmConfig`'s ``num_stages``. ``CHUNK``: K steps unrolled between
points with no MMA outstanding (see ``_chunk`` and the module docstring): 5, 6, 8 and 16 steps ran out of
registers in a local sm_90 compile (Triton 3.6)."""


def available(device: torch.device) -> bool:
    """Whether this kernel can run on ``device``: a CUDA sm_90 GPU (H100, H200) and a Triton with
    Gluon's Hopper API."""
    return (gluon is not None and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


if gluon is not None:
    _group_tiles = gluon.jit(group_tiles.fn)
    _find_tile = gluon.jit(find_tile.fn)

    @gluon.jit
    def _load_step(a_desc, w_desc, slot_w_desc, source, step, stage, a_bufs, w_bufs, bars, BLOCK_K: gl.constexpr):
        """Copy K step ``step`` of a tile's activation rows and weight columns into ``stage``; ``source``:
        the tile's ``(is_slot, first_row, weight_row)`` (:func:`_tile_source`)."""
        is_slot, first, weight_row = source
        bar = bars.index(stage)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(a_desc, [first, step * BLOCK_K], bar, a_bufs.index(stage))
        if is_slot:
            _tma_load(slot_w_desc, [weight_row, step * BLOCK_K], bar, w_bufs.index(stage))
        else:
            _tma_load(w_desc, [weight_row, step * BLOCK_K], bar, w_bufs.index(stage))

    @gluon.jit
    def _refill(a_desc, w_desc, slot_w_desc, here, after, has_next, used, step, a_bufs, w_bufs, bars,
                K_STEPS: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
        """Once step ``step - 1``'s MMA is done, its stage takes step ``step + NUM_STAGES - 1``'s tiles:
        this tile's (``here``), or past its last step the program's next tile's first steps
        (``after``, if ``has_next``), so that the pipeline stays full across tiles and their
        epilogues (``used``: the program's steps before this tile)."""
        ahead = step + NUM_STAGES - 1
        stage = (used + ahead) % NUM_STAGES
        if ahead < K_STEPS:
            _load_step(a_desc, w_desc, slot_w_desc, here, ahead, stage, a_bufs, w_bufs, bars, BLOCK_K)
        elif has_next:
            _load_step(a_desc, w_desc, slot_w_desc, after, ahead - K_STEPS, stage, a_bufs, w_bufs, bars, BLOCK_K)

    @gluon.jit
    def _wait_tiles(bars, count, NUM_STAGES: gl.constexpr):
        """Wait for the tiles of the program's step ``count``; returns their stage."""
        stage = count % NUM_STAGES
        mbarrier.wait(bars.index(stage), (count // NUM_STAGES) & 1)
        return stage

    @gluon.jit
    def _issue_half(a_bufs, w_bufs, stage, HALF: gl.constexpr, into):
        """Issue the MMA of ``stage``'s activation tile and half ``HALF`` (0: the first 64 columns, 1:
        the last) of its weight tile asynchronously into ``into``'s registers (values unused: the MMA
        starts from zero)."""
        HALF_N: gl.constexpr = w_bufs.type.shape[1] // 2
        weights = w_bufs.index(stage).slice(HALF * HALF_N, HALF_N, dim=0)
        return warpgroup_mma(a_bufs.index(stage), weights.permute((1, 0)), into, use_acc=False, is_async=True)

    @gluon.jit
    def _chunk(a_desc, w_desc, slot_w_desc, here, after, has_next, used, base, a_bufs, w_bufs, bars, a_scales,
               row_mask, w_scales, low, high, low_product, high_product, STEPS: gl.constexpr, K_STEPS: gl.constexpr,
               NUM_STAGES: gl.constexpr, BLOCK_K: gl.constexpr):
        """Steps ``[base, base + STEPS)`` of a tile, added into its two column halves' fp32 sums
        ``low`` and ``high``; ``low_product`` and ``high_product``: the registers each half's step
        products take. Returns the four, for the next chunk.

        Each step issues the MMA of its first half, waits until only that one is outstanding (the
        previous step is done: its stage takes a later step's tiles, and its second half's product
        is scaled into ``high`` while this MMA runs), then issues its second half and scales its
        first half's product while that one runs. In halves the sums and the two products take 32
        registers a thread each, 128 in all (with whole 64 x 128 products, 64 each and 192 in all,
        the kernel took all 255 registers and ptxas then serialized the MMAs: its C7512 notice).
        The chunk is unrolled and ends with no MMA outstanding: with an MMA in flight across a
        loop's back edge, ptxas (CUDA 12.8, bundled with Triton 3.6) serialized every MMA of the
        kernel (C7514: reads of the other product's registers that it could not place)."""
        next_scale = _step_scales(a_scales, row_mask, w_scales, base)
        previous = next_scale  # the scale of the step before; first read at i = 1
        for i in gl.static_range(STEPS):
            scale = next_scale
            if i + 1 < STEPS:
                next_scale = _step_scales(a_scales, row_mask, w_scales, base + i + 1)
            stage = _wait_tiles(bars, used + base + i, NUM_STAGES)
            low_product = _issue_half(a_bufs, w_bufs, stage, 0, low_product)
            if i > 0:
                high_product = warpgroup_mma_wait(num_outstanding=1, deps=(high_product, ))
            # The stage of step base + i - 1 is free (at i = 0: the previous chunk, or the previous
            # tile, ended with none outstanding; before a program's first tile it is unused).
            _refill(a_desc, w_desc, slot_w_desc, here, after, has_next, used, base + i, a_bufs, w_bufs, bars,
                    K_STEPS, NUM_STAGES, BLOCK_K)
            if i > 0:
                high += high_product * previous[:, None]
            high_product = _issue_half(a_bufs, w_bufs, stage, 1, high_product)
            low_product = warpgroup_mma_wait(num_outstanding=1, deps=(low_product, ))
            low += low_product * scale[:, None]
            previous = scale
        high_product = warpgroup_mma_wait(num_outstanding=0, deps=(high_product, ))
        high += high_product * previous[:, None]
        return low, high, low_product, high_product

    @gluon.jit
    def _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr):
        """``(expert, end_row, first_column, (is_slot, first_row, weight_row))`` of tile ``tile``: ``expert``
        indexes its weight set (home experts, or slots if ``is_slot``); the last three locate its TMA
        copies (``weight_row``: its first column's row in the ``[experts * N, K]`` view of that set)."""
        group, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N,
                                                      GROUP_M)
        is_slot = group >= split
        expert = gl.where(is_slot, group - split, group)
        return expert, last, first_column, (is_slot, first, expert * N + first_column)

    @gluon.jit
    def _step_scales(a_scales, row_mask, w_scales, step):
        """Step ``step``'s row scales times its weight block scale: ``[BLOCK_M]`` fp32."""
        return gl.load(a_scales + step, mask=row_mask, other=1.0) * gl.load(w_scales + step)

    @gluon.jit
    def _fp8_wgmma_kernel(
        a_desc, w_desc, slot_w_desc, out_desc, a_scale_ptr, w_scale_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups,
        split,
        split_start, N, stride_om, stride_as, rows_above, rows_at_most,
        K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        GROUPS: gl.constexpr, NUM_STAGES: gl.constexpr, CHUNK: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Groups ``[0, split)`` read ``w_desc``, groups ``[split, groups)`` read ``slot_w_desc`` from row
        ``split_start``; the descriptors view the weights as ``[experts * N, K]``."""
        K_STEPS: gl.constexpr = K // BLOCK_K
        gl.static_assert(K_STEPS >= NUM_STAGES, "K must hold at least NUM_STAGES steps")
        HALF_N: gl.constexpr = BLOCK_N // 2  # each step's MMA in two column halves (see _chunk)
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, HALF_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        column_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M, HALF_N], out_desc.layout)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(bars.index(i), count=1)
        n_blocks = gl.cdiv(N, BLOCK_K)  # BLOCK_K is the 128-wide scale block

        g = gl.arange(0, GROUPS, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        starts, ends, tiles, passed, total = _group_tiles(offsets_ptr, g, groups, split, split_start, N, rows_above,
                                                         rows_at_most, BLOCK_M, BLOCK_N)
        tile = gl.program_id(0)
        used = 0  # steps this program ran before the current tile: the stages' barrier phases follow it
        if tile < total:  # the first tile's first steps; each later tile's are loaded during the tile before
            _, _, _, source = _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M, BLOCK_N, GROUP_M)
            for ahead in gl.static_range(NUM_STAGES - 1):
                _load_step(a_desc, w_desc, slot_w_desc, source, ahead, ahead, a_bufs, w_bufs, bars, BLOCK_K)
        while tile < total:
            expert, last, first_column, here = _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M,
                                                            BLOCK_N, GROUP_M)
            is_slot, first, _ = here
            next_tile = tile + gl.num_programs(0)
            has_next = next_tile < total
            _, _, _, after = _tile_source(gl.minimum(next_tile, total - 1), g, starts, ends, tiles, passed, N, split,
                                          BLOCK_M, BLOCK_N, GROUP_M)
            w_scale_base = w_scale_ptr
            if is_slot:
                w_scale_base = slot_w_scale_ptr
            w_scales = w_scale_base + (expert.to(gl.int64) * n_blocks + first_column // BLOCK_K) * K_STEPS
            row = first + gl.arange(0, BLOCK_M, layout=row_layout)
            row_mask = row < last
            a_scales = a_scale_ptr + row.to(gl.int64) * stride_as

            low = gl.zeros([BLOCK_M, HALF_N], gl.float32, mma_layout)
            high = gl.zeros([BLOCK_M, HALF_N], gl.float32, mma_layout)
            low_product = gl.zeros([BLOCK_M, HALF_N], gl.float32, mma_layout)
            high_product = gl.zeros([BLOCK_M, HALF_N], gl.float32, mma_layout)
            for chunk in range(0, K_STEPS // CHUNK):
                low, high, low_product, high_product = _chunk(
                    a_desc, w_desc, slot_w_desc, here, after, has_next, used, chunk * CHUNK, a_bufs, w_bufs, bars,
                    a_scales, row_mask, w_scales, low, high, low_product, high_product, CHUNK, K_STEPS, NUM_STAGES,
                    BLOCK_K)
            if K_STEPS % CHUNK:
                low, high, low_product, high_product = _chunk(
                    a_desc, w_desc, slot_w_desc, here, after, has_next, used, K_STEPS - K_STEPS % CHUNK, a_bufs,
                    w_bufs, bars, a_scales, row_mask, w_scales, low, high, low_product, high_product, K_STEPS % CHUNK,
                    K_STEPS, NUM_STAGES, BLOCK_K)
            used += K_STEPS

            if (first + BLOCK_M <= last) & (first_column + BLOCK_N <= N):
                # A whole tile of its group: TMA stores it from shared memory while the next tile
                # runs (once the previous tile's stores have read the buffers).
                tma.store_wait(pendings=0)
                out_bufs.index(0).store(low.to(out_desc.dtype))
                out_bufs.index(1).store(high.to(out_desc.dtype))
                fence_async_shared()
                _tma_store(out_desc, [first, first_column], out_bufs.index(0))
                _tma_store(out_desc, [first, first_column + HALF_N], out_bufs.index(1))
            else:
                column = first_column + gl.arange(0, HALF_N, layout=column_layout)
                out = out_ptr + row.to(gl.int64)[:, None] * stride_om + column[None, :]
                mask = row_mask[:, None] & (column < N)[None, :]
                gl.store(out, low.to(out_ptr.dtype.element_ty), mask=mask)
                mask = row_mask[:, None] & (column + HALF_N < N)[None, :]
                gl.store(out + HALF_N, high.to(out_ptr.dtype.element_ty), mask=mask)
            tile = next_tile
        tma.store_wait(pendings=0)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(bars.index(i))


@functools.cache
def _shared_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, FP8_BLOCK], gl.float8e4nv)


def descriptors_fit(quantized: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether TMA can copy these operands: 16-byte aligned bases and row strides (fp8 rows
    ``[M, K]`` with unit column stride; contiguous ``[G, N, K]`` weights; bf16 ``out [M, N]`` with
    unit column stride), none of them empty."""
    return (quantized.numel() > 0 and values.numel() > 0 and out.numel() > 0
            and quantized.data_ptr() % 16 == 0 and quantized.stride(0) % 16 == 0 and quantized.stride(1) == 1
            and values.data_ptr() % 16 == 0 and values.shape[-1] % 16 == 0
            and out.data_ptr() % 16 == 0 and (out.stride(0) * out.element_size()) % 16 == 0)


def _weight_descriptor(values: torch.Tensor):
    flat = values.view(-1, values.shape[-1])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [BLOCK_N, FP8_BLOCK], _shared_layout())


def _out_descriptor(out: torch.Tensor):
    """TMA stores of a tile's column halves into bf16 ``out [M, N]``."""
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], gl.bfloat16)
    return TensorDescriptor(out, list(out.shape), list(out.stride()), [BLOCK_M, BLOCK_N // 2], layout)


def fp8_wgmma_launch(
    quantized: torch.Tensor, row_scales: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
    slot_values: torch.Tensor, slot_scales: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, split: int,
    slot_base: int, rows_above: int, rows_at_most: int, group_m: int, num_stages: int, programs: int,
) -> None:
    """Launch the kernel on operands :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton` has
    checked (and :func:`descriptors_fit` accepted): ``quantized [M, K]`` fp8 rows, ``row_scales
    [M, K/128]`` fp32, weights ``values [G, N, K]`` fp8 with ``scales [G, N/128, K/128]`` fp32 (and
    the slots' alike), ``out [M, N]`` bf16, ``offsets [groups]`` int32, over ``programs`` programs."""
    rows, inner = quantized.shape
    a_desc = TensorDescriptor(quantized, [rows, inner], list(quantized.stride()), [BLOCK_M, FP8_BLOCK],
                              _shared_layout())
    groups = offsets.shape[0]
    _fp8_wgmma_kernel[(programs, )](
        a_desc, _weight_descriptor(values), _weight_descriptor(slot_values), _out_descriptor(out), row_scales, scales,
        slot_scales,
        out,
        offsets, groups, split, slot_base, values.shape[1], out.stride(0), row_scales.stride(0), rows_above,
        rows_at_most, K=inner, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=FP8_BLOCK, GROUP_M=group_m,
        GROUPS=triton.next_power_of_2(groups), NUM_STAGES=num_stages, CHUNK=CHUNK, num_warps=NUM_WARPS,
    )
