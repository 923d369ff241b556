"""Two gloo processes, one EP rank each: tiny transformers models sharded over the collective transport
generate the unsharded model's greedy tokens on every rank (fp32, CPU)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from flatep.integrations.tiny_models import TINY_FAMILIES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
WORKER_TIMEOUT = 240
WORLD = 2


def test_two_gloo_processes_generate_the_unsharded_tokens(tmp_path):
    env = {**os.environ, "WORLD_SIZE": str(WORLD), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "tests.integrations.worker", "--init-method", f"file://{tmp_path}/store"]
    workers = [
        subprocess.Popen(command, cwd=ROOT, env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
        for rank in range(WORLD)
    ]
    logs = []
    try:
        for worker in workers:
            logs.append(worker.communicate(timeout=WORKER_TIMEOUT)[0])
    except subprocess.TimeoutExpired:
        for worker in workers:
            worker.kill()
        pytest.fail(f"{WORLD} workers did not finish within {WORKER_TIMEOUT} s:\n" + "\n".join(logs))
    output = "\n".join(logs)
    assert all(worker.returncode == 0 for worker in workers), output
    results = re.findall(r"RESULT rank=(\d) family=(\S+) policy=(\S+) tokens_equal=True .* maxvio=(\[.*\])", output)
    assert len(results) == WORLD * (len(TINY_FAMILIES) + 1), output
    for family in TINY_FAMILIES:  # the group-wide histogram is the same on every rank
        assert len({maxvio for _, name, policy, maxvio in results if (name, policy) == (family, "exact")}) == 1, output
