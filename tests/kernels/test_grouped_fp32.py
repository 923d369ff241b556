"""The fp32 grouped GEMMs of the expert backward: Triton (interpreter on CPU) against torch._grouped_mm."""
from __future__ import annotations

import pytest
import torch

from flatep.kernels.grouped_fp32 import grouped_outer_mm, grouped_rows_mm
from tests.helpers import DEVICE

# Empty groups first, in the middle and last; rows past the last group (and NaN there, never read).
CASES = [([0, 5, 5, 70], 83), ([40, 40, 41, 41], 41), ([0, 0, 0, 0], 8), ([17, 33, 50, 64], 64)]


@pytest.mark.parametrize("ends, rows", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_rows_mm_equals_torch(ends, rows, dtype):
    generator = torch.Generator().manual_seed(rows)
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    a = torch.randn(rows, 24, generator=generator).to(DEVICE)
    a[ends[-1]:] = float("nan")
    weights = torch.randn(4, 40, 24, generator=generator).to(DEVICE, dtype)  # [G, N, K], passed transposed
    got = grouped_rows_mm(a, weights.transpose(-2, -1), offsets, backend="triton")
    expected = grouped_rows_mm(a.cpu(), weights.cpu().float().transpose(-2, -1), offsets.cpu(), backend="torch")
    assert got.dtype == torch.float32 and got.shape == (rows, 40)
    assert torch.equal(got[ends[-1]:].cpu(), torch.zeros(rows - ends[-1], 40))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ends, rows", CASES)
def test_grouped_outer_mm_equals_torch(ends, rows):
    generator = torch.Generator().manual_seed(rows + 1)
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    x = torch.randn(rows, 20, generator=generator).to(DEVICE)
    y = torch.randn(rows, 36, generator=generator).to(DEVICE)
    x[ends[-1]:], y[ends[-1]:] = float("nan"), float("nan")
    got = grouped_outer_mm(x, y, offsets, backend="triton")
    expected = torch.stack([x[start:end].T.cpu() @ y[start:end].cpu() for start, end in zip([0] + ends[:-1], ends)])
    assert got.shape == (4, 20, 36)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grouped_outer_mm(x.cpu(), y.cpu(), offsets.cpu(), backend="torch"), expected,
                               rtol=1e-5, atol=1e-5)


def test_precision_is_checked_and_tf32_stays_close():
    """``tf32`` products (tensor cores on CUDA; the interpreter computes fp32) stay within TF32's
    rounding of the fp32 result; an unknown precision is refused before any kernel runs.

    The bounds: an operand rounded to TF32 (10 mantissa bits) is off by up to 2**-10 of itself, so
    a sum of n products of unit normals drifts by about sqrt(n) * 1e-3 and at worst n * 2e-3
    (n = 24 inner terms here, up to 65 rows in the outer products)."""
    ends, rows = CASES[0]
    generator = torch.Generator().manual_seed(5)
    offsets = torch.tensor(ends, dtype=torch.int32, device=DEVICE)
    a = torch.randn(rows, 24, generator=generator).to(DEVICE)
    b = torch.randn(4, 24, 40, generator=generator).to(DEVICE, torch.bfloat16)
    exact = grouped_rows_mm(a, b, offsets, backend="triton")
    torch.testing.assert_close(grouped_rows_mm(a, b, offsets, backend="triton", precision="tf32"), exact,
                               rtol=1e-2, atol=5e-2)
    outer = grouped_outer_mm(a, a, offsets, backend="triton")
    torch.testing.assert_close(grouped_outer_mm(a, a, offsets, backend="triton", precision="tf32"), outer,
                               rtol=1e-2, atol=1e-1)
    for call in (grouped_rows_mm, grouped_outer_mm):
        with pytest.raises(ValueError, match="precision must be one of"):
            call(a, b if call is grouped_rows_mm else a, offsets, precision="bf16")
