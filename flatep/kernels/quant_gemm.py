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

Tiles are numbered group by group: all of group 0's (row tile, column block) tiles, then group
1's, and so on, so that the programs running together share one group's activations and weights
in L2 (with the row tiles of every group in the fastest dimension, each column block streamed all
groups' activations from memory again). Within a group, bands of ``group_m`` row tiles take the
column blocks in turn, row tiles fastest: the band's rows stay in L2 across its column blocks and
each weight tile is read by the band's row tiles back to back.

- fp8 (:func:`fp8_grouped_mm_triton`): the rows are first quantized per token per 128 columns
  (``scale = max(amax, 1e-10) / 448``, e4m3 rounded to nearest and saturated), as DeepSeek-V3 runs
  its FP8 experts; the GEMM then multiplies e4m3 tiles (the tensor cores sum within a K step, fp32
  registers across steps: see ``GemmConfig.rescale`` on their precision) and applies the row's
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
  overlap the scaling with the next MMA: :func:`default_config` takes it from
  :data:`WGMMA_ROWS` rows per group.
- mxfp4 (:func:`mxfp4_grouped_mm_triton`): reads the packed values as int32 words (8 columns each,
  in FlatEP's word layout, :data:`flatep.quant.mxfp4.WORD_PAIRS`) and their e8m0 scales, and decodes
  them in registers into bf16, exactly (e2m1 times a power of two), for bf16 tensor-core dots. The
  decode works on whole words, two weights per instruction: pair ``p`` of a word (columns ``p`` and
  ``p + 4``) is the word rotated by a constant and masked (two such terms ORed for the last pair),
  which places both codes bit for bit into the two halves of a bf16 pair (sign to bit 15, exponent
  and mantissa to bits 8-6): ``e2m1 * 2**-126`` for every code (codes 0 and 1 become bf16
  subnormals). The layout is chosen for that: in the checkpoint's nibble order a code's sign and
  magnitude need different shifts, two shifts and two masks per pair (a local sm_90 compile of the
  16-row tile's K step: 243 instructions against 289, and 497 against 592 for the 32-row tile). One
  packed bf16x2 multiply by the block's ``2**(e - 1)`` finishes each pair (PTX inline assembly;
  exact, including the subnormal inputs, which bf16 arithmetic keeps). That factor is a bf16 only up
  to scale byte 128 (weights up to 12, which real checkpoints stay well under); from byte 129 on it
  is capped at +inf, which makes every product of the tile that reads such a block +-inf or NaN. A
  tile that reads a byte past 128 sets a flag (each thread keeps the largest byte it read: one
  integer maximum per scale value), and a second launch, which returns at once while the flag is
  clear, computes the launch's tiles again with two multiplies per pair (by ``2**126``, then by
  ``2**(e - 127)``: exact at every byte), so the result is exact for any scales. The flag follows
  the scale bytes, not the products: the padding rows of a layer's shard are never written
  (:mod:`flatep.kernels.dispatch`) and may hold NaN, which makes their own products non-finite; a
  flag on non-finite products sent such steps through both passes, twice the time (Kimi-K3 experts
  phase on an H200, bench/results/2026-12-05-f). One multiply instead of two takes 392
  instructions per K step of the 16 x 128 x 64 tile on 2 warps against 434 (168 registers a thread
  either way), and 443 against 483 for the 32 x 256 x 64 tile (214 and 216 registers; local sm_90
  compile, Triton 3.6, in the lane word order below). Byte 0
  (``2**-127``) decodes to its values (bf16 subnormals) in the first pass and to 0 in the second
  (they are below ``6 * 2**-127`` anyway). A word yields columns in the order 0 4 1 5 2 6 3 7. Short
  tiles run the dot over K in that order and permute the activations alike as they are loaded (in
  registers). Triton's ``mma.sync`` operand layout gives each lane one word of each 32-column chunk
  of a K step: in column order a lane's two words of a 64-wide step lie in different scale blocks,
  and it loads and converts one scale byte per word. Short tiles may take each step's words in
  another order (``GemmConfig.lane_words``, :func:`_lane_word_order`; the
  activations alike), in which a lane's words are neighbours in one block: 8 scale loads a step
  instead of 16, and 392 instructions per K step instead of 423 for the 16-row tile (168 registers
  instead of 188), 443 instead of 472 for the 32-row one (214 instead of 234; local sm_90 compile,
  Triton 3.6; ``bench/scripts/gemm_kloop_sass.py`` counts a tree's tiles with and without).
  :func:`default_config`'s short tiles take it: with pointer copies neither order was faster for
  the 16-row tile on an H100 and the plain 32-row tile was 1-3% faster, but with TMA copies (below)
  the lane order took 10-12% less time than the plain one for the 32-row tile.
  Tall unswapped tiles (a warp-group MMA, whose weight operand goes through shared memory anyway)
  put the decoded weights back in column order and take the activations as they are (local sm_90
  compile of the 128-row tile's K step: 196 instructions in 153 registers a thread, against 246 in
  211 with permuted activations). The interpreter runs the same bit placement, word order and
  multiplies in fp32, with the same cap and flag. The scales may lie in any strides. Pools hold them
  column-fastest (:func:`flatep.quant.columns_fastest`): a K step's scales of a tile's columns are
  then contiguous bytes, which Triton copies asynchronously in the software pipeline with the words.
  In the checkpoint's order a step takes a few bytes per column, too few for an asynchronous copy (4
  bytes at least), and the decode, which needs them before the step's dot, waits on a synchronous
  global load and a shared-memory exchange each step (local sm_90 compile, Triton 3.6 and 3.9: the
  16- and 32-row tiles of :func:`default_config` then hold no synchronous load in their K loop; the
  64-row tile, with 2 scale bytes a thread, keeps one). On Hopper GPUs unswapped tiles copy the
  rows, the words and column-fastest scales by tensor descriptor (TMA, :func:`_mxfp4_descriptors`):
  one thread issues a step's copies, where the pointer copies (``cp.async``) kept addresses in every
  thread's registers until each copy had read them. In Nsight Compute on an H100 those registers'
  reuse held 13-17% of the short tiles' warp stalls (bench/results/2026-12-06-h100-d); with
  descriptors the 16-row tile takes 142 registers instead of 168 and 26-28% less time, the
  32-row tile in the lane order 198 instead of 214 and 10-11% less (bench/results/2026-12-06-h100-e).
  Other inputs (scales in the checkpoint's order, unaligned rows, older GPUs) keep the pointer
  copies, with the same bits. On Hopper GPUs the groups of more than 32 rows can run a
  warp-specialized Gluon kernel instead (:mod:`flatep.kernels.mxfp4_wgmma`; ``GemmConfig.wgmma``;
  opt-in, as it is slower than the Triton tile: :data:`MXFP4_WGMMA_DEFAULT`): the same decode and
  passes, in warps of their own beside the warp-group MMA that reads their output. ``tl.dot_scaled``
  (bf16 times e2m1) would be the alternative; on Hopper Triton 3.6 upcasts its e2m1 operand itself
  and measured no faster, and its interpreter has no ``dot_scaled``.

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
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flatep.environment import environment_flag
from flatep.kernels.backend import (
    interpreting,
    round_to_bf16,
    round_to_e4m3,
    row_programs,
    row_runs,
    run_block,
    run_block_count,
    skip_arguments,
    tma_fits,
)
from flatep.kernels import fp8_wgmma, mxfp4_fp8mma, mxfp4_swap, mxfp4_wgmma
from flatep.kernels.fp8_split import split_rows_triton
from flatep.kernels.e2m1_ptx import INF_PAIR, ONE_MULTIPLY_BIAS, ONE_MULTIPLY_MAX_BYTE, SCALE_PAIR, scaled_pairs_ptx
from flatep.kernels.grouped_tiles import locate_tile, persistent_grid, tile_table
from flatep.quant.fp8 import E4M3_MAX, E4M3_RECIPROCAL
from flatep.quant.mxfp4 import WORD_PAIRS, _as_int32

_FP8_BLOCK = 128
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_RECIPROCAL = tl.constexpr(E4M3_RECIPROCAL)


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and program order of a grouped GEMM launch (tuning; correctness does not depend on them).

    ``block_m``, ``block_n``: output rows and columns per program (powers of two, at least 16);
    ``block_k``: input columns per step (fp8: 128, one scale block; mxfp4: a power of two, at least 32);
    ``group_m``: row tiles of a group that take the column blocks together (see the module docstring);
    ``swap_ab``: compute the transposed tile, ``W_tile @ A_tile.T``, so that the weight's columns fill
    the MMA's M side (a Hopper warp-group MMA is 64 rows tall, while short row tiles of decode shards
    are 16 or 32 rows); ``num_warps``, ``num_stages``: Triton's launch options; ``programs_per_sm``: the
    persistent grid's programs per SM (more hide more latency, if their registers and shared memory
    fit). fp8 tiles need ``block_n`` to divide 128 (one weight scale block per tile). ``rescale`` (fp8
    only): keep the accumulator in units of the current K step's scales, ``acc = dot(a, w, acc *
    s_previous / s)`` then ``acc * s_last``, rather than adding each step's separate product times its
    scales: one accumulator in registers instead of two (the tensor-core MMA accumulates in place),
    which tall tiles need to fit. It is less precise on Hopper: the sum over all K then stays in the
    warp-group MMA's accumulator, and fp8 MMAs add with fewer bits than fp32 (about 14, DeepSeek-V3
    technical report, arXiv:2412.19437, section 3.3.2), where the plain form adds each 128-wide step's
    product into fp32 registers, as DeepSeek-V3 does. Relative error against the fp32 product of the
    dequantized operands, one Kimi-K2 rank at 1024 rows per expert, H100 and H200 alike: 3.4e-3 rescaled
    against 6.9e-4 plain for gate/up (K = 7168), 2.0e-3 against 6.9e-4 for down (K = 2048), where the
    16- and 32-row tiles on ``mma.sync`` (e4m3 converted to fp16 for it, fp32 sums) give 8e-5: the plain
    warp-group tiles' error is that of the four MMAs within a step (bench/results/2026-12-06-h100,
    ``quant_quick_fp8.json``). It also divides by the weight block scales: a zero one (which neither the
    checkpoints nor :func:`flatep.quant.quantize_fp8_block` hold) makes the tile's rows NaN, where the
    plain form gives its block's weights as 0. A tile-sweep candidate, not a default. ``lane_words``
    (mxfp4 only, tiles whose decoded weights stay in registers as an MMA operand: ``block_m`` below 64,
    or ``swap_ab``; ``block_k`` of 64 or more): take each K step's words in :func:`_lane_word_order`'s
    order, in which the words a lane decodes share their e8m0 scale blocks where Triton's operand layout
    gives a lane one word of each 32-column chunk of the step (in a local sm_90 compile: the 64-wide
    steps of 16- and 32-row tiles on 2 warps of 128 or 256 columns or 4 of 256, the 128-wide steps of
    the 16 x 128 tile on 2 warps and the 32 x 256 tile on 4, and the swapped 16 x 128 x 128 tile);
    elsewhere the reorder can cost register moves instead (``bench/scripts/gemm_kloop_sass.py``
    compares a tile with and without). ``wgmma`` (Hopper GPUs):
    run a warp-specialized Gluon kernel. fp8: :mod:`flatep.kernels.fp8_wgmma`, which scales each K
    step's product while the next step's warp-group MMA runs; its tile is fixed (``block_m`` and
    ``block_n`` 128, ``num_warps`` 8: its two consumer warp groups, beside which a producer warp
    issues the copies; not swapped or rescaled), ``num_stages`` its shared-memory stages (5 or 6).
    Its TMA copies need 16-byte aligned operands: where the fp8 rows' or the output's base address or
    row stride is not (rows of a strided view, say), and where ``K`` holds fewer 128-wide steps than
    its stages, the launch runs the Triton 64 x 128 tile instead. mxfp4:
    :mod:`flatep.kernels.mxfp4_wgmma`, whose decoder warps decode a K step's weights while the
    consumer's MMA runs on the previous step's; its tile is fixed (64 x 256 x 64, ``num_warps`` 4: the
    consumer warp group), ``num_stages`` its copies in flight (3 to 6); inputs its TMA copies cannot
    take (scales in the checkpoint's order, unaligned rows, ``K`` not a multiple of 64) run the
    Triton 64 x 256 x 64 tile instead. The mxfp4 kernel is exact but slower than the Triton tile on
    an H100: opt-in (:data:`MXFP4_WGMMA`, :data:`MXFP4_WGMMA_DEFAULT`). ``max_registers`` (Triton
    tiles; None: ptxas chooses): ptxas's register limit a thread (``maxnreg``), so that
    ``programs_per_sm`` programs fit an SM's 64K registers where the tile would otherwise take more;
    below the tile's need it spills to local memory (``bench/scripts/gemm_kloop_sass.py`` reports
    registers and stack).
    """

    block_m: int
    block_n: int
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    swap_ab: bool = False
    programs_per_sm: int = 2
    rescale: bool = False
    lane_words: bool = False
    wgmma: bool = False
    max_registers: int | None = None

    def __post_init__(self) -> None:
        registers = self.max_registers
        if registers is not None and (isinstance(registers, bool) or not isinstance(registers, int)
                                      or not 16 <= registers <= 255):
            raise ValueError(f"max_registers must be None or an int in [16, 255] (ptxas's register limit a thread), "
                             f"got {registers!r}")
        if registers is not None and self.wgmma:
            raise ValueError(f"max_registers is a Triton tile option: the Gluon kernel (wgmma) sets its own "
                             f"registers, got max_registers={registers} with wgmma")

    @property
    def label(self) -> str:
        """A short name for benchmark arms: ``m16 n128 k128 w4 s3 g8 p2`` and the options set
        (``swap``, ``rescale``, ``lanewords``, ``wgmma``, ``r168`` for a register limit of 168)."""
        options = [name for name, on in (("swap", self.swap_ab), ("rescale", self.rescale),
                                         ("lanewords", self.lane_words), ("wgmma", self.wgmma)) if on]
        if self.max_registers:
            options.append(f"r{self.max_registers}")
        return " ".join([f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.num_warps} s{self.num_stages} "
                         f"g{self.group_m} p{self.programs_per_sm}", *options])


# fp8 Triton tiles past HOT_ROWS rows per group (from 17 rows, the same tile at 3 stages)
_FP8_TALL = GemmConfig(64, 128, 128, num_warps=4, num_stages=4)
# mxfp4 Triton tiles past 32 rows per group (and where the Gluon kernel's copies cannot run)
_MXFP4_TALL = GemmConfig(64, 256, 64, num_warps=4, num_stages=4)
MXFP4_WGMMA = GemmConfig(mxfp4_wgmma.WG_M, mxfp4_wgmma.BLOCK_N, mxfp4_wgmma.BLOCK_K, num_warps=mxfp4_wgmma.NUM_WARPS,
                         num_stages=mxfp4_wgmma.LOAD_STAGES, programs_per_sm=1, wgmma=True)
"""The Gluon mxfp4 kernel's tile (:mod:`flatep.kernels.mxfp4_wgmma`, Hopper GPUs)."""
# mxfp4 Triton tiles of at most 16 and 32 rows per group (and where the swapped Gluon kernel's copies cannot run)
_MXFP4_SHORT = {16: GemmConfig(16, 128, 128, num_warps=2, num_stages=3, programs_per_sm=6, lane_words=True),
                32: GemmConfig(32, 256, 128, num_warps=4, num_stages=3, lane_words=True)}
MXFP4_SWAP = {block_m: GemmConfig(block_m, mxfp4_swap.BLOCK_N, mxfp4_swap.BLOCK_K, num_warps=mxfp4_swap.NUM_WARPS,
                                  num_stages=mxfp4_swap.LOAD_STAGES, programs_per_sm=mxfp4_swap.PROGRAMS_PER_SM,
                                  swap_ab=True, wgmma=True)
              for block_m in mxfp4_swap.BLOCK_M}
"""The swapped Gluon mxfp4 kernel's tiles by row tile (:mod:`flatep.kernels.mxfp4_swap`, Hopper GPUs)."""
FP8MMA = {block_m: GemmConfig(block_m, mxfp4_fp8mma.BLOCK_N, 128, num_warps=mxfp4_fp8mma.NUM_WARPS, num_stages=stages,
                              programs_per_sm=programs, swap_ab=True, wgmma=True)
          for block_m, stages, programs in ((32, 3, 3), (64, 4, 2))}
"""The fp8-activation mxfp4 kernel's tiles by row tile (:mod:`flatep.kernels.mxfp4_fp8mma`, Hopper GPUs,
pools in the ``mma`` layout): 128-wide K steps; 32 rows at 3 stages and 3 programs an SM, 64 rows at 4
stages and 2 programs an SM (each program's registers a thread follow from its programs an SM). The
prototype's fastest on an H100 (bench/results/2026-12-07-h100-j): 508.7 and 259.3 us for a Kimi-K3
rank's gate/up and down GEMMs at 32 rows per expert, 621.6 and 318.2 us at 64; 16-row groups take the
32-row tile."""
MXFP4_SWAP_DEFAULT = environment_flag("FLATEP_MXFP4_SWAP", True)
"""Whether :func:`default_config` (and so a decode step's middle launch, :func:`packed_launches`)
gives groups of 17-32 rows ``MXFP4_SWAP[32]`` on a Hopper GPU: on unless the environment sets
``FLATEP_MXFP4_SWAP=0``. Its GPU tests pass on an H100. There, at 32 rows per expert, a Kimi-K3
rank's GEMMs took 0.87x and 0.85x the Triton 32-row tile's time (gate/up 570 against 659 us, down
284 against 323 us at 3 programs an SM and 4 stages); at 16 rows the swapped 16-row tile took
1.01-1.02x the Triton 16-row tile's, so 16-row groups keep the Triton tile
(bench/results/2026-12-07-h100-c). Issue #15's Kimi-K3 cell with it: see
bench/results/2026-12-07-h100-d."""
MXFP4_WGMMA_DEFAULT = environment_flag("FLATEP_MXFP4_WGMMA", False)
"""Whether :func:`default_config` gives groups of more than 32 rows :data:`MXFP4_WGMMA` on a Hopper
GPU: off unless the environment sets ``FLATEP_MXFP4_WGMMA=1`` (or this is set before a step). It is
exact (its GPU tests pass on an H100) but slower than the Triton 64 x 256 tile: at 64-192 rows per
expert a Kimi-K3 rank's GEMMs took 1.22-1.30x the tile's time at its 4 stages (1.18-1.23x at 6),
and issue #15's Kimi-K3 cell at maxvio 10 0.456x of bf16 against the tile's 0.432x in the same run
(H100, bench/results/2026-12-07-h100)."""

WGMMA_ROWS = 128
"""Rows per group from which :func:`default_config` takes the Gluon fp8 kernel
(:mod:`flatep.kernels.fp8_wgmma`) on a Hopper GPU."""
WGMMA_STAGES = 5
"""Shared-memory stages of that default (32 KiB each)."""


def default_config(
    rows: int, groups: int, format: str, device: torch.device | None = None, layout: str = "words",
) -> GemmConfig:
    """Tiles for ``rows`` shard rows over ``groups`` groups of ``format`` (``fp8`` or ``mxfp4``) weights
    on ``device`` (None: the Triton tiles, which run anywhere).

    mxfp4 in the ``mma`` layout (``layout``; pools with :data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`):
    on a Hopper GPU :data:`FP8MMA`'s 32-row tile for groups of at most 32 rows on average, else its
    64-row tile; elsewhere the Triton tiles below without ``lane_words`` (the exact pass of that
    layout decodes in column order).

    On a Hopper GPU (:func:`flatep.kernels.fp8_wgmma.available`) fp8 takes the Gluon kernel from
    :data:`WGMMA_ROWS` rows per group on (``GemmConfig.wgmma``).

    Row tiles are no taller than a group's average (decode shards hold a few rows per expert), except
    that fp8 takes 64-row tiles from 17 rows per group on. Measured on the H200 (Triton 3.6; one
    rank's experts, gate/up plus down; ``python -m flatep.quant.bench --quick``, every candidate
    of :data:`flatep.quant.bench.CANDIDATES`; bench/results/2026-12-05-h200):

    - fp8: 16-row tiles stream the weights with the product transposed (``swap_ab``: the weight's
      columns on the tensor core's 64-row side). From 17 rows per group on, 64-row tiles on 4 warps
      were fastest or within 3% at every size (32, 128 and 1024 rows per expert; the 8-warp
      128-row tile was 2% slower, the 32-row swapped tile 3% at 32 rows and 1.9x at 1024).
      Against bf16 ``torch._grouped_mm``: 0.39x at 16 rows per expert, 0.38x at 32, 0.66x at
      128, 0.91x at 1024. From :data:`WGMMA_ROWS` rows per group on a Hopper GPU, the Gluon
      kernel (:mod:`flatep.kernels.fp8_wgmma`, warp-specialized): a Kimi-K2 rank's experts at
      s = 8192 (about 1400 rows per expert) took 0.67x bf16's time on an H100 (0.59x with fp8
      dispatch, which leaves the experts no rows to quantize), against 0.992x with the 64 x 128
      tile (bench/results/2026-12-06-h100-c and 2026-12-06-h100); 0.689x in
      bench/results/2026-12-06-h100-g, whose replays compute on the dispatched rows, not in place,
      and 0.642x with the quantization by reciprocal (bench/results/2026-12-06-h100-h).
      Below that, three stages: on an H100 (``bench/scripts/fp8_tile_sweep.py``,
      bench/results/2026-12-06-h100-f; a Kimi-K2 rank) the swapped 16-row tile at 3 stages took
      490 and 258 us (gate/up, down) against 500 and 259 at 5, and the 64-row tile at 3 stages 513
      and 271 us at 32 rows per expert, 545 and 286 at 64, against 525 and 277, 563 and 289 at 4.
      Past :data:`HOT_ROWS` rows per group four stages again (bench/results/2026-12-06-h100-g): 594
      and 321 us at 96 rows against 634 and 347 at 3, and 801 and 461 at 192 against 860 and 484.
    - mxfp4 (timed again since the pools store the scales column-fastest, bench/results/2026-12-05-h200-d):
      short tiles are not swapped. A 16- or 32-row tile then runs on ``mma.sync`` (16 rows
      tall), and Triton decodes the weight words straight into the MMA's operand registers, with
      no round trip through shared memory (the swapped tile took 1.9x longer). At 16 rows two
      warps and six programs per SM were fastest (0.35x bf16); at 32 rows the 32 x 256 tile
      (0.49x). Past 32 rows the 64 x 256 tile on 4 warps, two programs per SM (1.07x bf16 at
      128 rows, 1.70-1.77x at 256, 1.65-1.88x at 1024), against 1.46x, 2.26-2.30x and
      1.91-2.17x for the 64 x 128 tile with three programs per SM that was the default before:
      Hopper has no FP4 MMA, and the decode bounds the tall tiles. From
      :data:`flatep.kernels.mxfp4_dequant.THROUGH_BF16_ROWS` rows per group on, the experts are
      decoded whole into bf16 instead (1.08-1.25x bf16 at 1024 rows).
      Both short tiles take ``lane_words`` (see the module docstring). Since the unswapped tiles
      copy by tensor descriptor (TMA) on Hopper, one Kimi-K3 rank's experts on an H100
      (bench/results/2026-12-06-h100-e) took 512 and 262 us at 16 rows per expert (gate/up, down)
      against 713 and 356 us with pointer copies, and 652 and 327 us at 32 rows in the lane order
      against 736 and 363 us for the pointer copies' plain-order default (758 and 369 us in the
      plain order with TMA); at 128 and 256 rows the 64-row tile took 3-4% less with TMA.
      Then, with TMA copies (``bench/scripts/mxfp4_tile_sweep.py``, bench/results/2026-12-06-h100-f,
      two runs): 128-wide K steps, which take fewer instructions a weight (2.55 against 3.19 at 16
      rows, 3.04 against 3.59 at 32, in a local sm_90 compile), took 3-5% less at 16 rows (16 x 128 x
      128 on 2 warps, 3 stages: 489 and 249 us against 512 and 261) and 7% less at 32 rows (32 x 256
      x 128 on 4 warps, 3 stages: 609 and 311 us against 656 and 335); a fourth stage for the 64-row
      tile took 4-5% less at 128 rows (1500 and 722 us against 1570 and 754). Register limits that
      fit more programs an SM (``max_registers``) gained at most 2-4%, and 7 programs of the 16-row
      tile were 30% slower than 6 or 8.
      With :data:`MXFP4_WGMMA_DEFAULT`, on a Hopper GPU (:func:`flatep.kernels.fp8_wgmma.available`)
      groups of more than 32 rows take the Gluon kernel instead (:mod:`flatep.kernels.mxfp4_wgmma`:
      the decode in warps of its own, beside the warp-group MMA). With :data:`MXFP4_SWAP_DEFAULT`
      (the default) groups of 17-32 rows take the swapped Gluon kernel on a Hopper GPU
      (:mod:`flatep.kernels.mxfp4_swap`: 0.85-0.87x the 32-row tile's time at 32 rows a group).
    """
    if format not in ("fp8", "mxfp4"):
        raise ValueError(f"format must be fp8 or mxfp4, got {format!r}")
    _check_layout(layout, format)
    per_group = max(1, rows // max(groups, 1))
    if layout == "mma":
        if device is not None and fp8_wgmma.available(device):
            return FP8MMA[32 if per_group <= 32 else 64]
        return dataclasses.replace(default_config(rows, groups, format), lane_words=False)
    if format == "fp8":
        if per_group >= WGMMA_ROWS and device is not None and fp8_wgmma.available(device):
            return GemmConfig(fp8_wgmma.BLOCK_M, fp8_wgmma.BLOCK_N, 128, num_warps=fp8_wgmma.NUM_WARPS,
                              num_stages=WGMMA_STAGES, programs_per_sm=1, wgmma=True)
        if per_group <= 16:
            return GemmConfig(16, 128, 128, num_warps=4, num_stages=3, swap_ab=True)
        if per_group <= HOT_ROWS:
            return dataclasses.replace(_FP8_TALL, num_stages=3)
        return _FP8_TALL
    if per_group <= 16:
        return _MXFP4_SHORT[16]
    if per_group <= 32:
        if MXFP4_SWAP_DEFAULT and device is not None and fp8_wgmma.available(device):
            return MXFP4_SWAP[32]
        return _MXFP4_SHORT[32]
    if MXFP4_WGMMA_DEFAULT and device is not None and fp8_wgmma.available(device):
        return MXFP4_WGMMA
    return _MXFP4_TALL


HOT_ROWS = 64
"""Groups holding more rows than this run in a launch of their own with tall tiles
(:func:`packed_launches` for fp8, and :func:`flatep.kernels.decode_gemm.decode_launches` for
bf16; mxfp4 splits at 16 and 32 rows): a hot expert's rows fill tall tiles, and its many short
row tiles would otherwise each stream the same weight tile (and, packed, decode it again)."""

_ALL_ROWS = 2**31 - 1
_SHORT_ROWS = 16  # the shortest row tile


def packed_launches(
    rows: int, groups: int, format: str, device: torch.device | None = None, layout: str = "words",
) -> list[tuple[GemmConfig, tuple[int, int] | None]]:
    """The launches of a packed (``fp8``, ``mxfp4``) grouped GEMM over ``rows`` real rows in
    ``groups`` groups on ``device``: ``(tiles, group_rows)`` each (see :func:`fp8_grouped_mm_triton`),
    over disjoint groups into the same output (:func:`flatep.experts.grouped.quantized_grouped_mm`
    runs them side by side on CUDA streams: :mod:`flatep.kernels.streams`).

    Where a group's average fits short tiles (:func:`default_config`'s, at most 32 rows), the
    groups of more than :data:`HOT_ROWS` rows run in a second launch with the tall tiles
    :func:`default_config` gives 128 rows per group (64 rows each), as the bf16 decode kernels do:
    a skewed step's busiest experts then decode each weight tile once per 64 rows instead of once
    per 16 or 32. mxfp4 splits by the tiles' own heights instead, since each row tile decodes its
    weight tiles again: groups of at most 16 rows in 16-row tiles, of 17-32 rows in 32-row tiles,
    the rest in 64-row tiles. On the H200 (``python -m flatep.quant.bench --quick``,
    bench/results/2026-12-05-h200-d) 32 rows per expert took 0.49x bf16 in 32-row tiles against
    0.65x in 16-row ones, and the 64-row tile came within 5% of the 32-row one there (0.50-0.52x
    against 0.49-0.50x), so a group of 33-64 rows, which takes two 32-row tiles, is better off in
    one 64-row tile (on an H100 at 64 rows per expert: 0.45x against 0.80x for the gate/up GEMM).
    The tall launch takes :func:`default_config`'s tile on ``device`` (the Gluon kernel on a Hopper GPU
    with :data:`MXFP4_WGMMA_DEFAULT`).
    At Kimi-K3, s = 128, a rank's experts hold about 18 rows each, so about a third of them hold 16
    or fewer. Otherwise one launch of every group. mxfp4 in the ``mma`` layout on a Hopper GPU: the
    groups of at most 32 rows in :data:`FP8MMA`'s 32-row tiles, the rest in its 64-row tiles (the
    prototype's split, bench/results/2026-12-07-h100-k).
    """
    _check_layout(layout, format)
    if layout == "mma" and device is not None and fp8_wgmma.available(device):
        return [(FP8MMA[32], (0, 2 * _SHORT_ROWS)), (FP8MMA[64], (2 * _SHORT_ROWS, _ALL_ROWS))]
    tiles = default_config(rows, groups, format, device, layout)
    if tiles.block_m > 32:
        return [(tiles, None)]
    # fp8's hot groups keep the Triton tile (the Gluon fp8 kernel has not been timed on a decode
    # step's hot launch); mxfp4's take the device's (the Gluon kernel with MXFP4_WGMMA_DEFAULT).
    hot = default_config(2 * HOT_ROWS * max(groups, 1), groups, format, device if format == "mxfp4" else None,
                         layout)
    if format == "mxfp4":
        short, middle = (default_config(size * max(groups, 1), groups, format, device, layout)
                         for size in (_SHORT_ROWS, 2 * _SHORT_ROWS))
        return [(short, (0, _SHORT_ROWS)), (middle, (_SHORT_ROWS, 2 * _SHORT_ROWS)),
                (hot, (2 * _SHORT_ROWS, _ALL_ROWS))]
    return [(tiles, (0, HOT_ROWS)), (hot, (HOT_ROWS, _ALL_ROWS))]


def _check_layout(layout: str, format: str, layouts: tuple[str, ...] = ("checkpoint", "words", "mma")) -> None:
    """Raise ``ValueError`` unless ``layout`` is one of ``layouts`` (``mma`` for mxfp4 only)."""
    if layout not in layouts or (layout == "mma" and format != "mxfp4"):
        raise ValueError(f"layout must be one of {layouts} ('mma' for mxfp4 only), got {layout!r} for {format}")


def _check_group_rows(group_rows) -> tuple[int, int]:
    """``(rows_above, rows_at_most)`` of a launch (None: every group), validated."""
    if group_rows is None:
        return 0, _ALL_ROWS
    if (not isinstance(group_rows, tuple) or len(group_rows) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in group_rows)
            or not 0 <= group_rows[0] <= group_rows[1] <= _ALL_ROWS):
        raise ValueError(f"group_rows must be None or (rows_above, rows_at_most) ints with 0 <= rows_above <= "
                         f"rows_at_most <= {_ALL_ROWS}, got {group_rows!r}")
    return group_rows


@triton.jit
def _tile_dot(a, w, SWAP_AB: tl.constexpr, INTERPRET: tl.constexpr, acc=None):
    """One K step of a row tile ``a [BLOCK_M, BLOCK_K]`` and a weight tile ``w [BLOCK_N, BLOCK_K]``:
    ``w @ a.T`` (``[BLOCK_N, BLOCK_M]``) with ``SWAP_AB``, else ``a @ w.T``, in fp32, added to
    ``acc`` if given (by the MMA itself); the operands are upcast to fp32 first under the interpreter."""
    if INTERPRET:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    if SWAP_AB:
        product = tl.dot(w, tl.trans(a), acc)
    else:
        product = tl.dot(a, tl.trans(w), acc)
    return product


@triton.jit
def _store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB: tl.constexpr,
                INTERPRET: tl.constexpr):
    """A tile's fp32 product into ``out`` (``[BLOCK_M, BLOCK_N]``, or its transpose with ``SWAP_AB``)
    at ``row`` and ``column``, masked to both; rounded to bf16's grid first under the interpreter, whose
    cast truncates."""
    if SWAP_AB:
        acc = tl.trans(acc)
    if INTERPRET:
        acc = round_to_bf16(acc)
    out = out_ptr + row.to(tl.int64)[:, None] * stride_om + column[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & column_mask[None, :])


@triton.jit
def _e4m3_rows(x, FROM_BF16: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """DeepSeek-V3's activation quantization of fp32 ``x [N, GROUP]`` (one column group per row):
    ``(values [N, GROUP] fp32 on the e4m3 grid, scales [N] fp32)``, ``scale = max(amax, 1e-10) / 448``
    (a product with the fp32 reciprocal, as :func:`flatep.quant.quantize_fp8_activations` defines it),
    values ``x / scale`` correctly rounded to fp32, then to e4m3. ``FROM_BF16``: ``x`` holds bf16
    values (upcast). ``ROUND_FIRST`` rounds the values to the grid here (the interpreter's fp32 ->
    e4m3 cast drops carries: 127.2 -> 64); the hardware's cast rounds them itself."""
    scale = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10) * _E4M3_RECIPROCAL
    if FROM_BF16 and not ROUND_FIRST:
        # A correctly rounded division (div_rn) a value takes a slow path for zero dividends: all-zero
        # rows took 977 us against 589 for random ones on an H100 (bench/scripts/act_quant_data.py,
        # bench/results/2026-12-06-h100-h). For bf16 values one product with the row's reciprocal and
        # one Newton step with an exact remainder (two fmas) give the same e4m3 value as x / scale
        # for every bf16 x and amax: checked exhaustively (tests/quant/test_grouped.py). The fp32
        # quotient itself is the correctly rounded one down to |x| ~ 1e-37, where the remainder
        # underflows, far below e4m3's smallest step. It runs at div_rn's fast-path speed on any rows.
        reciprocal = tl.math.div_rn(1.0, scale)
        # A row holding inf has scale inf and reciprocal 0: leave its finite values' zeros (x / inf)
        # uncorrected, as inf * 0 would make them NaN.
        divisor = tl.where(reciprocal == 0.0, 0.0, -scale)
        estimate = x * reciprocal[:, None]
        remainder = tl.fma(divisor[:, None], estimate, x)  # x - scale * estimate, exact
        quotient = tl.fma(remainder, reciprocal[:, None], estimate)
        # The sum of zeros of both signs is +0: a negative x whose quotient is zero (x = -0) gets
        # its sign back, as x / scale keeps it. Other quotients already have x's sign.
        sign = x.to(tl.int32, bitcast=True) & -2147483648
        quotient = (quotient.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        # div_rn, not ``/``: Triton's fp32 ``/`` is the GPU's approximate division (up to 2 ulp
        # off), which put a few values in a million on the next e4m3 code.
        quotient = tl.math.div_rn(x, scale[:, None])
    # NaN stays NaN, as torch's clamp keeps it (min and max alone would make it -448 or 448).
    q = tl.clamp(quotient, -_E4M3_MAX, _E4M3_MAX, propagate_nan=tl.PropagateNan.ALL)
    if ROUND_FIRST:
        q = round_to_e4m3(q)
    return q, scale


@triton.jit
def _act_quant_kernel(
    x_ptr, q_ptr, s_ptr, end_ptr, skip_ptr, rows, skip_stop, stride_x, stride_q, stride_s, K,
    BLOCK_M: tl.constexpr, GROUP: tl.constexpr, ROUND_FIRST: tl.constexpr,
):
    # Program (row blocks program_id(0), program_id(0) + P, ... of the rows row_runs gives;
    # column group program_id(1)): each group's e4m3 values and its one fp32 scale per row. The
    # last group of a K that is not a multiple of GROUP is partial (its absent columns count as 0).
    first_end, second_start, end = row_runs(end_ptr, rows, skip_ptr, skip_stop)
    blocks = run_block_count(first_end, second_start, end, BLOCK_M)
    column = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    FROM_BF16: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    block = tl.program_id(0)
    while block < blocks:  # a while loop: Triton 3.6's interpreter takes no loaded value as a range bound
        first, stop = run_block(block, first_end, second_start, end, BLOCK_M)
        row = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = row < stop
        mask = row_mask[:, None] & (column < K)[None, :]
        x = tl.load(x_ptr + row[:, None] * stride_x + column[None, :], mask=mask, other=0.0).to(tl.float32)
        q, scale = _e4m3_rows(x, FROM_BF16, ROUND_FIRST)
        tl.store(q_ptr + row[:, None] * stride_q + column[None, :], q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_s + tl.program_id(1), scale, mask=row_mask)
        block += tl.num_programs(0)


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
                acc = _tile_dot(a, w, SWAP_AB, INTERPRET, acc * ratio[None, :])
            else:
                acc = _tile_dot(a, w, SWAP_AB, INTERPRET, acc * ratio[:, None])
        else:
            product = _tile_dot(a, w, SWAP_AB, INTERPRET)
            if SWAP_AB:
                acc += product * scale[None, :]
            else:
                acc += product * scale[:, None]
    if RESCALE:
        if SWAP_AB:
            acc = acc * previous[None, :]
        else:
            acc = acc * previous[:, None]
    _store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB, INTERPRET)


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
_PAIR0_ROTATION, _PAIR0_MASK = tl.constexpr(WORD_PAIRS[0][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[0][0][1]))
_PAIR1_ROTATION, _PAIR1_MASK = tl.constexpr(WORD_PAIRS[1][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[1][0][1]))
_PAIR2_ROTATION, _PAIR2_MASK = tl.constexpr(WORD_PAIRS[2][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[2][0][1]))
_PAIR3_ROTATION, _PAIR3_MASK = tl.constexpr(WORD_PAIRS[3][0][0]), tl.constexpr(_as_int32(WORD_PAIRS[3][0][1]))
_PAIR3B_ROTATION, _PAIR3B_MASK = tl.constexpr(WORD_PAIRS[3][1][0]), tl.constexpr(_as_int32(WORD_PAIRS[3][1][1]))


@triton.jit
def _rotate_left(words, rotation: tl.constexpr):
    """``words`` (int32) rotated left by ``rotation`` bits (0..31)."""
    if rotation == 0:
        return words
    bits = words.to(tl.uint32, bitcast=True)
    return ((bits << rotation) | (bits >> (32 - rotation))).to(tl.int32, bitcast=True)


@triton.jit
def _e2m1_bf16_pairs(words):
    """The four bf16 pairs of int32 ``words`` in FlatEP's word layout (:data:`flatep.quant.mxfp4.WORD_PAIRS`):
    pair ``p`` holds column ``8j + p`` of word ``j`` in its low half and ``8j + p + 4`` in its high
    half, each e2m1 code's bits placed into a bf16 (sign to bit 15, exponent and mantissa to bits
    8-6), which makes it ``e2m1 * 2**-126`` exactly (codes 0 and 1 become bf16 subnormals): one
    shift and one mask per pair (two of each for the last)."""
    p0 = _rotate_left(words, _PAIR0_ROTATION) & _PAIR0_MASK
    p1 = _rotate_left(words, _PAIR1_ROTATION) & _PAIR1_MASK
    p2 = _rotate_left(words, _PAIR2_ROTATION) & _PAIR2_MASK
    p3 = (_rotate_left(words, _PAIR3_ROTATION) & _PAIR3_MASK) | (_rotate_left(words, _PAIR3B_ROTATION) & _PAIR3B_MASK)
    return p0, p1, p2, p3


_SCALED_PAIRS_PTX = tl.constexpr(scaled_pairs_ptx(False))
_ONE_MULTIPLY_PTX = tl.constexpr(scaled_pairs_ptx(True))
_SCALE_PAIR = tl.constexpr(SCALE_PAIR)
_ONE_MULTIPLY_BIAS = tl.constexpr(ONE_MULTIPLY_BIAS)
_ONE_MULTIPLY_MAX_BYTE = tl.constexpr(ONE_MULTIPLY_MAX_BYTE)
_INF_PAIR = tl.constexpr(INF_PAIR)


@triton.jit
def _scaled_pairs_asm(words, scale_pairs, ONE_MULTIPLY: tl.constexpr):
    """:func:`_e2m1_bf16_pairs` times ``2**126`` (0x7E80 in bf16) times ``scale_pairs`` (bf16x2), or
    with ``ONE_MULTIPLY`` times ``scale_pairs`` alone, in PTX: the multiplies are packed bf16x2
    FMAs, one instruction per two weights, exact (powers of two)."""
    ptx: tl.constexpr = _ONE_MULTIPLY_PTX if ONE_MULTIPLY else _SCALED_PAIRS_PTX
    return tl.inline_asm_elementwise(ptx, "=r,=r,=r,=r,r,r", [words, scale_pairs],
                                     dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)


@triton.jit
def _pairs_to_values(p0, p1, p2, p3, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """int32 pairs ``[BLOCK_N, BLOCK_K/8]`` each -> ``[BLOCK_N, BLOCK_K/2]`` int32 in logical order
    (pair ``p`` of word ``j`` at ``4j + p``)."""
    return tl.reshape(tl.join(tl.join(p0, p2), tl.join(p1, p3)), [BLOCK_N, BLOCK_K // 2])


@triton.jit
def _lane_word_order(x, ROWS: tl.constexpr, WORDS: tl.constexpr, INNER: tl.constexpr):
    """``x [ROWS, WORDS * INNER]`` (``INNER`` values per word of a K step) with the step's words
    reordered: position ``4c + t`` takes word ``t * C + c`` (``C = WORDS / 4``, one word per
    32-column chunk). The short tiles' MMA operand gives lane ``t`` (of each four) position ``t``
    of every chunk, so the words a lane decodes are neighbours in memory and share e8m0 scale
    blocks: one scale a column per 32-column block it spans instead of one per word (see
    :func:`_word_scales`)."""
    CHUNKS: tl.constexpr = WORDS // 4
    return tl.reshape(tl.permute(tl.reshape(x, [ROWS, 4, CHUNKS, INNER]), (0, 2, 1, 3)), [ROWS, WORDS * INNER])


@triton.jit
def _word_scales(x, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LANE_ORDER: tl.constexpr):
    """``x [BLOCK_N, BLOCK_K/32]`` (one value per e8m0 scale block of a K step) repeated for each
    word of its block: ``[BLOCK_N, BLOCK_K/8]``, the words in column order, or with ``LANE_ORDER``
    in :func:`_lane_word_order`'s order (the block of position ``4c + t`` is ``(t * C + c) // 4``).
    Broadcasts, so that what is computed per block (the scale pairs) is computed once per block."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    if not LANE_ORDER or BLOCKS == 1:
        words = tl.reshape(tl.broadcast_to(x[:, :, None], [BLOCK_N, BLOCKS, 4]), [BLOCK_N, WORDS])
    elif BLOCKS == 2:  # position 4c + t is in block t // 2
        words = tl.reshape(tl.broadcast_to(tl.reshape(x, [BLOCK_N, 1, 2, 1]), [BLOCK_N, 2, 2, 2]), [BLOCK_N, WORDS])
    else:  # BLOCKS a multiple of 4: position 4c + t is in block t * BLOCKS / 4 + c // 4
        by_lane = tl.permute(tl.reshape(x, [BLOCK_N, 4, BLOCKS // 4]), (0, 2, 1))
        words = tl.reshape(tl.broadcast_to(tl.reshape(by_lane, [BLOCK_N, BLOCKS // 4, 1, 4]),
                                           [BLOCK_N, BLOCKS // 4, 4, 4]), [BLOCK_N, WORDS])
    return words


@triton.jit
def _mma_code_values(words, MAGNITUDE: tl.constexpr, SIGN: tl.constexpr):
    """The e2m1 values (fp32) of the codes of int32 ``words`` whose magnitude bits start at bit
    ``MAGNITUDE`` and whose sign is bit ``SIGN`` (the ``mma`` layout, :func:`flatep.quant.mxfp4.mma_bit`),
    built as normal floats (``(1 + m / 2) * 2**(e - 1)``; ``0.5 * m`` for exponent 0)."""
    magnitude = (words >> MAGNITUDE) & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    bits = tl.where(exponent == 0, mantissa * 0x3F000000, ((exponent + 126) << 23) | (mantissa << 22))
    value = bits.to(tl.float32, bitcast=True)
    return tl.where(((words >> SIGN) & 1) != 0, -value, value)


@triton.jit
def _mma_decoded_tile(words, exponent, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr):
    """The weights of int32 ``words [BLOCK_N, BLOCK_K/8]`` in the ``mma`` layout (column order) with int32
    e8m0 ``exponent [BLOCK_N, BLOCK_K/32]``: ``[BLOCK_N, BLOCK_K]`` bf16 (fp32 under the interpreter) in
    column order, each weight ``e2m1 * 2**(e - 127)`` as one fp32 product, exact for every byte from 1
    to 254 (byte 0 gives 0, as the bf16 tiles' second pass; 255 inf or NaN). Word ``4 * block + q``
    holds columns ``32 * block + 4q + j`` and ``32 * block + 16 + 4q + j``."""
    WORDS: tl.constexpr = BLOCK_K // 8
    BLOCKS: tl.constexpr = BLOCK_K // 32
    low = tl.reshape(tl.join(tl.join(_mma_code_values(words, 0, 7), _mma_code_values(words, 8, 23)),
                             tl.join(_mma_code_values(words, 4, 15), _mma_code_values(words, 12, 31))),
                     [BLOCK_N, WORDS, 4])  # columns 4q + j
    high = tl.reshape(tl.join(tl.join(_mma_code_values(words, 16, 3), _mma_code_values(words, 24, 19)),
                              tl.join(_mma_code_values(words, 20, 11), _mma_code_values(words, 28, 27))),
                      [BLOCK_N, WORDS, 4])  # columns 16 + 4q + j
    values = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCKS, 4, 4, 2])  # [.., block, q, j, half]
    values = tl.reshape(tl.permute(values, (0, 1, 4, 2, 3)), [BLOCK_N, BLOCKS, 32])
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    w = tl.reshape(values * scale[:, :, None], [BLOCK_N, BLOCK_K])
    if not INTERPRET:
        w = w.to(tl.bfloat16)  # exact: e2m1 times a power of two
    return w


@triton.jit
def _decoded_tile(words, exponent, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NATURAL_K: tl.constexpr,
                  INTERPRET: tl.constexpr, ONE_MULTIPLY: tl.constexpr = False, LANE_WORDS: tl.constexpr = False):
    """The weights of int32 ``words [BLOCK_N, BLOCK_K/8]`` (word layout; with ``LANE_WORDS`` in
    :func:`_lane_word_order`'s order, else in column order) with int32 e8m0 ``exponent [BLOCK_N,
    BLOCK_K/32]``: ``[BLOCK_N, BLOCK_K]`` bf16 (fp32 under the interpreter), the words in their
    order and each word's columns in the order 0 4 1 5 2 6 3 7, or in column order with ``NATURAL_K``.

    ``ONE_MULTIPLY``: one bf16x2 multiply per pair instead of two (by ``2**(e - 1)``, exact for
    scale bytes up to 128, byte 0 included: its values come out as they are, bf16 subnormals);
    every weight of a block with a byte from 129 on is then +-inf or NaN instead."""
    WORDS: tl.constexpr = BLOCK_K // 8
    if INTERPRET:
        p0, p1, p2, p3 = _e2m1_bf16_pairs(words)
        pairs = _pairs_to_values(p0, p1, p2, p3, BLOCK_N, BLOCK_K)
        low = (pairs << 16).to(tl.float32, bitcast=True)
        high = (pairs & -0x10000).to(tl.float32, bitcast=True)
        raw = tl.reshape(tl.join(low, high), [BLOCK_N, WORDS, 8])  # e2m1 * 2**-126
        if ONE_MULTIPLY:  # as the GPU's: 2**(e - 1) in fp32, +inf from byte 129 on
            capped = tl.minimum(exponent, _ONE_MULTIPLY_MAX_BYTE + 1) + _ONE_MULTIPLY_BIAS
            scale = (capped << 23).to(tl.float32, bitcast=True)
        else:
            raw = raw * 8.507059173023462e37  # 2**126
            scale = (exponent << 23).to(tl.float32, bitcast=True)
        scale = _word_scales(scale, BLOCK_N, BLOCK_K, LANE_WORDS)
        w = tl.reshape(raw * scale[:, :, None], [BLOCK_N, BLOCK_K])
    else:
        if ONE_MULTIPLY:
            scale_pairs = (exponent * _SCALE_PAIR + _ONE_MULTIPLY_BIAS * _SCALE_PAIR).to(tl.uint32, bitcast=True)
            scale_pairs = tl.minimum(scale_pairs, _INF_PAIR).to(tl.int32, bitcast=True)
        else:
            scale_pairs = exponent * _SCALE_PAIR
        scale_pairs = _word_scales(scale_pairs, BLOCK_N, BLOCK_K, LANE_WORDS)
        p0, p1, p2, p3 = _scaled_pairs_asm(words, scale_pairs, ONE_MULTIPLY)
        pairs = _pairs_to_values(p0, p1, p2, p3, BLOCK_N, BLOCK_K)
        low = pairs.to(tl.int16).to(tl.bfloat16, bitcast=True)
        high = (pairs >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
        w = tl.reshape(tl.join(low, high), [BLOCK_N, BLOCK_K])
    if NATURAL_K:
        w = tl.reshape(tl.permute(tl.reshape(w, [BLOCK_N, WORDS, 4, 2]), (0, 1, 3, 2)), [BLOCK_N, BLOCK_K])
    return w


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
    byte past 128) or two (see :func:`_decoded_tile`); with ``MMA`` the words are in the ``mma`` layout,
    decoded exactly in column order (:func:`_mma_decoded_tile`; ``NATURAL_K`` set, ``ONE_MULTIPLY`` and
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
        # order (LANE_WORDS: with the step's words in _lane_word_order's order, in which a lane's words
        # share scale blocks) and permute the activations alike (in registers, as they are loaded: the
        # permutation builds the MMA's operand registers, which an unpermuted load would copy into place
        # instead). Tall unswapped tiles (NATURAL_K: a warp-group MMA, whose weight operand goes through
        # shared memory anyway) put the decoded weights back in column order instead, and the
        # activations go to the MMA from shared memory as they are.
        if LANE_WORDS:
            a = _lane_word_order(a, BLOCK_M, WORDS, 8)
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
            words = _lane_word_order(words, BLOCK_N, WORDS, 1)
        exponent = exponent.to(tl.int32)
        if ONE_MULTIPLY:
            largest = tl.maximum(largest, exponent)
        if MMA:
            w = _mma_decoded_tile(words, exponent, BLOCK_N, BLOCK_K, INTERPRET)
        else:
            w = _decoded_tile(words, exponent, BLOCK_N, BLOCK_K, NATURAL_K, INTERPRET, ONE_MULTIPLY, LANE_WORDS)
        acc += _tile_dot(a, w, SWAP_AB, INTERPRET)
    # A block with a scale byte past 128 decodes to +-inf or NaN in the one-multiply pass: the flag
    # has the second pass compute the tile again. The flag follows the scale bytes, not the
    # products: padding rows, which dispatch leaves unwritten (NaN included), make their own
    # products non-finite, and would otherwise send every step through both passes.
    if ONE_MULTIPLY:
        if tl.max(largest) > _ONE_MULTIPLY_MAX_BYTE:
            tl.store(redo_ptr, 1)
    _store_tile(acc, out_ptr, row, column, row_mask, column_mask, stride_om, SWAP_AB, INTERPRET)


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
    """A Gluon mxfp4 config: the swapped kernel's (:data:`MXFP4_SWAP`) or the 64-row one's
    (:data:`MXFP4_WGMMA`), on a Hopper GPU."""
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


def _check_rows(rows: torch.Tensor) -> None:
    if rows.dim() != 2 or rows.dtype != torch.bfloat16 or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] bfloat16 with unit column stride, got {rows.dtype} {list(rows.shape)}")


def _check_common(rows: torch.Tensor, values: torch.Tensor) -> None:
    _check_rows(rows)
    if values.dim() != 3 or not values.is_contiguous():
        raise ValueError(f"weight values must be a contiguous [G, N, ...] tensor, got {list(values.shape)}")


def _check_groups(
    rows: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor] | None, slot_base: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks of the offsets and of the slots against the (checked) weights of a packed GEMM; the
    slots' ``(values, scales)``, or the weights' own without slots (the kernels then never reach them)."""
    groups = values.shape[0]
    if slots is not None:
        slot_values, slot_scales = slots
        if (slot_values.dtype != values.dtype or slot_values.dim() != 3 or slot_values.shape[1:] != values.shape[1:]
                or not slot_values.is_contiguous() or slot_values.device != values.device):
            raise ValueError(f"slot values must be a contiguous [G2, {', '.join(map(str, values.shape[1:]))}] {values.dtype} "
                             f"tensor on {values.device}, got {slot_values.dtype} {list(slot_values.shape)}")
        if (slot_scales.dtype != scales.dtype or slot_scales.shape != (slot_values.shape[0], *scales.shape[1:])
                or slot_scales.stride() != scales.stride() or slot_scales.device != scales.device):
            raise ValueError(f"slot scales must be a [{slot_values.shape[0]}, {', '.join(map(str, scales.shape[1:]))}] "
                             f"{scales.dtype} tensor on {scales.device} in the weights' scales' strides {scales.stride()}, "
                             f"got {slot_scales.dtype} {list(slot_scales.shape)} with strides {slot_scales.stride()}")
        groups += slot_values.shape[0]
    _check_split(rows, offsets, groups, slot_base if slots is not None else None)
    return (values, scales) if slots is None else slots


def _check_split(rows: torch.Tensor, offsets: torch.Tensor, groups: int, slot_base: int | None) -> None:
    """Checks of a grouped launch's ``offsets`` (``[groups]`` int32) and, with a second weight set,
    of its first row ``slot_base``; shared with :mod:`flatep.kernels.decode_gemm`."""
    if slot_base is not None and (isinstance(slot_base, bool) or not isinstance(slot_base, int)
                                  or not 0 <= slot_base <= rows.shape[0]):
        raise ValueError(f"slot_base must be an int row in [0, {rows.shape[0]}], got {slot_base!r}")
    if offsets.dtype != torch.int32 or offsets.shape != (groups,) or not offsets.is_contiguous():
        raise ValueError(f"offsets must be a contiguous [{groups}] int32 tensor, got {offsets.dtype} "
                         f"{list(offsets.shape)}")


def _output(rows: torch.Tensor, columns: int, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(rows.shape[0], columns, dtype=rows.dtype, device=rows.device)
    if out.shape != (rows.shape[0], columns) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows.shape[0]}, {columns}] bfloat16 with unit column stride, got {out.dtype} "
                         f"{list(out.shape)}")
    return out


ACT_QUANT_ROWS = 16
ACT_QUANT_PROGRAMS_PER_SM = 64
ACT_QUANT_WARPS = 2
"""Launch of the fp8 activation quantization: 16-row blocks of one 128-column group per program
step, 2 warps, 64 programs per SM over all groups. On the H200 (K = 7168, CUDA-graph replays) it
took 8.3, 55.0 and 445 us for 1024, 8192 and 65536 rows, against 9.5, 63.1 and 475 us for the
previous 4 warps and 8 programs per SM; 32- and 64-row blocks were no faster (55.5-75.4 us at
8192 rows)."""


def quantize_fp8_activations_triton(
    rows: torch.Tensor, end: torch.Tensor, skip: tuple[torch.Tensor, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token, per-128-column fp8 quantization of ``rows [M, K]`` (bf16, ``K`` a multiple of 128)
    over rows before ``end[0]`` (``[1]`` int32 on the device); later rows of the results undefined.
    ``skip=(start, stop)``: rows ``[start[0], stop)`` are skipped too (``start`` a ``[1]`` int32
    tensor on the device, ``stop`` an int), e.g. the unused rows between a shard's home rows and
    its slot rows.

    Returns:
        ``(values [M, K] float8_e4m3fn, scales [M, K/128] float32)``, as
        :func:`flatep.quant.quantize_fp8_activations` computes them.
    """
    count, columns = rows.shape
    if columns % _FP8_BLOCK or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] with unit column stride and K a multiple of 128, got {list(rows.shape)}")
    skip_start, skip_stop = skip_arguments(skip, count)
    values = torch.empty(count, columns, dtype=torch.float8_e4m3fn, device=rows.device)
    scales = torch.empty(count, columns // _FP8_BLOCK, dtype=torch.float32, device=rows.device)
    block_m, groups = ACT_QUANT_ROWS, columns // _FP8_BLOCK
    # Grid-strided over the rows before end[0]: a shard sized for the step's worst case (tens of
    # thousands of row blocks at decode) launches no program per unused block.
    _act_quant_kernel[(row_programs(count, block_m, groups, rows.device, per_sm=ACT_QUANT_PROGRAMS_PER_SM), groups)](
        rows, values, scales, end, skip_start, count, skip_stop, rows.stride(0), columns, groups, columns,
        BLOCK_M=block_m, GROUP=_FP8_BLOCK, ROUND_FIRST=interpreting(), num_warps=ACT_QUANT_WARPS,
    )
    return values, scales


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
        config: tiles (default :func:`default_config`); ``block_k`` must be 128.
        out: optional ``[M, N]`` bf16 (unit column stride) to write into; default a new tensor.
        activations: optional ``q(rows)`` already made: ``(values [M, K] float8_e4m3fn, scales
            [M, K/128] float32)``, each with unit column stride (any row stride: e.g. the views of
            packed fp8 dispatch rows, :mod:`flatep.kernels.fp8_rows`); ``rows`` is then not read.
        group_rows: ``(rows_above, rows_at_most)``: compute only the groups holding more than
            ``rows_above`` and at most ``rows_at_most`` rows (None: every group; see
            :func:`packed_launches`).
        slots: optional ``(values [G2, N, K], scales [G2, ceil(N/128), K/128])``, a second set of
            experts (a layer's borrow slots) for groups ``G .. G+G2-1`` (``offsets`` then holds
            ``G+G2`` ends), whose rows start at row ``slot_base``: both sets in one launch.
        slot_base: first row of group ``G`` (with ``slots``).

    Returns:
        ``out`` or a new ``[M, N]`` bf16 tensor; rows at and past ``offsets[-1]``, and the rows of
        groups outside ``group_rows``, are not written.
    """
    _check_common(rows, values)
    groups, columns, inner = values.shape
    if values.dtype != torch.float8_e4m3fn or inner != rows.shape[1] or inner % _FP8_BLOCK:
        raise ValueError(f"values must be [G, N, K={rows.shape[1]}] float8_e4m3fn with K a multiple of 128, got "
                         f"{values.dtype} {list(values.shape)}")
    expected = (groups, triton.cdiv(columns, _FP8_BLOCK), inner // _FP8_BLOCK)
    if scales.dtype != torch.float32 or tuple(scales.shape) != expected or not scales.is_contiguous():
        raise ValueError(f"scales must be a contiguous {list(expected)} float32 tensor, got {scales.dtype} {list(scales.shape)}")
    slot_values, slot_scales = _check_groups(rows, values, scales, offsets, slots, slot_base)
    groups = offsets.shape[0]
    config = config or default_config(rows.shape[0], groups, "fp8", rows.device)
    if config.block_k != _FP8_BLOCK:
        raise ValueError(f"fp8 block_k must be {_FP8_BLOCK} (one scale block), got {config.block_k}")
    if config.block_n > _FP8_BLOCK or _FP8_BLOCK % config.block_n:
        raise ValueError(f"fp8 block_n must divide {_FP8_BLOCK} (one weight scale block per tile), got {config.block_n}")
    if config.lane_words:
        raise ValueError(f"lane_words is an mxfp4 tile option (fp8 has no words to reorder), got {config}")
    if config.wgmma:
        _check_wgmma(config, rows.device)
    rows_above, rows_at_most = _check_group_rows(group_rows)
    out = _output(rows, columns, out)
    if activations is None:
        quantized, row_scales = quantize_fp8_activations_triton(rows, offsets[-1:])
    else:
        quantized, row_scales = activations
        if (quantized.dtype != torch.float8_e4m3fn or tuple(quantized.shape) != tuple(rows.shape)
                or row_scales.dtype != torch.float32 or tuple(row_scales.shape) != (rows.shape[0], inner // _FP8_BLOCK)
                or quantized.stride(1) != 1 or row_scales.stride(1) != 1):
            raise ValueError(f"activations must be [M, K] float8_e4m3fn and [M, K/128] float32 with unit column "
                             f"strides for rows {list(rows.shape)}, got {quantized.dtype} {list(quantized.shape)} and "
                             f"{row_scales.dtype} {list(row_scales.shape)}")
    if config.wgmma and slot_values.numel() == 0:  # no slot groups: the kernel never reads the slot set
        slot_values, slot_scales = values, scales
    if config.wgmma and not (fp8_wgmma.descriptors_fit(quantized, values, out)
                             and fp8_wgmma.descriptors_fit(quantized, slot_values, out)
                             and inner // _FP8_BLOCK >= config.num_stages):
        config = dataclasses.replace(_FP8_TALL, group_m=config.group_m)
    programs = persistent_grid(rows.shape[0], groups, columns, config, rows.device)
    if config.wgmma:
        fp8_wgmma.fp8_wgmma_launch(quantized, row_scales, values, scales, slot_values, slot_scales, out, offsets,
                                   values.shape[0], slot_base, rows_above, rows_at_most, config.group_m,
                                   config.num_stages, programs[0])
        return out
    _fp8_grouped_kernel[programs](
        quantized, row_scales, values, scales, slot_values, slot_scales, out, offsets, groups, values.shape[0],
        slot_base, columns, out.stride(0), quantized.stride(0), row_scales.stride(0), rows_above, rows_at_most, inner,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=_FP8_BLOCK, GROUP_M=config.group_m,
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
    with two multiplies per pair, exact at any scale (see the module docstring). Both read the flag
    on the device: nothing syncs with the host.

    With ``layout="mma"`` (pools made with :data:`flatep.quant.tensor.MXFP4_FP8_ACTIVATIONS`) and a
    :data:`FP8MMA` config (on a Hopper GPU) the first launch is :mod:`flatep.kernels.mxfp4_fp8mma`'s,
    on the rows split into two e4m3 parts (:mod:`flatep.kernels.fp8_split`), which flags each group's
    128 columns whose tiles read a scale byte outside its window (:data:`flatep.kernels.mxfp4_fp8mma.LOW`
    to ``HIGH``); the second is a Triton tile of the same height that decodes that layout exactly into
    bf16 (:func:`_mma_decoded_tile`), on the rows as they are, and computes those flagged tiles alone
    (where ``N`` is not a multiple of 128, always the last 128 columns). ``K`` not a multiple of 128
    takes K steps of 64. Any other config, or operands the fp8 kernel's copies cannot take, runs that
    exact tile alone.

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
        config: tiles (default :func:`default_config`); ``block_k`` a power of two, at least 32.
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
    _check_common(rows, values)
    _check_layout(layout, "mxfp4", ("words", "mma"))
    groups, columns, half = values.shape
    inner = rows.shape[1]
    if values.dtype != torch.uint8 or 2 * half != inner or inner % 32:
        raise ValueError(f"values must be [G, N, K/2={inner // 2}] uint8 with K a multiple of 32, got {values.dtype} "
                         f"{list(values.shape)}")
    if scales.dtype != torch.uint8 or tuple(scales.shape) != (groups, columns, inner // 32):
        raise ValueError(f"scales must be a [{groups}, {columns}, {inner // 32}] uint8 tensor, got "
                         f"{scales.dtype} {list(scales.shape)}")
    slot_values, slot_scales = _check_groups(rows, values, scales, offsets, slots, slot_base)
    groups = offsets.shape[0]
    config = config or default_config(rows.shape[0], groups, "mxfp4", rows.device, layout)
    if config.block_k < 32 or config.block_k & (config.block_k - 1):
        raise ValueError(f"mxfp4 block_k must be a power of two, at least 32, got {config.block_k}")
    if config.rescale:
        raise ValueError(f"rescale is an fp8 tile option (mxfp4 has no per-step scales of the product), got {config}")
    if layout == "mma":
        return _mxfp4_mma_grouped_mm(rows, values, scales, offsets, config, _output(rows, columns, out),
                                     _check_group_rows(group_rows), slot_values, slot_scales, slot_base, fp8_rows)
    if fp8_rows is not None:
        raise ValueError("fp8_rows are the rows split for the mma layout; words take the rows as they are")
    if config.wgmma:
        _check_mxfp4_wgmma(config, rows.device)
    natural_k = not config.swap_ab and config.block_m >= 64
    if config.lane_words and (natural_k or config.block_k < 64):
        raise ValueError(f"lane_words needs a tile whose weights are a register operand (block_m below 64, or "
                         f"swap_ab) and block_k of 64 or more (one 32-column chunk a step has one order), got {config}")
    rows_above, rows_at_most = _check_group_rows(group_rows)
    out = _output(rows, columns, out)
    if config.wgmma:
        if slot_values.numel() == 0:  # no slot groups: the kernel never reads the slot set
            slot_values, slot_scales = values, scales
        if mxfp4_wgmma.fits(rows, values, scales, out) and mxfp4_wgmma.fits(rows, slot_values, slot_scales, out):
            programs = persistent_grid(rows.shape[0], groups, columns, config, rows.device)[0]
            if config.swap_ab:
                mxfp4_swap.mxfp4_swap_launch(rows, values, scales, slot_values, slot_scales, out, offsets,
                                             values.shape[0], slot_base, rows_above, rows_at_most, config.block_m,
                                             config.group_m, config.num_stages, programs)
            else:
                mxfp4_wgmma.mxfp4_wgmma_launch(rows, values, scales, slot_values, slot_scales, out, offsets,
                                               values.shape[0], slot_base, rows_above, rows_at_most, config.group_m,
                                               config.num_stages, programs)
            return out
        if config.swap_ab:  # the Triton short tile of the same height
            config = dataclasses.replace(_MXFP4_SHORT[config.block_m], group_m=config.group_m)
        else:
            config = dataclasses.replace(_MXFP4_TALL, group_m=config.group_m)
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
    where ``config`` is one of :data:`FP8MMA` and its copies take the operands, then the exact Triton
    pass (every tile if the fp8 pass did not run, else only the tiles it flagged)."""
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
                config.num_stages, programs, mxfp4_fp8mma.max_registers(config.programs_per_sm))
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
