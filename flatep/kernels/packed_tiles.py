"""Tile choice of the packed (fp8, mxfp4) grouped GEMMs of :mod:`flatep.kernels.quant_gemm`.

:class:`GemmConfig` holds a launch's tiles and program order; :func:`default_config` gives the tiles
for a step's rows per group on a device, and :func:`packed_launches` a step's launches (short groups
in short row tiles, hot groups in tall ones). Correctness depends on none of it: each choice is a
timing, and its docstring says which measurement made it. The Gluon kernels' fixed tiles
(:data:`MXFP4_SWAP`, :data:`MXFP4_WGMMA`, :data:`FP8MMA`) and the environment flags that turn them
on or off (:data:`MXFP4_SWAP_DEFAULT`, :data:`MXFP4_WGMMA_DEFAULT`) live here too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flatep.environment import environment_flag
from flatep.kernels import fp8_wgmma, mxfp4_fp8mma, mxfp4_swap, mxfp4_wgmma
from flatep.kernels.grouped_checks import ALL_ROWS


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes and program order of a grouped GEMM launch (tuning; correctness does not depend on them).

    ``block_m``, ``block_n``: output rows and columns per program (powers of two, at least 16);
    ``block_k``: input columns per step (fp8: 128, one scale block; mxfp4: a power of two, at least 32);
    ``group_m``: row tiles of a group that take the column blocks together (see :mod:`flatep.kernels.grouped_tiles`);
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
    or ``swap_ab``; ``block_k`` of 64 or more): take each K step's words in the order of
    :func:`flatep.kernels.mxfp4_decode.lane_word_order`, in which the words a lane decodes share their
    e8m0 scale blocks where Triton's operand layout gives a lane one word of each 32-column chunk of the
    step (in a local sm_90 compile: the 64-wide steps of 16- and 32-row tiles on 2 warps of 128 or 256
    columns or 4 of 256, the 128-wide steps of the 16 x 128 tile on 2 warps and the 32 x 256 tile on 4,
    and the swapped 16 x 128 x 128 tile); elsewhere the reorder can cost register moves instead
    (``bench/scripts/gemm_kloop_sass.py`` compares a tile with and without). ``wgmma`` (Hopper GPUs): run
    a warp-specialized Gluon kernel. fp8: :mod:`flatep.kernels.fp8_wgmma`, which scales each K step's
    product while the next step's warp-group MMA runs; its tile is fixed (``block_m`` and ``block_n`` 128,
    ``num_warps`` 8: its two consumer warp groups, beside which a producer warp issues the copies; not
    swapped or rescaled), ``num_stages`` its shared-memory stages (5 or 6). Its TMA copies need 16-byte
    aligned operands: where the fp8 rows' or the output's base address or row stride is not (rows of a
    strided view, say), and where ``K`` holds fewer 128-wide steps than its stages, the launch runs the
    Triton 64 x 128 tile instead. mxfp4:
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
FP8_TALL = GemmConfig(64, 128, 128, num_warps=4, num_stages=4)
# mxfp4 Triton tiles past 32 rows per group (and where the Gluon kernel's copies cannot run)
MXFP4_TALL = GemmConfig(64, 256, 64, num_warps=4, num_stages=4)
MXFP4_WGMMA = GemmConfig(mxfp4_wgmma.WG_M, mxfp4_wgmma.BLOCK_N, mxfp4_wgmma.BLOCK_K, num_warps=mxfp4_wgmma.NUM_WARPS,
                         num_stages=mxfp4_wgmma.LOAD_STAGES, programs_per_sm=1, wgmma=True)
"""The Gluon mxfp4 kernel's tile (:mod:`flatep.kernels.mxfp4_wgmma`, Hopper GPUs)."""
# mxfp4 Triton tiles of at most 16 and 32 rows per group (and where the swapped Gluon kernel's copies cannot run)
MXFP4_SHORT = {16: GemmConfig(16, 128, 128, num_warps=2, num_stages=3, programs_per_sm=6, lane_words=True),
                32: GemmConfig(32, 256, 128, num_warps=4, num_stages=3, lane_words=True)}
MXFP4_SWAP = {block_m: GemmConfig(block_m, mxfp4_swap.BLOCK_N, mxfp4_swap.BLOCK_K, num_warps=mxfp4_swap.NUM_WARPS,
                                  num_stages=mxfp4_swap.LOAD_STAGES,
                                  programs_per_sm=mxfp4_swap.PROGRAMS_PER_SM[block_m], swap_ab=True, wgmma=True)
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
MXFP4_SWAP64_DEFAULT = environment_flag("FLATEP_MXFP4_SWAP64", False)
"""Whether :func:`default_config` gives groups of more than 32 rows ``MXFP4_SWAP[64]`` (the swapped
Gluon kernel's 64-row tile, 2 programs an SM) on a Hopper GPU: off unless the environment sets
``FLATEP_MXFP4_SWAP64=1``; :data:`MXFP4_WGMMA_DEFAULT` takes precedence. A candidate for a skewed
decode step's hot launch, where the Triton 64 x 256 tile runs now: it compiles for sm_90 without
spills (local compile, Triton 3.6 and 3.9) but has not run on a GPU yet
(``bench/scripts/mxfp4_chunk_checks.sh`` runs its tests and times it)."""
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
    check_layout(layout, format)
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
            return dataclasses.replace(FP8_TALL, num_stages=3)
        return FP8_TALL
    if per_group <= 16:
        return MXFP4_SHORT[16]
    if per_group <= 32:
        if MXFP4_SWAP_DEFAULT and device is not None and fp8_wgmma.available(device):
            return MXFP4_SWAP[32]
        return MXFP4_SHORT[32]
    if MXFP4_WGMMA_DEFAULT and device is not None and fp8_wgmma.available(device):
        return MXFP4_WGMMA
    if MXFP4_SWAP64_DEFAULT and device is not None and fp8_wgmma.available(device):
        return MXFP4_SWAP[64]
    return MXFP4_TALL


HOT_ROWS = 64
"""Groups holding more rows than this run in a launch of their own with tall tiles
(:func:`packed_launches` for fp8, and :func:`flatep.kernels.decode_gemm.decode_launches` for
bf16; mxfp4 splits at 16 and 32 rows): a hot expert's rows fill tall tiles, and its many short
row tiles would otherwise each stream the same weight tile (and, packed, decode it again)."""

_SHORT_ROWS = 16  # the shortest row tile


def packed_launches(
    rows: int, groups: int, format: str, device: torch.device | None = None, layout: str = "words",
) -> list[tuple[GemmConfig, tuple[int, int] | None]]:
    """The launches of a packed (``fp8``, ``mxfp4``) grouped GEMM over ``rows`` real rows in
    ``groups`` groups on ``device``: ``(tiles, group_rows)`` each (see
    :func:`flatep.kernels.quant_gemm.fp8_grouped_mm_triton`), over disjoint groups into the same output
    (:func:`flatep.experts.grouped.quantized_grouped_mm` runs them side by side on CUDA streams:
    :mod:`flatep.kernels.streams`).

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
    check_layout(layout, format)
    if layout == "mma" and device is not None and fp8_wgmma.available(device):
        return [(FP8MMA[32], (0, 2 * _SHORT_ROWS)), (FP8MMA[64], (2 * _SHORT_ROWS, ALL_ROWS))]
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
                (hot, (2 * _SHORT_ROWS, ALL_ROWS))]
    return [(tiles, (0, HOT_ROWS)), (hot, (HOT_ROWS, ALL_ROWS))]


def check_layout(layout: str, format: str, layouts: tuple[str, ...] = ("checkpoint", "words", "mma")) -> None:
    """Raise ``ValueError`` unless ``layout`` is one of ``layouts`` (``mma`` for mxfp4 only)."""
    if layout not in layouts or (layout == "mma" and format != "mxfp4"):
        raise ValueError(f"layout must be one of {layouts} ('mma' for mxfp4 only), got {layout!r} for {format}")
