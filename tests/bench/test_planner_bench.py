"""The planner benchmark end to end in its smoke mode (a tiny shape; CPU through the interpreter)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_planner_benchmark_smoke_writes_rows(tmp_path):
    out = tmp_path / "planner.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    # A subprocess, so that its choice of interpreter cannot leak into other tests' kernels.
    result = subprocess.run(
        [sys.executable, "-m", "flatep.bench.planner", "--smoke", "--out", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(out.read_text())
    planners = {"triton_rank", "triton_group", "reference_rank", "reference_group"}
    assert {row["planner"] for row in rows} == planners
    assert len(rows) == 2 * len(planners)  # s in {1, 8}, one sigma
    for row in rows:
        assert row["us_per_rank"] > 0
        assert {"device", "torch", "triton", "command", "model", "tokens", "sigma", "maxvio"} <= set(row)
        assert "--smoke" in row["command"]
    assert "| tiny | 8 |" in result.stdout
