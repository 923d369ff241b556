"""The fp8 block-scaled grouped GEMM at prefill sizes, for Hopper (sm_90), in Gluon.

Same contract and tile numbering as :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton` (it calls
this kernel for :class:`flatep.kernels.packed_tiles.GemmConfig` tiles with ``wgmma=True``), with
each K step's product scaled while the next step's MMA runs, which Triton's own ``tl.dot``
does not do on Hopper (Triton 3.6 waits for a warp-group MMA right after issuing it when its
result feeds anything but the next MMA's accumulator; see :mod:`flatep.kernels.quant_gemm`).

A persistent, warp-specialized kernel (``gl.warp_specialize``): per tile of ``BLOCK_M`` rows and
``BLOCK_N`` columns,

- a producer warp copies each 128-wide K step's activation and weight tiles with TMA into a ring
  of ``NUM_STAGES`` shared-memory stages (32 KiB each). Each stage has a "ready" mbarrier that the
  copy's bytes complete and an "empty" one that both consumers arrive on once their MMAs have
  read it; the producer runs ahead across the program's tiles, so the pipeline never drains
  between tiles;
- two consumer warp groups (the default partition and one worker, 4 warps each) take rows
  ``[0, 64)`` and ``[64, 128)`` of the tile against the same weight tile. Each issues its step's
  64 x 128 warp-group MMA asynchronously into registers of its own (starting from zero:
  ``use_acc=False``), then waits for the previous step's, hands that step's stage back and adds
  its product times the step's row and weight block scales into fp32 sums while this one runs
  (DeepSeek-V3's fine-grained quantization, its promotion to fp32 registers per 128-wide K step;
  the tensor cores' own sums stay within one step, as in FlatEP's Triton tiles: the same relative
  error, 6.9e-4 at Kimi-K2's shapes). The two groups synchronize only through the mbarriers, so
  one's scaling runs beside the other's MMA;
- a whole tile (all its rows in its group, all its columns in N) leaves through asynchronous TMA
  stores of each group's 64 x 128 bf16 half from shared memory, which run on while the next
  tile's MMAs do (the next epilogue waits for them before it reuses that memory); a partial tile
  is stored row-masked to its group (its rows past the group, which TMA also copies in, are other
  groups' or unused rows: a GEMM's output row reads only its own row).

What shaped it (local sm_90 compiles, Triton 3.6 and its ptxas; ``ptxas -v`` prints the notices):

- registers: 12 warps a program (the producer's warp group rounded up) at 168 registers a thread
  (``MAX_REGISTERS``), which ``setmaxnreg`` moves to the consumers: 232 each and 32 for the
  producer (240 and 24 with Triton 3.9's ptxas). A consumer holds its sums and two products, 64
  registers a thread each;
- unrolled chunks of ``CHUNK`` steps that end with no MMA outstanding: with an MMA in flight across
  a loop's back edge ptxas serializes every MMA of the kernel (notice C7514, reads of the other
  product's registers it could not place); 4-step chunks spilled at 232 registers;
- one program per SM (``GemmConfig.programs_per_sm = 1``) with 5 or 6 stages: 192 and 224 KiB of
  shared memory with the 32 KiB output tile, within Hopper's 227 KiB.

Before warp specialization the kernel ran both warp groups in one partition that issued the TMA
copies itself: the compiler's shared-memory hazard analysis put a CTA-wide barrier around each
copy, which held both groups in step, and each step's MMA ran in two 64-column halves to fit its
registers, which read the activation tile twice. On an H100, one rank's 48 Kimi-K2 experts at
1024 rows per expert (a development A/B, bf16 ``torch._grouped_mm`` in the same CUDA-graph run):
gate/up 0.645x bf16's time against 0.734x before, down 0.607x against 0.766x; at 256 rows per
expert 0.570x and 0.563x against 0.694x and 0.630x. A Kimi-K2 rank's whole experts phase at s = 8192
(bench/results/2026-12-06-h100-c, H100): 0.672x bf16's time (0.586x with fp8 dispatch, whose rows
the experts need not quantize), against 0.814x before warp specialization; 0.689x on another H100
with every replay computing on the dispatched rows rather than in place (2026-12-06-h100-g), and
0.642x once the rows' quantization multiplied by a reciprocal (2026-12-06-h100-h).

Gluon (``triton.experimental.gluon``) is Triton's lower-level language with explicit layouts,
shared memory, barriers, asynchronous MMAs and warp specialization; it has no interpreter, so this
kernel runs on Hopper GPUs only (:func:`available`). The CPU tests check the Triton kernel of the
same contract, and compile this one for sm_90 with the installed Triton
(tests/kernels/test_fp8_wgmma.py: its MMAs stay overlapped, no spills, its shared memory fits).
It has run on a GPU with Triton 3.6 (torch 2.11); Triton 3.9 compiles it alike, untested on a GPU.
"""
from __future__ import annotations

import functools

import torch
import triton

from flatep.kernels.backend import tma_fits
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

_TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])
FP8_BLOCK = 128
BLOCK_M = 128
BLOCK_N = 128
NUM_WARPS = 8
CHUNK = 2
MAX_REGISTERS = 168
# ptxas allots registers differently by release (local sm_90 compiles): Triton 3.6's spilled 4 bytes
# in the producer at 24 registers, Triton 3.9's 16 bytes in the consumers at 232.
CONSUMER_REGISTERS, PRODUCER_REGISTERS = (232, 32) if _TRITON_VERSION < (3, 7) else (240, 24)
"""The tile: 128 x 128 outputs on two consumer warp groups (each 64 x 128, the warp-group MMA's 64
rows: ``NUM_WARPS`` counts their warps, the default partition's 4 and a worker's 4), 128-wide K
steps (one scale block); the stages (32 KiB each: activation plus weight tiles) come from
:class:`flatep.kernels.packed_tiles.GemmConfig`'s ``num_stages``. ``CHUNK``: K steps unrolled between
points with no MMA outstanding. ``MAX_REGISTERS``: a thread's registers at launch (12 warps a
program), which ``setmaxnreg`` moves to ``CONSUMER_REGISTERS`` for the worker consumer and
``PRODUCER_REGISTERS`` for the producer warp; the default partition keeps the rest."""


MIN_TRITON = (3, 6)
"""The first Triton release whose Gluon takes ``warp_specialize`` as this kernel calls it (a list of
partitions and their arguments); earlier ones get the Triton tiles."""


def available(device: torch.device) -> bool:
    """Whether this kernel can run on ``device``: a CUDA sm_90 GPU (H100, H200) and a Triton with
    Gluon's Hopper API, from :data:`MIN_TRITON` on."""
    return (gluon is not None and _TRITON_VERSION >= MIN_TRITON and device.type == "cuda"
            and torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0))


if gluon is not None:
    _group_tiles = gluon.jit(group_tiles.fn)
    _find_tile = gluon.jit(find_tile.fn)

    @gluon.jit
    def _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr):
        """``(expert, end_row, first_column, (is_slot, first_row, weight_row))`` of tile ``tile``."""
        group, first, last, first_column = _find_tile(tile, g, starts, ends, tiles, passed, N, BLOCK_M, BLOCK_N,
                                                      GROUP_M)
        is_slot = group >= split
        expert = gl.where(is_slot, group - split, group)
        return expert, last, first_column, (is_slot, first, expert * N + first_column)

    @gluon.jit
    def _produce(operands, scalars, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, GROUPS: gl.constexpr, K_STEPS: gl.constexpr, NUM_STAGES: gl.constexpr,
                 HALF: gl.constexpr, CHUNK: gl.constexpr):
        """The producer warp: every K step of the program's tiles into the ring of stages, each stage
        once both consumers handed it back. (Gluon's worker partitions share one signature:
        ``HALF`` and ``CHUNK`` are the consumers'.)"""
        a_desc, w_desc, slot_w_desc, out_desc, a_bufs, w_bufs, out_bufs, ready, empty = operands
        a_scale_ptr, w_scale_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups, split, split_start, N, stride_om, \
            stride_as, rows_above, rows_at_most = scalars
        g = gl.arange(0, GROUPS, layout=gl.BlockedLayout([1], [32], [1], [0]))
        starts, ends, tiles, passed, total = _group_tiles(offsets_ptr, g, groups, split, split_start, N, rows_above,
                                                         rows_at_most, BLOCK_M, BLOCK_N)
        count = 0
        tile = gl.program_id(0)
        while tile < total:
            _, _, _, source = _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M, BLOCK_N, GROUP_M)
            is_slot, first, weight_row = source
            for step in range(K_STEPS):
                stage = count % NUM_STAGES
                # A fresh barrier counts as having completed the phase before its first: the first
                # pass through the ring does not wait.
                mbarrier.wait(empty.index(stage), ((count // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes)
                _tma_load(a_desc, [first, step * BLOCK_K], bar, a_bufs.index(stage))
                if is_slot:
                    _tma_load(slot_w_desc, [weight_row, step * BLOCK_K], bar, w_bufs.index(stage))
                else:
                    _tma_load(w_desc, [weight_row, step * BLOCK_K], bar, w_bufs.index(stage))
                count += 1
            tile += gl.num_programs(0)

    @gluon.jit
    def _chunk(a_bufs, w_bufs, ready, empty, a_scales, row_mask, w_scales, sums, spare, held, count, base,
               STEPS: gl.constexpr, NUM_STAGES: gl.constexpr, HALF: gl.constexpr, WG_M: gl.constexpr):
        """Steps ``[base, base + STEPS)`` of a tile (the program's steps ``count + base ...``): each step's
        MMA is issued into one of two product registers, then the step before it is waited for, its
        stage handed back, and its product scaled into ``sums`` while this one runs. Unrolled, and
        ending with no MMA in flight (ptxas serializes MMAs whose registers cross a loop's back edge
        in flight)."""
        previous_stage = 0
        previous_scale = gl.load(a_scales + base, mask=row_mask, other=1.0) * gl.load(w_scales + base)
        scale = previous_scale
        for i in gl.static_range(STEPS):
            if i > 0:
                scale = gl.load(a_scales + base + i, mask=row_mask, other=1.0) * gl.load(w_scales + base + i)
            stage = (count + base + i) % NUM_STAGES
            mbarrier.wait(ready.index(stage), ((count + base + i) // NUM_STAGES) & 1)
            rows_tile = a_bufs.index(stage).slice(HALF * WG_M, WG_M, dim=0)
            current = warpgroup_mma(rows_tile, w_bufs.index(stage).permute((1, 0)), spare, use_acc=False,
                                    is_async=True)
            if i > 0:
                held = warpgroup_mma_wait(num_outstanding=1, deps=(held, ))
                mbarrier.arrive(empty.index(previous_stage), count=1)
                sums += held * previous_scale[:, None]
            spare = held
            held = current
            previous_stage = stage
            previous_scale = scale
        held = warpgroup_mma_wait(num_outstanding=0, deps=(held, ))
        mbarrier.arrive(empty.index(previous_stage), count=1)
        sums += held * previous_scale[:, None]
        return sums, spare, held

    @gluon.jit
    def _consume(operands, scalars, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                 GROUP_M: gl.constexpr, GROUPS: gl.constexpr, K_STEPS: gl.constexpr, NUM_STAGES: gl.constexpr,
                 HALF: gl.constexpr, CHUNK: gl.constexpr):
        """One consumer warp group: rows ``[HALF * 64, HALF * 64 + 64)`` of each tile, every K step's
        MMA scaled into fp32 sums, then the epilogue. ``operands``: the descriptors, shared memory
        and barriers; ``scalars``: the kernel's pointers and sizes."""
        a_desc, w_desc, slot_w_desc, out_desc, a_bufs, w_bufs, out_bufs, ready, empty = operands
        a_scale_ptr, w_scale_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups, split, split_start, N, stride_om, \
            stride_as, rows_above, rows_at_most = scalars
        WG_M: gl.constexpr = BLOCK_M // 2
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 32])
        row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        column_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        n_blocks = gl.cdiv(N, BLOCK_K)
        g = gl.arange(0, GROUPS, layout=gl.BlockedLayout([1], [32], [4], [0]))
        starts, ends, tiles, passed, total = _group_tiles(offsets_ptr, g, groups, split, split_start, N, rows_above,
                                                         rows_at_most, BLOCK_M, BLOCK_N)
        tile = gl.program_id(0)
        count = 0  # steps this program ran before the current tile: the stages' barrier phases follow it
        while tile < total:
            expert, last, first_column, here = _tile_source(tile, g, starts, ends, tiles, passed, N, split, BLOCK_M,
                                                            BLOCK_N, GROUP_M)
            is_slot, first, _ = here
            first = first + HALF * WG_M
            w_scale_base = w_scale_ptr
            if is_slot:
                w_scale_base = slot_w_scale_ptr
            w_scales = w_scale_base + (expert.to(gl.int64) * n_blocks + first_column // BLOCK_K) * K_STEPS
            row = first + gl.arange(0, WG_M, layout=row_layout)
            row_mask = row < last
            a_scales = a_scale_ptr + row.to(gl.int64) * stride_as
            sums = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
            spare = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
            held = gl.zeros([WG_M, BLOCK_N], gl.float32, mma_layout)
            for chunk in range(K_STEPS // CHUNK):
                sums, spare, held = _chunk(a_bufs, w_bufs, ready, empty, a_scales, row_mask, w_scales, sums, spare,
                                           held, count, chunk * CHUNK, CHUNK, NUM_STAGES, HALF, WG_M)
            if K_STEPS % CHUNK:
                sums, spare, held = _chunk(a_bufs, w_bufs, ready, empty, a_scales, row_mask, w_scales, sums, spare,
                                           held, count, K_STEPS - K_STEPS % CHUNK, K_STEPS % CHUNK, NUM_STAGES, HALF,
                                           WG_M)
            count += K_STEPS
            if (first + WG_M <= last) & (first_column + BLOCK_N <= N):
                tma.store_wait(pendings=0)
                out_bufs.index(HALF).store(sums.to(out_desc.dtype))
                fence_async_shared()
                _tma_store(out_desc, [first, first_column], out_bufs.index(HALF))
            else:
                column = first_column + gl.arange(0, BLOCK_N, layout=column_layout)
                out = out_ptr + row.to(gl.int64)[:, None] * stride_om + column[None, :]
                mask = row_mask[:, None] & (column < N)[None, :]
                gl.store(out, sums.to(out_ptr.dtype.element_ty), mask=mask)
            tile += gl.num_programs(0)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _fp8_wgmma_kernel(
        a_desc, w_desc, slot_w_desc, out_desc, a_scale_ptr, w_scale_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups,
        split, split_start, N, stride_om, stride_as, rows_above, rows_at_most,
        K: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
        GROUPS: gl.constexpr, NUM_STAGES: gl.constexpr, CHUNK: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr,
        PRODUCER_REGISTERS: gl.constexpr, num_warps: gl.constexpr,
    ):
        """Groups ``[0, split)`` read ``w_desc``, groups ``[split, groups)`` read ``slot_w_desc`` from row
        ``split_start``; the descriptors view the weights as ``[experts * N, K]``. ``num_warps``: the
        default partition's (one consumer warp group)."""
        K_STEPS: gl.constexpr = K // BLOCK_K
        gl.static_assert(K_STEPS >= NUM_STAGES, "K must hold at least NUM_STAGES steps")
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_bufs = gl.allocate_shared_memory(out_desc.dtype, [2, BLOCK_M // 2, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrival from each consumer warp group
        operands = (a_desc, w_desc, slot_w_desc, out_desc, a_bufs, w_bufs, out_bufs, ready, empty)
        scalars = (a_scale_ptr, w_scale_ptr, slot_w_scale_ptr, out_ptr, offsets_ptr, groups, split, split_start, N,
                   stride_om, stride_as, rows_above, rows_at_most)
        gl.warp_specialize([
            (_consume, (operands, scalars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, GROUPS, K_STEPS, NUM_STAGES, 0, CHUNK)),
            (_consume, (operands, scalars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, GROUPS, K_STEPS, NUM_STAGES, 1, CHUNK)),
            (_produce, (operands, scalars, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, GROUPS, K_STEPS, NUM_STAGES, 0, CHUNK)),
        ], [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


@functools.cache
def _shared_layout():
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, FP8_BLOCK], gl.float8e4nv)


def descriptors_fit(quantized: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether TMA can copy these operands: 16-byte aligned bases and row strides (fp8 rows
    ``[M, K]`` with unit column stride; contiguous ``[G, N, K]`` weights; bf16 ``out [M, N]`` with
    unit column stride), none of them empty."""
    return all(tma_fits(operand) for operand in (quantized, values, out))


def _weight_descriptor(values: torch.Tensor):
    flat = values.view(-1, values.shape[-1])
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [BLOCK_N, FP8_BLOCK], _shared_layout())


def _out_descriptor(out: torch.Tensor):
    """TMA stores of a consumer's 64-row half of a tile into bf16 ``out [M, N]``."""
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, BLOCK_N], gl.bfloat16)
    return TensorDescriptor(out, list(out.shape), list(out.stride()), [BLOCK_M // 2, BLOCK_N], layout)


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
        slot_scales, out, offsets, groups, split, slot_base, values.shape[1], out.stride(0), row_scales.stride(0),
        rows_above, rows_at_most, K=inner, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=FP8_BLOCK, GROUP_M=group_m,
        GROUPS=triton.next_power_of_2(groups), NUM_STAGES=num_stages, CHUNK=CHUNK,
        CONSUMER_REGISTERS=CONSUMER_REGISTERS, PRODUCER_REGISTERS=PRODUCER_REGISTERS, num_warps=NUM_WARPS // 2,
        maxnreg=MAX_REGISTERS,
    )
