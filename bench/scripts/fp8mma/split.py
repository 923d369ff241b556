"""The prototype's activation split as one Triton launch: ``rows [M, K]`` bf16 -> ``hi_lo [2M, K]`` fp8
e4m3 and ``factor [M]`` fp32, as :func:`mxfp4_fp8mma.split_rows` computes them in torch (one program a
row: its largest magnitude, then each element times ``2**t``, ``hi`` its e4m3 rounding, ``lo`` the
rest's)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _split_kernel(x_ptr, out_ptr, factor_ptr, M, K, stride_x, CENTER_EXPONENT: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=k + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    bits = top.to(tl.int32, bitcast=True)
    # ceil(log2(top)) of a normal float: its exponent, plus one unless its mantissa is zero
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    exponent = tl.where(top > 0, exponent, -100)
    t = tl.minimum(tl.maximum(8 - exponent, -126), 127)
    scale = ((t + 127) << 23).to(tl.float32, bitcast=True)
    tl.store(factor_ptr + row, tl.exp2((CENTER_EXPONENT - t).to(tl.float32)))
    for k in range(0, K, BLOCK_K):
        mask = k + cols < K
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=mask, other=0.0).to(tl.float32) * scale
        hi = x.to(tl.float8e4nv)
        lo = (x - hi.to(tl.float32)).to(tl.float8e4nv)
        tl.store(out_ptr + row * K + k + cols, hi, mask=mask)
        tl.store(out_ptr + (M + row) * K + k + cols, lo, mask=mask)


def split_rows_triton(rows: torch.Tensor, center: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [M, K]`` bf16 -> ``hi_lo [2M, K]`` fp8 e4m3 and ``factor [M]`` fp32 ``2**(center - 127 - t)``."""
    M, K = rows.shape
    out = torch.empty(2 * M, K, dtype=torch.float8_e4m3fn, device=rows.device)
    factor = torch.empty(M, dtype=torch.float32, device=rows.device)
    _split_kernel[(M,)](rows, out, factor, M, K, rows.stride(0), CENTER_EXPONENT=center - 127, BLOCK_K=1024)
    return out, factor
