"""Weight formats: packing, unpacking and checkpoint loaders (bf16, fp8 block-scaled, mxfp4)."""
from flatep.quant.fp8 import (
    E4M3_MAX,
    FP8_BLOCK,
    check_fp8_block,
    dequantize_fp8_activations,
    dequantize_fp8_block,
    quantize_fp8_activations,
    quantize_fp8_block,
    to_e4m3,
)
from flatep.quant.loaders import deinterleave_gate_up, fp8_experts_from_checkpoint, mxfp4_experts_from_checkpoint
from flatep.quant.mxfp4 import (
    E2M1_VALUES,
    MX_BLOCK,
    check_mxfp4,
    dequantize_mxfp4,
    e2m1_decode,
    e2m1_encode,
    mxfp4_from_checkpoint,
    quantize_mxfp4,
)
from flatep.quant.tensor import (
    QUANTIZED_FORMATS,
    WEIGHT_FORMATS,
    QuantizedTensor,
    check_format,
    check_pool_dims,
    packed_layout,
)

__all__ = [
    "E2M1_VALUES",
    "E4M3_MAX",
    "FP8_BLOCK",
    "MX_BLOCK",
    "QUANTIZED_FORMATS",
    "QuantizedTensor",
    "WEIGHT_FORMATS",
    "check_format",
    "check_fp8_block",
    "check_mxfp4",
    "check_pool_dims",
    "deinterleave_gate_up",
    "dequantize_fp8_activations",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "e2m1_decode",
    "e2m1_encode",
    "fp8_experts_from_checkpoint",
    "mxfp4_experts_from_checkpoint",
    "mxfp4_from_checkpoint",
    "packed_layout",
    "quantize_fp8_activations",
    "quantize_fp8_block",
    "quantize_mxfp4",
    "to_e4m3",
]
