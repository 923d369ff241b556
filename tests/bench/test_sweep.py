"""`flatep bench` end to end on CPU with the tiny sweep."""
from __future__ import annotations

import json
import sys

import pytest

import flatep.bench.sweep as sweep_module
from flatep.bench.accounting import PHASES
from flatep.bench.report import PLOTS_SKIPPED, REQUIRED_FIELDS
from flatep.bench.sweep import Sweep, arm_policy, cells, shipped_configs
from flatep.cli import main


def test_bench_runs_end_to_end_and_reports_from_results_alone(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 2 * 2  # arms x tokens x maxvio
    for row in rows:
        missing = [name for name in REQUIRED_FIELDS if name not in row]
        assert not missing, missing
    # Arms interleaved cell by cell: each (tokens, maxvio) point runs all its arms back to back.
    assert [r["arm"] for r in rows] == ["flat", "classic", "dense"] * 4
    assert [(r["tokens"], r["maxvio_target"]) for r in rows[::3]] == [(4, 0.0), (4, 2.0), (8, 0.0), (8, 2.0)]
    flat = [r for r in rows if r["arm"] == "flat"]
    assert all(r["rows_max"] == r["tokens"] * 2 for r in flat)  # every rank computes s*K rows
    assert {r["arm"] for r in rows} == {"flat", "classic", "dense"}
    for name in ("summary.md", "layer_vs_maxvio.png", "breakdown.png", "layer_vs_tokens.png"):
        assert (out / name).stat().st_size > 0
    printed = capsys.readouterr().out
    # The banner names the backend used; a CPU run shows no GPU ceilings, fractions or wording.
    assert printed.splitlines()[0].startswith("flatep bench: the 'tiny' sweep on CPU") and "kernels: torch" in printed.splitlines()[0]
    assert "GPU" not in printed.split("\n", 1)[1].replace("no GPU", "").replace("GPU figures", "")
    assert "TFLOP/s" not in printed and "GB/s (read+write)" not in printed
    for row in rows:
        assert row["backend"] == "torch" and row["copy_ceiling_gbps"] is None and row.get("experts_gemm_fraction") is None

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
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\narms: [flat, flat]\n", "arms must be distinct"),
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\niters: 0\n", "iters must be"),
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


def _tiny_rows(tmp_path, *extra):
    out = tmp_path / "out"
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet", *extra]) == 0
    return out, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def test_every_ep_row_has_per_rank_link_bytes_and_the_busiest_rank_model(tmp_path, capsys):
    _, rows = _tiny_rows(tmp_path)
    for row in rows:
        low, high = row["layer_us_spread"]
        assert low <= row["layer_us"] <= high
        if row["arm"] == "dense":
            continue
        for phase in ("plan_us", "dispatch_us", "push_us", "combine_us", "step_us"):
            assert row[f"{phase}_spread"][0] <= row[phase] <= row[f"{phase}_spread"][1]
        link, model = row["link_bytes"], row["link_model_us_per_rank"]
        gbps = row["link_gbps_model"]
        for phase in PHASES:
            expected = [max(out, into) / (gbps * 1e3) for out, into in zip(link[phase]["egress"], link[phase]["ingress"])]
            assert model[phase] == pytest.approx(expected)
        totals = [sum(model[phase][r] for phase in PHASES) for r in range(row["ranks"])]
        assert row["link_model_us"] == pytest.approx(max(totals))
        shared = row["layer_us"] - row["experts_us_max"]
        with_link = [shared + row["experts_us"][r] + totals[r] for r in range(row["ranks"])]
        assert row["layer_with_link_model_us"] == pytest.approx(max(with_link))
        # Rows that stay local plus rows sent equal every entry of the rank.
        entry = row["hidden"] * 2 + 4
        for rank in range(row["ranks"]):
            assert link["dispatch"]["egress"][rank] + link["dispatch"]["local"][rank] == row["tokens"] * row["top_k"] * entry
        if row["arm"] == "classic":
            assert row["plan_policy"] == "none" and link["push"]["egress"] == [0] * row["ranks"]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "(min-max)" in summary and "busiest rank" in summary and "share the CPU" in summary


def test_resume_into_the_folder_of_another_config_refuses(tmp_path, capsys):
    out, rows = _tiny_rows(tmp_path)
    other = tmp_path / "other.yaml"
    other.write_text((sweep_module.resources.files("flatep.bench") / "configs" / "tiny.yaml").read_text().replace("iters: 1", "iters: 2"))
    capsys.readouterr()
    assert main(["bench", str(other), "--out", str(out), "--device", "cpu", "--quiet", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another sweep config" in err and "iters: 1 there, 2 now" in err
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)


def test_bench_without_matplotlib_writes_the_summary_and_says_plots_were_skipped(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    out, _ = _tiny_rows(tmp_path)
    printed = capsys.readouterr().out
    assert PLOTS_SKIPPED in printed and (out / "summary.md").stat().st_size > 0
    assert not list(out.glob("*.png"))
    assert main(["bench", "--report", str(out / "results.jsonl")]) == 0
    assert PLOTS_SKIPPED in capsys.readouterr().out


def test_gpu_configs_time_at_least_ten_iterations():
    for name in ("default", "kimi-k3"):
        assert Sweep.load(name).iters >= 10


def test_arms_name_policies_so_new_policies_become_arms(tmp_path, monkeypatch):
    assert arm_policy("flat") == "exact" and arm_policy("classic") == "none" and arm_policy("dense") is None
    assert arm_policy("exact") == "exact"
    # A policy the planner gains (here pretended) is an arm by its own name, no other change needed.
    monkeypatch.setattr(sweep_module, "POLICIES", ("exact", "none", "auto"))
    assert arm_policy("auto") == "auto"
    path = tmp_path / "auto.yaml"
    path.write_text("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\narms: [flat, classic, auto]\n")
    sweep = Sweep.load(str(path))
    assert [arm for arm, _, _ in cells(sweep)] == ["flat", "classic", "auto"]


def test_an_arm_named_by_its_policy_runs(tmp_path, capsys):
    path = tmp_path / "policy-arm.yaml"
    path.write_text("name: p\nmodel: {hidden: 64, experts: 8, top_k: 2, intermediate: 32}\nranks: 2\ntokens: [4]\n"
                    "maxvio: [2]\narms: [exact]\nwarmup: 0\niters: 1\n")
    out = tmp_path / "out"
    assert main(["bench", str(path), "--out", str(out), "--device", "cpu", "--quiet"]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert row["arm"] == "exact" and row["plan_policy"] == "exact" and row["rows_max"] == 8
