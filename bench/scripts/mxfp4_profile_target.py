"""Profiling target: one Kimi-K3 rank's mxfp4 gate/up GEMM (112 experts, N = 6144, K = 3584) with the
default tiles at ``ROWS`` rows per expert (16: the 16-row tile, 32: the 32-row tile), called ``CALLS``
times (default 1). Random packed values and scale bytes 118-128 (the one-multiply pass computes
every tile; the second returns at once). ``COPIES=pointers`` takes the pointer copies (what
bench/results/2026-12-06-h100-d profiled), ``COPIES=tma`` (default) what the layer runs on Hopper,
the copies by tensor descriptor. Run under ``ncu`` by ``bench/scripts/mxfp4_profile.sh``.

    ROWS=16 COPIES=pointers python bench/scripts/mxfp4_profile_target.py
"""
from __future__ import annotations

import os

import torch

from flatep.kernels import quant_gemm
from flatep.kernels.packed_tiles import default_config
from flatep.kernels.quant_gemm import mxfp4_grouped_mm_triton

EXPERTS, COLUMNS, INNER = 112, 6144, 3584  # a Kimi-K3 rank's experts at R = 8, gate/up


def main() -> None:
    rows_per_expert = int(os.environ.get("ROWS", 16))
    copies = os.environ.get("COPIES", "tma")
    if copies not in ("tma", "pointers"):
        raise ValueError(f"COPIES must be tma or pointers, got {copies!r}")
    if copies == "pointers":
        quant_gemm._mxfp4_descriptors = lambda *operands: None
    torch.manual_seed(0)
    values = torch.randint(0, 256, (EXPERTS, COLUMNS, INNER // 2), dtype=torch.uint8, device="cuda")
    # Column-fastest scales, as pools hold them.
    scales = torch.randint(118, 129, (EXPERTS, INNER // 32, COLUMNS), dtype=torch.uint8, device="cuda").transpose(1, 2)
    rows = torch.randn(EXPERTS * rows_per_expert, INNER, device="cuda").to(torch.bfloat16)
    offsets = torch.arange(1, EXPERTS + 1, device="cuda", dtype=torch.int32) * rows_per_expert
    config = default_config(rows.shape[0], EXPERTS, "mxfp4")
    for _ in range(int(os.environ.get("CALLS", 1))):
        out = mxfp4_grouped_mm_triton(rows, values, scales, offsets, config)
    torch.cuda.synchronize()
    print(f"{rows_per_expert} rows per expert, {config.label}, {copies}: mean |out| "
          f"{out.float().abs().mean().item():.3f}")


if __name__ == "__main__":
    main()
