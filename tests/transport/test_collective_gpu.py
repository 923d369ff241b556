"""The collective transport with NCCL on one GPU: static splits read nothing back to the host.

NCCL refuses two ranks on one GPU, so this runs one process (a group of one: every exchange is
still an NCCL all-to-all) with ``torch.cuda.set_sync_debug_mode("error")``; the CPU tests check
2 and 4 gloo processes under :class:`tests.helpers.HostReadGuard`.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers import launch_workers

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_static_split_classic_steps_run_under_sync_debug_error_and_equal_the_local_transport(tmp_path):
    """Every classic case of the worker, bf16 and fp32 (fp32 experts run FlatEP's fp32 grouped GEMM on CUDA)."""
    output = launch_workers(
        "tests.transport.worker", 1,
        ["--backend", "nccl", "--init-method", f"file://{tmp_path}/store", "--transport", "collective",
         "--suite", "sync-free", "--size", "mid"],
        300,
    )
    assert output.count("ok  ") >= 14 and "FAIL" not in output and "PASSED" in output, output  # 7 bf16, 7 fp32
