"""`torchrun -m flatep.bench.distributed`: 2 processes, then the report.

On a host with fewer GPUs than processes (CI, one H200) the benchmark runs on the CPU with gloo
(NCCL refuses two processes on one GPU); with two GPUs or more it runs on them with NCCL.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from flatep.bench.accounting import entry_metadata_bytes
from flatep.bench.report import REQUIRED_FIELDS, write_report
from tests.helpers import launch_workers


def test_two_processes_write_results_for_every_arm(tmp_path):
    out = tmp_path / "out"
    launch_workers(
        "flatep.bench.distributed", 2,
        ["--init-method", f"file://{tmp_path}/store", "--model", "64,8,2,32", "--tokens", "8", "--maxvio", "0", "2",
         "--warmup", "0", "--iters", "1", "--link-gbps", "100", "--out", str(out)],
        timeout=240,
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 3 and {row["arm"] for row in rows} == {"flat", "classic", "a2a"}
    for row in rows:
        assert not [name for name in REQUIRED_FIELDS if name not in row]
        assert len(row["per_rank"]) == 2
        if torch.cuda.device_count() < 2:
            assert row["transport"] == "CollectiveGroup" and row["device"].startswith("CPU")
        assert row["dispatch_us"] == max(rank["dispatch_us"] for rank in row["per_rank"])
    assert all(row["rows_max"] == 8 * 2 for row in rows if row["arm"] == "flat")
    for row in rows:
        if row["arm"] == "a2a":
            continue
        link = row["link_bytes"]
        # What one rank sends over the link another receives; every entry is sent or stays local.
        for phase in ("dispatch", "combine", "push"):
            assert sum(link[phase]["egress"]) == sum(link[phase]["ingress"])
        # Each rank's rows (one per entry: dedup is off by default) and every entry's metadata
        # (its route weight).
        sent = [rank["sent_rows"] for rank in row["per_rank"]]
        assert sent == [8 * 2, 8 * 2]  # 8 tokens, K = 2
        assert [out + local for out, local in zip(link["dispatch"]["egress"], link["dispatch"]["local"])] == [
            rows * 64 * 2 + 8 * 2 * entry_metadata_bytes(False) for rows in sent]
        assert row["dispatch_bytes"] == max(sent) * 64 * 2
        totals = [sum(max(link[p]["egress"][r], link[p]["ingress"][r]) for p in ("dispatch", "combine", "push")) / 1e5 for r in range(2)]
        assert row["link_model_us"] == pytest.approx(max(totals))
    paths = write_report(rows, tmp_path / "report")
    assert "processes" in paths[0].read_text()


@pytest.mark.parametrize("dispatch, row_bytes", [("bf16", 64 * 2), ("fp8", 64 + 4)])  # fp8: H values, one fp32 scale
def test_static_splits_count_the_fixed_size_messages(tmp_path, dispatch, row_bytes):
    out = tmp_path / "out"
    launch_workers(
        "flatep.bench.distributed", 2,
        ["--init-method", f"file://{tmp_path}/store", "--model", "64,8,2,32", "--tokens", "8", "--maxvio", "0",
         "--arms", "classic", "flat", "--warmup", "0", "--iters", "1", "--transport", "collective", "--device", "cpu",
         "--static-splits", "--dispatch", dispatch, "--out", str(out)],
        timeout=240,
    )
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["static_splits"] and row["dispatch"] == dispatch for row in rows)
    # Per peer: every entry's metadata (8 tokens x K = 2) and, without dedup, every entry's row;
    # combine returns bf16 rows.
    dispatch, combine = 8 * 2 * (entry_metadata_bytes(False) + row_bytes), 8 * 2 * 64 * 2
    for row in rows:
        link = row["link_bytes"]
        assert link["dispatch"]["egress"] == link["dispatch"]["ingress"] == [dispatch, dispatch]
        assert link["combine"]["egress"] == link["combine"]["local"] == [combine, combine]


def test_python_m_flatep_bench_names_both_commands():
    done = subprocess.run([sys.executable, "-m", "flatep.bench"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "flatep bench" in done.stderr and "-m flatep.bench.distributed" in done.stderr
