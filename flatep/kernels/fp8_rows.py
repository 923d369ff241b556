"""FP8 token rows for dispatch: each row packed with its scales, so any transport moves it as plain words.

With ``dispatch_dtype=torch.float8_e4m3fn`` (:func:`flatep.ep_moe`) every token row crosses the
link as one packed row of ``int32`` words (:func:`packed_words` of them) instead of ``H`` bf16
values, as DeepEP's low-latency dispatch does:

- bytes ``[0, H)``: the ``H`` values in e4m3 (``float8_e4m3fn``), in column order;
- bytes ``[H, H + 4 G)``: ``G = ceil(H / 128)`` float32 scales, one per 128-wide column group
  (the last group partial when ``H`` is not a multiple of 128).

The values and scales are DeepSeek-V3's activation quantization
(:func:`flatep.quant.quantize_fp8_activations`: ``scale = max(amax, 1e-10) / 448``, values rounded
to nearest even and saturated at +-448), so a row costs ``H + 4 G`` bytes, ``(1 + 1/32) / 2``
of its bf16 bytes. ``H`` must be a multiple of 4 (the scales start on a word). The receiver
unpacks each real row into the shard the experts read, in the layer's dtype: ``value * scale``
in fp32, rounded once (:func:`unpack_real_rows_triton`); fp8 experts instead read the packed rows
as they are (:class:`Fp8Rows`). Combine stays in the layer's dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flatep.config import next_pow2
from flatep.kernels.backend import interpreting, round_to_bf16
from flatep.kernels.dispatch import real_rows, row_block, row_grid
from flatep.kernels.fp8_activations import act_quant_kernel
from flatep.quant.fp8 import FP8_BLOCK, quantize_fp8_activations

FP8_DISPATCH = torch.float8_e4m3fn
"""The ``dispatch_dtype`` that sends packed fp8 rows."""

DISPATCH_FORMATS = {"bf16": None, "fp8": FP8_DISPATCH}
"""Dispatch formats by name (``flatep bench``'s ``dispatch``) and the ``dispatch_dtype`` of each
(``None``: rows in the layer's own dtype)."""


def check_dispatch_dtype(dispatch_dtype: torch.dtype | None, dtype: torch.dtype, hidden: int) -> None:
    """Raise ``ValueError`` unless ``dispatch_dtype`` is ``None``, ``dtype`` (the layer's) or fp8 with ``hidden % 4 == 0``."""
    if dispatch_dtype not in (None, dtype, FP8_DISPATCH):
        raise ValueError(f"dispatch_dtype must be None, x's dtype ({dtype}) or torch.float8_e4m3fn, got {dispatch_dtype}")
    if dispatch_dtype == FP8_DISPATCH and hidden % 4:
        raise ValueError(f"dispatch_dtype=torch.float8_e4m3fn needs a hidden size that is a multiple of 4, got H={hidden}")


def packs_rows(dispatch_dtype: torch.dtype | None) -> bool:
    """Whether rows cross the link packed in fp8 (else in the layer's own dtype)."""
    return dispatch_dtype == FP8_DISPATCH


def scale_groups(hidden: int) -> int:
    """``G``: scales of one row (one per 128 columns, the last group possibly partial)."""
    return -(-hidden // FP8_BLOCK)


def packed_words(hidden: int) -> int:
    """``int32`` words of one packed row: ``H / 4`` of values, then ``G`` scales."""
    if hidden % 4:
        raise ValueError(f"a packed fp8 row needs a hidden size that is a multiple of 4, got H={hidden}")
    return hidden // 4 + scale_groups(hidden)


def packed_row_bytes(hidden: int) -> int:
    """Link bytes of one packed row: ``H + 4 G``."""
    return 4 * packed_words(hidden)


def dispatch_row_bytes(hidden: int, element_size: int, dispatch_dtype: torch.dtype | None) -> int:
    """Bytes of one row as dispatch sends it: packed with fp8 dispatch, else ``H`` elements of
    ``element_size`` bytes (combine always sends the latter)."""
    return packed_row_bytes(hidden) if packs_rows(dispatch_dtype) else hidden * element_size


def entry_link_bytes(hidden: int, element_size: int, dispatch_dtype: torch.dtype | None) -> int:
    """Link bytes of one entry in dispatch plus combine: its row out, its fp32 route weight, and a
    row of ``H`` elements back."""
    return dispatch_row_bytes(hidden, element_size, dispatch_dtype) + 4 + hidden * element_size


def _views(packed: torch.Tensor, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values [.., H] e4m3, scales [.., G] fp32)``: views of the two parts of packed rows ``[.., W]``."""
    words = hidden // 4
    values = packed[..., :words].view(torch.float8_e4m3fn)
    return values, packed[..., words:].view(torch.float32)


@dataclass(frozen=True)
class Fp8Rows:
    """Received rows still packed, as the fp8 expert GEMMs take their activations.

    The fp8 experts quantize their input exactly as fp8 dispatch does (per token, per 128 columns):
    where both meet, the gate/up GEMM reads the dispatched values and scales themselves, and the
    rows are neither unpacked nor quantized again.

    Attributes:
        values: ``[.., rows, H]`` float8_e4m3fn view of the packed rows (row stride ``4 W`` bytes).
        scales: ``[.., rows, G]`` float32 view (row stride ``W`` words).
    """

    values: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def of(cls, packed: torch.Tensor, hidden: int) -> "Fp8Rows":
        """Views of packed rows ``[.., rows, W]`` int32 (no copy)."""
        return cls(*_views(packed, hidden))

    def __getitem__(self, index: int | slice) -> "Fp8Rows":
        """The same leading-dimension index of both views (a rank, or a range of rows)."""
        return Fp8Rows(self.values[index], self.scales[index])


def pack_rows_torch(x: torch.Tensor) -> torch.Tensor:
    """Quantize rows ``x [.., H]`` (bf16 or fp32) into packed rows ``[.., W]`` int32 (the module's layout)."""
    hidden = x.shape[-1]
    values, scales = quantize_fp8_activations(x.reshape(-1, hidden))
    packed = torch.empty(*x.shape[:-1], packed_words(hidden), dtype=torch.int32, device=x.device)
    packed_values, packed_scales = _views(packed, hidden)
    packed_values.copy_(values.view(packed_values.shape))
    packed_scales.copy_(scales.view(packed_scales.shape))
    return packed


def unpack_rows_torch(packed: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows ``[.., W]`` back to ``[.., H]`` in ``dtype``: ``value * scale`` in fp32, rounded once."""
    values, scales = _views(packed, hidden)
    return (values.float() * scales.repeat_interleave(FP8_BLOCK, dim=-1)[..., :hidden]).to(dtype)


def pack_rows_triton(x: torch.Tensor) -> torch.Tensor:
    """:func:`pack_rows_torch` as one Triton launch (bit-equal to it): ``x [.., H]`` contiguous."""
    hidden = x.shape[-1]
    words = packed_words(hidden)
    rows = x.numel() // hidden
    packed = torch.empty(*x.shape[:-1], words, dtype=torch.int32, device=x.device)
    flat = packed.view(rows, words)
    values, scales = _views(flat, hidden)
    block_m = 16
    # Every row is a token (no end to read on the device). The values' row stride is in bytes
    # (4 W), the scales' in words (W): both views share the rows.
    act_quant_kernel[(triton.cdiv(rows, block_m), scale_groups(hidden))](
        x.view(rows, hidden), values, scales, None, None, rows, 0, hidden, 4 * words, words, hidden,
        BLOCK_M=block_m, GROUP=FP8_BLOCK, ROUND_FIRST=interpreting(),
    )
    return packed


@triton.jit
def _unpack_kernel(
    values_ptr, scales_ptr, out_ptr, offsets_ptr, padding_ptr, first_rank, rows, slot_base, blocks, work,
    H: tl.constexpr, WORDS: tl.constexpr, GROUPS: tl.constexpr, EPN: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_R: tl.constexpr, GROUP: tl.constexpr, ROUND_BF16: tl.constexpr,
):
    # Work item = (local rank, block of BLOCK_R shard rows), grid-strided like the expansion: the
    # real rows only, so the padding rows of the shard stay as they were.
    for item in range(tl.program_id(0), work, tl.num_programs(0)):
        local, rank, row, inside, used = row_block(item, blocks, first_rank, rows, offsets_ptr, slot_base, EPN, BLOCK_R)
        if used:
            real = inside & real_rows(row, offsets_ptr + rank * 2 * EPN, padding_ptr + rank * 4 * EPN, slot_base,
                                      EPN, 2 * EPN, BLOCK_G)
            # Two views of the packed rows: bytes (the values) and words (the scales, after H // 4 words).
            values = values_ptr + (local * rows + row) * (4 * WORDS)
            scales = scales_ptr + (local * rows + row) * WORDS + H // 4
            out = out_ptr + (local * rows + row) * H
            for group in range(0, GROUPS):
                column = group * GROUP + tl.arange(0, GROUP)
                mask = real[:, None] & (column < H)[None, :]
                value = tl.load(values[:, None] + column[None, :], mask=mask, other=0.0).to(tl.float32)
                scale = tl.load(scales + group, mask=real, other=0.0)
                result = value * scale[:, None]
                if ROUND_BF16:  # the interpreter's fp32 -> bf16 cast truncates: round to nearest even first
                    result = round_to_bf16(result)
                tl.store(out[:, None] + column[None, :], result.to(out_ptr.dtype.element_ty), mask=mask)


def unpack_real_rows_triton(
    packed: torch.Tensor, out: torch.Tensor, offsets: torch.Tensor, padding: torch.Tensor, slot_base: int,
    first_rank: int, block_r: int = 4, programs: int | None = None,
) -> None:
    """Unpack every real row of this process's packed shards into ``out`` (padding rows untouched).

    Args:
        packed: ``[n, rows, W]`` (or ``[rows, W]``) int32 packed shards, contiguous.
        out: ``[n, rows, H]`` (or ``[rows, H]``) bf16 or fp32, contiguous: the shards the experts read.
        offsets: ``[R, 2*epn]`` int32; padding: ``[R, 2*epn, 2]`` int32; slot_base: from the plan.
        first_rank: global rank of the first shard.
        block_r, programs: rows per work item; cap on the programs (results do not depend on it).
    """
    rows, hidden = out.shape[-2:]
    ranks_here = out.numel() // (rows * hidden)
    groups = offsets.shape[1]
    blocks = triton.cdiv(rows, block_r)
    _unpack_kernel[row_grid(ranks_here, rows, block_r, programs)](
        packed.view(torch.float8_e4m3fn), packed.view(torch.float32), out, offsets, padding, first_rank, rows,
        slot_base, blocks, ranks_here * blocks,
        H=hidden, WORDS=packed.shape[-1], GROUPS=scale_groups(hidden), EPN=groups // 2, BLOCK_G=next_pow2(groups),
        BLOCK_R=block_r, GROUP=FP8_BLOCK, ROUND_BF16=interpreting() and out.dtype == torch.bfloat16,
    )


def unpack_real_rows_torch(packed: torch.Tensor, out: torch.Tensor, real: torch.Tensor) -> None:
    """Plain-torch :func:`unpack_real_rows_triton`: ``packed [n, rows, W]``, ``out [n, rows, H]``, ``real [n, rows] bool``.

    Every row is unpacked and the real ones selected, rather than indexing by the mask, which would
    read the number of real rows on the host (a synchronisation on CUDA)."""
    out.copy_(torch.where(real.unsqueeze(-1), unpack_rows_torch(packed, out.shape[-1], out.dtype), out))
