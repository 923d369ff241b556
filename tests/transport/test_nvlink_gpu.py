"""On one GPU shared by 2 processes: the NVLink transport's step has no host sync, captures in one CUDA graph
with two layers, a dead rank still raises (through ``group.check()`` after a replay), its backward
equals the local transport's, and so do random steps."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import launch_workers

# xdist_group: these files take tens of GB of GPU memory each; they run one at a time (tests/gpu_memory.py).
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.xdist_group("gpu-memory"),
]


@pytest.fixture
def shared_gpu(monkeypatch):
    monkeypatch.setenv("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")


@pytest.mark.parametrize("suite", ["graph", "graph-fp8"])
def test_two_layer_step_is_sync_free_and_replays_bit_identically(shared_gpu, tmp_path, suite):
    """``graph-fp8``: the same with fp8 dispatch (packed rows through the symmetric buffers)."""
    output = launch_workers("tests.transport.graph_worker", 2, [f"file://{tmp_path}/store", suite], 600)
    assert output.count("PASSED") == 2, output


def test_dead_rank_raises_through_check_after_a_replay(shared_gpu, tmp_path):
    output = launch_workers("tests.transport.graph_worker", 2, [f"file://{tmp_path}/store", "dead-rank"], 300)
    assert "TimeoutError after replay" in output and output.count("PASSED") == 1, output


def test_prefetched_push_into_a_second_slot_set_is_bit_identical(shared_gpu, tmp_path):
    output = launch_workers("tests.transport.graph_worker", 2, [f"file://{tmp_path}/store", "prefetch"], 600)
    assert output.count("PASSED") == 2, output


def test_backward_equals_the_local_transports_gradients_bit_for_bit(shared_gpu, tmp_path):
    """ep_moe and EPMoE with grad over NVLink: gradients of x, topk_weights, w13, w2 (and biases) equal the
    local transport's bit for bit (tests/transport/nvlink_backward_worker.py)."""
    output = launch_workers("tests.transport.nvlink_backward_worker", 2, [f"file://{tmp_path}/store"], 600)
    assert output.count("PASSED") == 2, output


@pytest.mark.parametrize("steps, formats", [(40, ["bf16", "fp32"]), (16, ["fp8", "mxfp4"])])
def test_random_steps_equal_the_local_transport(shared_gpu, tmp_path, steps, formats):
    """The worker's random suite (policies, skew, per-rank token counts, dedup, fp8 dispatch) on the
    NVLink transport: each rank's real rows bit-equal to the local transport's on the same GPU, for
    unpacked and for packed weights (each process's packed GEMMs against the local transport's)."""
    arguments = ["--transport", "nvlink", "--backend", "gloo", "--init-method", f"file://{tmp_path}/store", "--suite",
                 "random", "--steps", str(steps), "--formats", *formats]
    output = launch_workers("tests.transport.worker", 2, arguments, 600)
    assert output.count(f"{steps} of {steps} random steps bit-equal to the local transport") == 2, output
