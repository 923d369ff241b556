"""The rows' split into two e4m3 parts (:mod:`flatep.kernels.fp8_split`): the Triton kernel against the
torch definition over the rows a shard holds, and ``hi + lo`` giving the rows back."""
from __future__ import annotations

import pytest
import torch

from flatep.kernels.backend import use_triton
from flatep.kernels.fp8_split import split_rows, split_rows_triton
from tests.helpers import DEVICE

CENTER = 123


def _rows(count: int, columns: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.logspace(-3, 3, count)[:, None]
    x = (torch.randn(count, columns, generator=generator) * magnitudes).bfloat16()
    x[3] = 0  # a row of zeros
    x[4, 7] = -2.0**-20  # a value far below its row's largest: lo is an e4m3 subnormal, or 0
    return x.to(DEVICE)


def test_hi_plus_lo_gives_the_rows_back():
    x = _rows(24, 96, seed=1)
    hi_lo, factor = split_rows(x, CENTER)
    hi, lo = hi_lo[:24].float(), hi_lo[24:].float()
    t = CENTER - 127 - torch.log2(factor)  # factor = 2**(center - 127 - t)
    back = torch.ldexp(hi + lo, -t.int()[:, None])
    amax = x.float().abs().amax(1, keepdim=True)
    # x * 2**t keeps 8 significant bits; lo holds the last 4 exactly where the lowest is at least 2**-9,
    # e4m3's smallest step: where x * 2**t is at least 2**-2
    representable = x.float().abs() >= amax * 2.0**-9
    assert torch.equal(back[representable], x.float()[representable])
    assert torch.allclose(back, x.float(), rtol=0, atol=float(amax.max()) * 2.0**-15)
    assert (hi.abs().amax(1)[amax[:, 0] > 0] >= 128).all() and (hi.abs() <= 256).all()
    assert factor[3] == 2.0**(CENTER - 127 - 108) and (hi_lo[[3, 27]].float() == 0).all()


@pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
def test_the_kernel_equals_the_definition_over_the_shards_rows():
    """Rows before ``end`` less ``[skip_start, skip_stop)`` are split (as torch defines it; zeros of
    either sign counted equal); the rows outside keep the poison they held."""
    x = _rows(37, 1040, seed=2)  # K not a multiple of the kernel's 512-column loads
    end = torch.tensor([33], dtype=torch.int32, device=DEVICE)
    skip = (torch.tensor([11], dtype=torch.int32, device=DEVICE), 20)
    expected_hi_lo, expected_factor = split_rows(x, CENTER)
    hi_lo, factor = split_rows_triton(x, CENTER, end, skip)
    computed = torch.cat([torch.arange(11), torch.arange(20, 33)]).to(DEVICE)
    for part in (0, 37):
        assert torch.equal(hi_lo[computed + part].float(), expected_hi_lo[computed + part].float())
    assert torch.equal(factor[computed], expected_factor[computed])
    whole, whole_factor = split_rows_triton(x, CENTER)
    assert torch.equal(whole.float(), expected_hi_lo.float()) and torch.equal(whole_factor, expected_factor)


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match="rows must be"):
        split_rows_triton(torch.zeros(4, 64), CENTER)
    with pytest.raises(ValueError, match="skip must be"):
        split_rows_triton(torch.zeros(4, 64, dtype=torch.bfloat16), CENTER, skip=(3, 4))
