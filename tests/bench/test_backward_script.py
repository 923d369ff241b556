"""``bench/scripts/backward_h200.py --tiny``: the H200 backward script's checks and timing cells on a CPU."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "scripts" / "backward_h200.py"


def test_tiny_run_checks_gradients_and_times_both_policies_at_every_cell(tmp_path):
    spec = importlib.util.spec_from_file_location("backward_h200", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--tiny", "--iters", "1", "--out", str(tmp_path)]) == 0  # 0: the gradients passed
    result = json.loads((tmp_path / "backward_h200.json").read_text())
    assert result["check"]["passed"] and max(result["check"]["relative_error"].values()) < result["check"]["tolerance"]
    cells = {(cell["tokens"], cell["maxvio_target"], cell["policy"]): cell for cell in result["timing"]}
    # Every (s, maxvio) cell ran under both policies; classic's shards sized to the step fit wherever flat's do.
    assert len(cells) == len(result["tokens"]) * len(script.MAXVIO) * 2
    assert all(cell["status"] == "ok" and cell["median_ms"] > 0 for cell in cells.values()), cells
    assert "| classic / flat |" in (tmp_path / "backward_h200.md").read_text()
