"""``bench/scripts/ncu_stalls.py``: the warp-stall summary of an ncu source-page export."""
from __future__ import annotations

import csv
import gzip
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "ncu_stalls.py"


def _reasons() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("ncu_stalls", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script.REASONS


def test_each_reason_gets_its_share_of_all_samples_and_its_busiest_instructions(tmp_path):
    reasons = _reasons()
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", *(f"stall_{reason}" for reason in reasons)]
    # Two instructions: 30 samples waiting on a shared-memory load, 10 issuing; 40 in all.
    load = {"short_sb": 30}
    multiply = {"selected": 6, "wait": 4}
    rows = [[address, source, str(sum(counts.values())), *(str(counts.get(reason, "")) for reason in reasons)]
            for address, source, counts in (("0x10", "LDS.128 R28, [R44]", load), ("0x20", "HMUL2 R1, R2, R3", multiply))]
    export = tmp_path / "source.csv.gz"
    with gzip.open(export, "wt", newline="") as file:
        writer = csv.writer(file)
        writer.writerows([["Kernel Name", "_mxfp4_grouped_kernel"], header, *rows])
    out = subprocess.run([sys.executable, str(SCRIPT), str(export)], capture_output=True, text=True, check=True).stdout
    lines = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ")}
    assert out.startswith("2 instructions, 40 samples")
    assert "| 75.0% | `LDS.128 R28, [R44]` 75.0% |" in lines["short_sb"]
    assert "| 15.0% | `HMUL2 R1, R2, R3` 15.0% |" in lines["selected"]
    assert "| 10.0% |" in lines["wait"] and "| 0.0% |" in lines["barrier"]
