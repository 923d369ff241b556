"""Input checks shared by FlatEP's grouped GEMMs (the packed ones of :mod:`flatep.kernels.quant_gemm`
and :mod:`flatep.kernels.mxfp4_dequant`, the bf16 decode ones of :mod:`flatep.kernels.decode_gemm`):
the rows, the weights' values, a launch's offsets and second weight set, its output, and the group
sizes it computes. Each raises ``ValueError`` naming the argument and what it expects, before any
kernel runs.
"""
from __future__ import annotations

import torch

ALL_ROWS = 2**31 - 1
"""``group_rows``' upper bound that takes every group (int32's largest value)."""


def check_group_rows(group_rows: tuple[int, int] | None) -> tuple[int, int]:
    """``(rows_above, rows_at_most)`` of a launch (None: every group), validated: the launch computes
    the groups of more than ``rows_above`` and at most ``rows_at_most`` rows."""
    if group_rows is None:
        return 0, ALL_ROWS
    if (not isinstance(group_rows, tuple) or len(group_rows) != 2
            or any(isinstance(v, bool) or not isinstance(v, int) for v in group_rows)
            or not 0 <= group_rows[0] <= group_rows[1] <= ALL_ROWS):
        raise ValueError(f"group_rows must be None or (rows_above, rows_at_most) ints with 0 <= rows_above <= "
                         f"rows_at_most <= {ALL_ROWS}, got {group_rows!r}")
    return group_rows


def check_rows(rows: torch.Tensor) -> None:
    """``rows``: ``[M, K]`` bf16 with unit column stride (any row stride)."""
    if rows.dim() != 2 or rows.dtype != torch.bfloat16 or rows.stride(1) != 1:
        raise ValueError(f"rows must be [M, K] bfloat16 with unit column stride, got {rows.dtype} {list(rows.shape)}")


def check_rows_and_values(rows: torch.Tensor, values: torch.Tensor) -> None:
    """:func:`check_rows`, and the weights' ``values``: a contiguous ``[G, N, ...]`` tensor (its dtype
    and last dimension are the format's to check)."""
    check_rows(rows)
    if values.dim() != 3 or not values.is_contiguous():
        raise ValueError(f"weight values must be a contiguous [G, N, ...] tensor, got {list(values.shape)}")


def check_groups(
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
    check_split(rows, offsets, groups, slot_base if slots is not None else None)
    return (values, scales) if slots is None else slots


def check_split(rows: torch.Tensor, offsets: torch.Tensor, groups: int, slot_base: int | None) -> None:
    """Checks of a grouped launch's ``offsets`` (``[groups]`` int32) and, with a second weight set,
    of its first row ``slot_base``."""
    if slot_base is not None and (isinstance(slot_base, bool) or not isinstance(slot_base, int)
                                  or not 0 <= slot_base <= rows.shape[0]):
        raise ValueError(f"slot_base must be an int row in [0, {rows.shape[0]}], got {slot_base!r}")
    if offsets.dtype != torch.int32 or offsets.shape != (groups,) or not offsets.is_contiguous():
        raise ValueError(f"offsets must be a contiguous [{groups}] int32 tensor, got {offsets.dtype} "
                         f"{list(offsets.shape)}")


def output_for(rows: torch.Tensor, columns: int, out: torch.Tensor | None) -> torch.Tensor:
    """The ``[M, columns]`` bf16 output of a GEMM over ``rows [M, K]``: ``out`` checked (unit column
    stride), or a new tensor if None."""
    if out is None:
        return torch.empty(rows.shape[0], columns, dtype=rows.dtype, device=rows.device)
    if out.shape != (rows.shape[0], columns) or out.dtype != torch.bfloat16 or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows.shape[0]}, {columns}] bfloat16 with unit column stride, got {out.dtype} "
                         f"{list(out.shape)}")
    return out
