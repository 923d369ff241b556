"""fp32 grouped GEMMs for the expert backward, reading the group offsets on the device only.

``torch._grouped_mm`` computes both products the backward needs, but on CUDA only for bfloat16
operands and output: other dtypes take its fallback, which copies ``offs`` to the host (a
synchronisation) and loops over the groups. The backward computes in fp32, so on CUDA it runs these
two kernels instead; on a CPU it calls ``torch._grouped_mm`` (fp32 is supported there). Both follow
``torch._grouped_mm``'s contract: ``offsets [G]`` int32 holds the inclusive end row of each group,
group ``g`` owns rows ``[offsets[g-1], offsets[g])``, and rows at and past ``offsets[-1]`` are not
read.

- :func:`grouped_rows_mm` (``torch._grouped_mm``'s 2D x 3D mode): ``out[i] = a[i] @ b[g(i)]``. The
  grid is sized from the shapes only (``cdiv(M, BLOCK_M) + G`` row tiles, an upper bound on the
  tiles of any grouping, times the column blocks); each program finds its group and row tile from
  a running sum of the groups' tiles and does nothing if it has none.
- :func:`grouped_outer_mm` (the 2D x 2D mode): ``out[g] = x[rows of g].T @ y[rows of g]``, one
  program per (group, output tile), looping over the group's rows.

Operands of any float dtype are loaded and converted to fp32 in registers (bfloat16 weights are
never copied to fp32 whole). ``precision`` picks the dots: ``"ieee"`` (the default) multiplies in
IEEE fp32 on the CUDA cores, so results are fp32 products summed in fp32; ``"tf32"`` runs them on
the tensor cores with the operands rounded to TF32 (10 mantissa bits, more than bfloat16's 7) and
fp32 sums, several times faster (the backward of bfloat16 models uses it). Every output element is
computed by one program in a fixed order: results are bit-identical from run to run, in either
precision. The interpreter (``TRITON_INTERPRET=1``) computes both in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatep.kernels.backend import use_triton

# Tiles of fp32 dots (CUDA cores, no tensor cores): moderate tiles keep registers in check.
_BLOCK = 64
_BLOCK_K = 32
_OUTER_ROWS = 32


@triton.jit
def _grouped_rows_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, M, N,
    stride_am, stride_ak, stride_bg, stride_bk, stride_bn, stride_om, stride_on,
    K: tl.constexpr, GROUPS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    group = -1
    first = 0
    end = 0
    seen = 0  # row tiles of the groups before g
    start = 0
    for g in range(GROUPS):
        group_end = tl.load(offsets_ptr + g)
        tiles = (group_end - start + BLOCK_M - 1) // BLOCK_M
        hit = (tile >= seen) & (tile < seen + tiles)
        group = tl.where(hit, g, group)
        first = tl.where(hit, start + (tile - seen) * BLOCK_M, first)
        end = tl.where(hit, group_end, end)
        seen += tiles
        start = group_end
    if group >= 0:
        rows = (first + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < end
        col_mask = cols < N
        b_base = b_ptr + group.to(tl.int64) * stride_bg
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            b = tl.load(b_base + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                        mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.dot(a, b, input_precision=PRECISION)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on, acc,
                 mask=row_mask[:, None] & col_mask[None, :])


@triton.jit
def _grouped_outer_kernel(
    x_ptr, y_ptr, out_ptr, offsets_ptr, P, Q,
    stride_xm, stride_xp, stride_ym, stride_yq, stride_og, stride_op, stride_oq,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr, PRECISION: tl.constexpr,
):
    group = tl.program_id(0)
    ps = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = tl.program_id(2) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    p_mask = ps < P
    q_mask = qs < Q
    start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    end = tl.load(offsets_ptr + group)
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    m = start
    while m < end:  # a while loop: the interpreter takes no loaded value as a range bound
        rows = (m + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ps[None, :] * stride_xp,
                    mask=row_mask[:, None] & p_mask[None, :], other=0.0).to(tl.float32)
        y = tl.load(y_ptr + rows[:, None] * stride_ym + qs[None, :] * stride_yq,
                    mask=row_mask[:, None] & q_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(tl.trans(x), y, input_precision=PRECISION)
        m += BLOCK_M
    out = out_ptr + group.to(tl.int64) * stride_og + ps[:, None] * stride_op + qs[None, :] * stride_oq
    tl.store(out, acc, mask=p_mask[:, None] & q_mask[None, :])


def _tile(size: int, block: int) -> int:
    """A power-of-two tile of at most ``block`` (at least 16, the smallest dot)."""
    return max(16, min(block, triton.next_power_of_2(size)))


PRECISIONS = ("ieee", "tf32")


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def grouped_rows_mm(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, backend: str = "auto", precision: str = "ieee"
) -> torch.Tensor:
    """``out[i] = a[i] @ b[g(i)]`` in fp32 for the group ``g(i)`` holding row ``i``.

    Args:
        a: ``[M, K]`` fp32 (any strides on CUDA; 16-byte aligned rows for ``torch._grouped_mm`` on a CPU).
        b: ``[G, K, N]`` any float dtype, any strides (e.g. a transposed ``[G, N, K]`` weight).
        offsets: ``[G]`` int32 inclusive end row of each group.
        backend: ``auto``/``triton`` run the kernel on CUDA (and on CPU under ``TRITON_INTERPRET=1``);
            otherwise ``torch._grouped_mm`` (on CUDA its fallback, which synchronises).
        precision: the Triton kernel's dots, ``"ieee"`` or ``"tf32"`` (see the module's docstring).

    Returns:
        ``[M, N]`` fp32; rows at and past ``offsets[-1]`` are zero.
    """
    _check_precision(precision)
    rows, inner = a.shape
    groups, _, columns = b.shape
    if not use_triton(a.device, backend):
        out = torch._grouped_mm(a, b.float(), offs=offsets)
        past = torch.arange(rows, device=a.device) >= offsets[-1]  # undefined there: zero them, read on the device
        return out.masked_fill_(past.unsqueeze(1), 0.0)
    out = torch.zeros(rows, columns, dtype=torch.float32, device=a.device)
    block_m, block_n, block_k = _tile(rows, _BLOCK), _tile(columns, _BLOCK), _tile(inner, _BLOCK_K)
    grid = (triton.cdiv(rows, block_m) + groups, triton.cdiv(columns, block_n))
    _grouped_rows_kernel[grid](
        a, b, out, offsets, rows, columns, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), K=inner, GROUPS=groups, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=precision,
    )
    return out


def grouped_outer_mm(
    x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, backend: str = "auto", precision: str = "ieee"
) -> torch.Tensor:
    """``out[g] = x[rows of g].T @ y[rows of g]`` in fp32: a weight gradient per group.

    Args:
        x: ``[M, P]`` fp32; y: ``[M, Q]`` fp32 (16-byte aligned rows for ``torch._grouped_mm`` on a CPU).
        offsets: ``[G]`` int32 inclusive end row of each group; rows past ``offsets[-1]`` are not read.
        backend, precision: as for :func:`grouped_rows_mm`.

    Returns:
        ``[G, P, Q]`` fp32 (zeros for groups without rows).
    """
    _check_precision(precision)
    rows, inner_p = x.shape
    inner_q = y.shape[1]
    groups = offsets.shape[0]
    if not use_triton(x.device, backend):
        return torch._grouped_mm(x.T, y, offs=offsets)
    out = torch.empty(groups, inner_p, inner_q, dtype=torch.float32, device=x.device)
    block_p, block_q = _tile(inner_p, _BLOCK), _tile(inner_q, _BLOCK)
    grid = (groups, triton.cdiv(inner_p, block_p), triton.cdiv(inner_q, block_q))
    _grouped_outer_kernel[grid](
        x, y, out, offsets, inner_p, inner_q, x.stride(0), x.stride(1), y.stride(0), y.stride(1),
        out.stride(0), out.stride(1), out.stride(2), BLOCK_M=_OUTER_ROWS, BLOCK_P=block_p, BLOCK_Q=block_q,
        PRECISION=precision,
    )
    return out
