"""`flatep bench` end to end on CPU with the tiny sweep."""
from __future__ import annotations

import json

import pytest

from flatep.bench.report import REQUIRED_FIELDS
from flatep.bench.sweep import Sweep, shipped_configs
from flatep.cli import main


def test_bench_runs_end_to_end_and_reports_from_results_alone(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2  # arms x tokens x maxvio
    for row in rows:
        missing = [name for name in REQUIRED_FIELDS if name not in row]
        assert not missing, missing
    flat = [r for r in rows if r["arm"] == "flat"]
    assert all(r["rows_max"] == r["tokens"] * 2 for r in flat)  # every rank computes s*K rows
    assert {r["arm"] for r in rows} == {"flat", "classic", "dense"}
    for name in ("summary.md", "layer_vs_maxvio.png", "breakdown.png", "layer_vs_tokens.png"):
        assert (out / name).stat().st_size > 0
    capsys.readouterr()

    report_dir = tmp_path / "report"
    assert main(["bench", "--report", str(out / "results.jsonl"), "--out", str(report_dir)]) == 0
    assert "| flat |" in capsys.readouterr().out
    assert (report_dir / "layer_vs_maxvio.png").read_bytes()[:4] == b"\x89PNG"

    # Resume: nothing left to do, the file keeps its rows.
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet", "--resume"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)


def test_shipped_configs_load():
    assert {"default", "kimi-k3", "cpu", "tiny"} <= set(shipped_configs())
    for name in shipped_configs():
        Sweep.load(name)


@pytest.mark.parametrize(
    "text, message",
    [
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [0]\nmaxvio: [0]\n", "tokens must be"),
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\narms: [fast]\n", "arms must be"),
        ("name: x\nmodel: llama\nranks: 8\ntokens: [1]\nmaxvio: [0]\n", "model must be one of"),
        ("name: x\nmodel: kimi-k2\nranks: 7\ntokens: [1]\nmaxvio: [0]\n", "divisible by ranks"),
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\ncolor: red\n", "unknown keys"),
    ],
)
def test_bad_sweep_configs_are_named(tmp_path, text, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        Sweep.load(str(path))


def test_unknown_config_is_a_one_line_error(capsys):
    assert main(["bench", "nonexistent", "--device", "cpu"]) == 2
    assert "one of" in capsys.readouterr().err
