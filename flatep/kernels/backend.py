"""Choosing between the Triton kernels and their plain-torch counterparts."""
from __future__ import annotations

import os

import torch
import triton

BACKENDS = ("auto", "triton", "torch")


def interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(device: torch.device, backend: str = "auto") -> bool:
    """Whether to run the Triton kernels on ``device``.

    ``auto`` picks Triton on CUDA, and on CPU only under ``TRITON_INTERPRET=1``; ``triton`` forces
    it (an error on CPU without the interpreter); ``torch`` forces the plain-torch paths.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    available = device.type == "cuda" or (device.type == "cpu" and interpreting())
    if backend == "triton" and not available:
        raise ValueError(
            f"backend='triton' needs a CUDA device or TRITON_INTERPRET=1 on CPU, got device {device}"
        )
    return available


def column_block(columns: int, element_size: int) -> int:
    """Columns one program step moves per row: 2 KiB (16-byte vectors per thread), fewer for narrow rows.

    2 KiB chunks keep registers modest with several rows in flight (measured on the H200 with
    ``python -m flatep.bench.kernels``).
    """
    return min(triton.next_power_of_2(columns), 2048 // element_size)
