"""The planner benchmark end to end in its smoke mode (tiny shapes; CPU through the interpreter),
and its command line for the many-rank table."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatep.bench.planner import H200_COMMAND, PLANNERS, model_config, parse_args, sampled_ranks

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("policy", ["exact", "auto"])
def test_planner_benchmark_smoke_writes_rows(tmp_path, policy):
    out = tmp_path / "planner.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # auto plans six candidates, about a second per call under the interpreter: one step size.
    tokens = ["1", "8"] if policy == "exact" else ["8"]
    # A subprocess, so that its choice of interpreter cannot leak into other tests' kernels.
    result = subprocess.run(
        [sys.executable, "-m", "flatep.bench.planner", "--smoke", "--ranks", "2", "3", "--rank-sample", "2",
         "--tokens", *tokens, "--policy", policy, "--out", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    assert {row["planner"] for row in rows} == set(PLANNERS)
    assert len(rows) == 2 * len(tokens) * len(PLANNERS)  # R in {2, 3}, the step sizes, one sigma
    for row in rows:
        assert row["us_per_rank"] > 0 and row["policy"] == policy
        assert {"device", "torch", "triton", "command", "model", "ranks", "experts", "model_experts", "tokens",
                "sigma", "maxvio"} <= set(row)
        assert "--smoke" in row["command"]
        if row["planner"] in ("triton_rank_total", "triton_rank", "reference_rank"):
            assert row["ranks_timed"] == ([0, 1] if row["ranks"] == 2 else [0, 2])
    assert {row["ranks"] for row in rows} == {2, 3}
    assert "| tiny | 3 | 12 | 8 |" in result.stdout


def test_many_rank_command_line():
    """The documented H200 command parses to K2 and K3 at R in {8, 64, 256} and s in {128, 8192};
    R = 256 divides neither model's experts, so they are padded to a multiple of R."""
    args = parse_args(H200_COMMAND.split()[3:])
    assert args.models == ["kimi-k2", "kimi-k3"] and args.ranks == [8, 64, 256] and args.tokens == [128, 8192]
    assert args.out == "planner-ranks.json"
    assert [model_config("kimi-k2", r, 8192).experts for r in (8, 64, 256)] == [384, 384, 512]
    assert [model_config("kimi-k3", r, 8192).experts for r in (8, 64, 256)] == [896, 896, 1024]
    assert model_config("kimi-k3", 256, 8192).top_k == 16
    assert sampled_ranks(8, 8) == list(range(8))
    assert sampled_ranks(256, 8) == [0, 36, 73, 109, 146, 182, 219, 255]
    assert sampled_ranks(256, 1) == [0]
