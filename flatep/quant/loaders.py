"""Expert weights from checkpoint tensors as stored, into FlatEP's layout (``w13 [E, 2I, H]``: gate
rows then up rows; ``w2 [E, H, I]``), kept packed.

- DeepSeek-V3 / Kimi-K2 (FP8): per expert ``gate_proj.weight [I, H]``, ``up_proj.weight [I, H]``,
  ``down_proj.weight [H, I]`` float8_e4m3fn, each with ``weight_scale_inv`` float32 of shape
  ``[ceil(rows/128), ceil(cols/128)]``. Stack the experts (``torch.stack``) before calling
  :func:`fp8_experts_from_checkpoint`.
- gpt-oss (MXFP4): ``gate_up_proj_blocks [E, 2I, H/32, 16]`` and ``gate_up_proj_scales [E, 2I, H/32]``
  with gate and up rows *interleaved* (gate even rows, up odd rows), ``down_proj_blocks
  [E, H, I/32, 16]``, ``down_proj_scales [E, H, I/32]``, all uint8. Its biases
  (``gate_up_proj_bias [E, 2I]``) interleave alike: :func:`deinterleave_gate_up` reorders them.
"""
from __future__ import annotations

import torch

from flatep.quant.mxfp4 import mxfp4_from_checkpoint
from flatep.quant.tensor import QuantizedTensor


def fp8_experts_from_checkpoint(
    gate: torch.Tensor,
    gate_scale_inv: torch.Tensor,
    up: torch.Tensor,
    up_scale_inv: torch.Tensor,
    down: torch.Tensor,
    down_scale_inv: torch.Tensor,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(w13, w2)`` from stacked DeepSeek-V3-style tensors.

    Args:
        gate, up: ``[E, I, H]`` float8_e4m3fn; ``I`` a multiple of 128.
        gate_scale_inv, up_scale_inv: ``[E, ceil(I/128), ceil(H/128)]`` float32.
        down: ``[E, H, I]`` float8_e4m3fn; down_scale_inv: ``[E, ceil(H/128), ceil(I/128)]`` float32.

    Returns:
        ``w13`` fp8 ``[E, 2I, H]`` and ``w2`` fp8 ``[E, H, I]`` (scales beside them).
    """
    w13 = QuantizedTensor("fp8", gate, gate_scale_inv).cat(QuantizedTensor("fp8", up, up_scale_inv))
    return w13, QuantizedTensor("fp8", down.contiguous(), down_scale_inv.contiguous())


def deinterleave_gate_up(tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Reorder gpt-oss's interleaved gate/up entries along ``dim`` (gate even, up odd) to gate then up."""
    if tensor.shape[dim] % 2:
        raise ValueError(f"interleaved gate/up dimension {dim} must have even size, got {tensor.shape[dim]}")
    index = torch.arange(tensor.shape[dim], device=tensor.device)
    order = torch.cat([index[0::2], index[1::2]])
    return tensor.index_select(dim, order)


def mxfp4_experts_from_checkpoint(
    gate_up_blocks: torch.Tensor,
    gate_up_scales: torch.Tensor,
    down_blocks: torch.Tensor,
    down_scales: torch.Tensor,
    interleaved: bool = True,
) -> tuple[QuantizedTensor, QuantizedTensor]:
    """``(w13, w2)`` from gpt-oss-style MXFP4 tensors.

    Args:
        gate_up_blocks: ``[E, 2I, H/32, 16]`` (or ``[E, 2I, H/2]``) uint8; gate_up_scales: ``[E, 2I, H/32]`` uint8.
        down_blocks: ``[E, H, I/32, 16]`` (or ``[E, H, I/2]``) uint8; down_scales: ``[E, H, I/32]`` uint8.
        interleaved: gate and up rows alternate (gpt-oss); ``False`` for gate rows then up rows.

    Returns:
        ``w13`` mxfp4 ``[E, 2I, H]`` (gate rows then up rows) and ``w2`` mxfp4 ``[E, H, I]``.
    """
    values13, scales13 = mxfp4_from_checkpoint(gate_up_blocks, gate_up_scales)
    if values13.dim() != 3:
        raise ValueError(f"gate_up_blocks must be stacked over experts, [E, 2I, H/32, 16], got {list(gate_up_blocks.shape)}")
    if interleaved:
        values13, scales13 = deinterleave_gate_up(values13), deinterleave_gate_up(scales13)
    return QuantizedTensor("mxfp4", values13, scales13), QuantizedTensor("mxfp4", *mxfp4_from_checkpoint(down_blocks, down_scales))
