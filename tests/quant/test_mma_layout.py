"""The mxfp4 ``mma`` layout (pools for fp8 activations): each code where :func:`mma_bit` says, round
trips through every layout, and refusals of shapes it cannot hold."""
from __future__ import annotations

import pytest
import torch

from flatep.quant import QuantizedTensor, from_mma_layout, mma_bit, to_mma_layout
from flatep.quant.mxfp4 import unpack_mxfp4_nibbles


def test_each_code_bit_lands_where_the_definition_says():
    generator = torch.Generator().manual_seed(5)
    values = torch.randint(0, 256, (3, 5, 48), dtype=torch.uint8, generator=generator)  # K = 96: three blocks
    codes = unpack_mxfp4_nibbles(values).int()  # [3, 5, 96]
    bits = to_mma_layout(values).view(torch.int32).reshape(3, 5, 3, 4)  # [.., block, word]
    for column in range(96):
        block, within = divmod(column, 32)
        for bit in range(4):
            word, position = divmod(mma_bit(within, bit), 32)
            held = (bits[..., block, word] >> position) & 1
            assert torch.equal(held, (codes[..., column] >> bit) & 1), (column, bit)
    assert sorted(mma_bit(c, b) for c in range(32) for b in range(4)) == list(range(128))


def test_round_trips_through_every_layout():
    weights = QuantizedTensor.quantize(torch.randn(2, 24, 64), "mxfp4")
    mma = weights.in_layout("mma")
    assert mma.layout == "mma" and mma.scales.stride(-2) == 1  # scales column-fastest, as pools hold them
    assert torch.equal(from_mma_layout(mma.values), weights.values)
    assert torch.equal(mma.in_layout("words").in_layout("mma").values, mma.values)
    assert torch.equal(mma.in_layout("checkpoint").values, weights.values)
    assert torch.equal(mma.dequantize(), weights.dequantize())
    assert torch.equal(mma.cat(mma).dequantize(), torch.cat([weights.dequantize()] * 2, -2))


def test_shapes_it_cannot_hold_are_refused():
    with pytest.raises(ValueError, match="multiple of 16"):
        to_mma_layout(torch.zeros(4, 8, dtype=torch.uint8))  # K = 16: not a whole 32-column block
    with pytest.raises(ValueError, match="'mma' for mxfp4"):
        QuantizedTensor.quantize(torch.randn(128, 128), "fp8").in_layout("mma")
