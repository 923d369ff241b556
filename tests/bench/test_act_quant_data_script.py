"""``bench/scripts/act_quant_data.py`` on the CPU (under the interpreter, a small hidden size): every
data set timed in every arm, the tree's kernel equal to torch's quantization on each."""
from __future__ import annotations

import importlib
import json
import sys

import pytest

from flatep.kernels.backend import interpreting
from tests.bench.conftest import SCRIPTS


@pytest.mark.skipif(not interpreting(), reason="runs the script's kernels under TRITON_INTERPRET=1")
def test_every_data_set_runs_every_arm_and_the_kernel_equals_torch(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    script = importlib.import_module("act_quant_data")
    monkeypatch.setattr(script, "HIDDEN", 256)
    out = tmp_path / "act_quant_data.json"
    monkeypatch.setattr(sys, "argv", ["act_quant_data.py", "--rows", "20", "--out", str(out)])
    script.main()
    rows = json.loads(out.read_text())["results"]
    assert [row["data"] for row in rows] == ["randn", "randn x 1e-19", "randn, 10% zeros", "zeros",
                                             "randn, 3% NaN rows"]
    assert all(row["same"] and set(row["us"]) == {"kernel", "div_rn for every value", "approximate division"}
               and min(row["us"].values()) > 0 for row in rows)
