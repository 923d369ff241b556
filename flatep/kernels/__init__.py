"""Triton kernels (dispatch, combine, weight push) and their plain-torch counterparts."""
from flatep.kernels.backend import BACKENDS, use_triton
from flatep.kernels.combine import combine_torch, combine_triton
from flatep.kernels.dispatch import dispatch_torch, dispatch_triton
from flatep.kernels.push import push_torch, push_triton

__all__ = [
    "BACKENDS",
    "combine_torch",
    "combine_triton",
    "dispatch_torch",
    "dispatch_triton",
    "push_torch",
    "push_triton",
    "use_triton",
]
