"""A stand-in for :mod:`flatep.kernels.quant_gemm` that runs the mxfp4 experts through the fp8-activation
prototype (:mod:`mxfp4_fp8mma`), for ``python -m flatep.bench.experts_phase CONFIG --against FILE`` (as
``AGAINST=bench/scripts/fp8mma/quant_gemm_fp8mma.py bash bench/scripts/issue15_targets.sh`` runs it):
issue #15's Kimi-K3 cell with the prototype beside FlatEP's kernels, interleaved in the same run.

On a CUDA device an mxfp4 GEMM is one call (:func:`packed_launches`) that splits its rows once
(:func:`split.split_rows_triton`) and then launches the prototype side by side for the groups of
1-32 rows (32-row tiles, 128-wide K steps, 3 stages, 3 programs an SM) and of more (64-row tiles, 4
stages, 2 programs an SM at 128 registers), each checking its scale bytes. The weights are converted
to the prototype's word layout on the first call of each pool (the benchmark's eager run before its
CUDA-graph capture), so the timed replays do not convert them. Calls with borrow slots, off CUDA, or
fp8 weights run FlatEP's own functions. At exit it prints how many launches set the scale flag
(their products are wrong: the prototype has no second pass).
"""
from __future__ import annotations

import atexit
import sys
from pathlib import Path

import torch

import flatep
from flatep.kernels import quant_gemm as _flatep
from flatep.kernels.streams import side_by_side
from flatep.quant.mxfp4 import from_word_layout, unpack_mxfp4_nibbles

sys.path.insert(0, str(Path(flatep.__file__).resolve().parents[1] / "bench" / "scripts" / "fp8mma"))
import mxfp4_fp8mma as fp8mma  # noqa: E402
from split import split_rows_triton  # noqa: E402

fp8_grouped_mm_triton = _flatep.fp8_grouped_mm_triton
SHORT = dict(block_m=32, block_k=128, stages=3, check=True)
TALL = dict(block_m=64, block_k=128, stages=4, check=True, programs_per_sm=2, max_registers=128)
_WORDS: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
_FLAGS: list[torch.Tensor] = []


def packed_launches(rows: int, groups: int, format: str, device: torch.device | None = None) -> list:
    """One launch (``group_rows`` None) for mxfp4 on CUDA: :func:`mxfp4_grouped_mm_triton` makes its own."""
    if format == "mxfp4" and device is not None and device.type == "cuda":
        return [(_flatep.default_config(rows, groups, format, device), None)]
    return _flatep.packed_launches(rows, groups, format, device)


def _mma_words(values: torch.Tensor) -> torch.Tensor:
    """FlatEP's word layout ``[G, N, K/2]`` uint8 -> the prototype's ``[G, N, K/8]`` int32, once per pool."""
    key = (values.data_ptr(), tuple(values.shape))
    if key not in _WORDS:
        codes = unpack_mxfp4_nibbles(from_word_layout(values))
        _WORDS[key] = torch.stack([fp8mma.to_mma_words(expert) for expert in codes])
    return _WORDS[key]


def mxfp4_grouped_mm_triton(rows, values, scales, offsets, config=None, out=None, group_rows=None, *, slots=None,
                            slot_base=0):
    """FlatEP's contract (:func:`flatep.kernels.quant_gemm.mxfp4_grouped_mm_triton`) through the prototype."""
    column_fastest = scales.transpose(1, 2)
    if (rows.device.type != "cuda" or (slots is not None and slots[0].shape[0]) or group_rows is not None
            or not column_fastest.is_contiguous()):
        return _flatep.mxfp4_grouped_mm_triton(rows, values, scales, offsets, config, out, group_rows, slots=slots,
                                               slot_base=slot_base)
    if out is None:
        out = rows.new_empty(rows.shape[0], values.shape[1])
    words = _mma_words(values)
    hi_lo, factor = split_rows_triton(rows, fp8mma.CENTER)
    groups = offsets[:values.shape[0]]

    def launch(tile: dict, group_rows: tuple[int, int]) -> None:
        _FLAGS.append(fp8mma.launch(hi_lo, factor, words, column_fastest, out, groups, group_rows=group_rows,
                                    **tile))

    side_by_side([lambda: launch(SHORT, (0, 32)), lambda: launch(TALL, (32, 1 << 30))], rows.device)
    return out


@atexit.register
def _report() -> None:
    if _FLAGS:
        flagged = sum(int(flag.item()) for flag in _FLAGS)
        print(f"fp8mma stand-in: {len(_FLAGS)} launches, {flagged} with a scale byte outside the window",
              file=sys.stderr)
