"""Expert weights (pools with borrow slots, in bf16, fp8 or mxfp4) and their computation."""
from flatep.experts.dense import dense_moe
from flatep.experts.grouped import ClampedSwiGLU, grouped_swiglu, quantized_grouped_mm, swiglu
from flatep.experts.pool import ExpertPool, check_expert_weights

__all__ = [
    "ClampedSwiGLU",
    "ExpertPool",
    "check_expert_weights",
    "dense_moe",
    "grouped_swiglu",
    "quantized_grouped_mm",
    "swiglu",
]
