"""Triton kernels (dispatch, combine, weight push, the experts' row-bounded steps, packed grouped GEMMs) and their plain-torch counterparts."""
from flatep.kernels.activation import copy_rows_triton, swiglu_weighted_torch, swiglu_weighted_triton
from flatep.kernels.backend import BACKENDS, use_triton
from flatep.kernels.combine import combine_torch, combine_triton
from flatep.kernels.dispatch import dispatch_torch, dispatch_triton
from flatep.kernels.mxfp4_dequant import dequantize_mxfp4_triton, mxfp4_grouped_mm_bf16
from flatep.kernels.push import push_torch, push_triton
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.packed_tiles import GemmConfig
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton, mxfp4_grouped_mm_triton

__all__ = [
    "BACKENDS",
    "GemmConfig",
    "combine_torch",
    "combine_triton",
    "copy_rows_triton",
    "dequantize_mxfp4_triton",
    "dispatch_torch",
    "dispatch_triton",
    "fp8_grouped_mm_triton",
    "mxfp4_grouped_mm_bf16",
    "mxfp4_grouped_mm_triton",
    "push_torch",
    "push_triton",
    "quantize_fp8_activations_triton",
    "swiglu_weighted_torch",
    "swiglu_weighted_triton",
    "use_triton",
]
