"""`flatep bench` end to end on CPU with the tiny sweep."""
from __future__ import annotations

import json
import sys

import pytest
import torch

import flatep.bench.sweep as sweep_module
from flatep.bench.accounting import PHASES, entry_metadata_bytes
from flatep.bench.accounting import link_model_us
from flatep.bench.report import AUTO_SLACK, PLOTS_SKIPPED, REQUIRED_FIELDS, auto_vs_best, model_error_stats
from flatep.bench.sweep import Sweep, arm_policy, cells, shipped_configs
from flatep.cli import main
from flatep.plan.auto import CANDIDATES
from flatep.plan.cost import CostProfile


def test_bench_runs_end_to_end_and_reports_from_results_alone(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet"]) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 * 2 * 2  # arms x tokens x maxvio
    for row in rows:
        missing = [name for name in (*REQUIRED_FIELDS, "weights", "cost_profile") if name not in row]
        assert not missing, missing
    # Arms interleaved cell by cell: each (tokens, maxvio) point runs all its arms back to back.
    assert [r["arm"] for r in rows] == ["flat", "classic", "auto", "dense"] * 4
    assert [(r["tokens"], r["maxvio_target"]) for r in rows[::4]] == [(4, 0.0), (4, 2.0), (8, 0.0), (8, 2.0)]
    flat = [r for r in rows if r["arm"] == "flat"]
    assert all(r["rows_max"] == r["tokens"] * 2 for r in flat)  # every rank computes s*K rows
    assert {r["arm"] for r in rows} == {"flat", "classic", "auto", "dense"}
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
        ("name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\ngraph_calls: 0\n", "graph_calls must be"),
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


def test_the_ep_arms_phases_are_timed_interleaved_and_resume_runs_only_missing_arms(tmp_path, monkeypatch):
    """Planning, each rank's push and experts, and combine are timed with the EP arms of a cell in
    one interleaved call (the GPU's drift then hits them alike); dispatch arm by arm; a resumed cell
    runs only its missing arms, still together. The push is timed for the arms that push (not
    classic), each rank's received and lent parts apart."""
    interleaved: list[int] = []
    real = sweep_module.time_interleaved

    def recording(fns, *args, **kwargs):
        interleaved.append(len(fns))
        return real(fns, *args, **kwargs)

    monkeypatch.setattr(sweep_module, "time_interleaved", recording)
    out, rows = _tiny_rows(tmp_path)
    points, ranks = 4, 2
    # per point: plan, the push of each rank (received and lent, flat and auto), experts of each rank, combine
    per_point = [3] + [4] * ranks + [3] * ranks + [3]
    assert interleaved == per_point * points
    assert [row["arm"] for row in rows] == ["flat", "classic", "auto", "dense"] * points
    results = out / "results.jsonl"
    kept = [line for line in results.read_text().splitlines() if json.loads(line)["arm"] not in ("classic", "auto")]
    results.write_text("\n".join(kept) + "\n")
    interleaved.clear()
    _, rows = _tiny_rows(tmp_path, "--resume")
    assert interleaved == ([2] + [2] * ranks + [2] * ranks + [2]) * points
    assert sorted(row["arm"] for row in rows) == sorted(["flat", "classic", "auto", "dense"] * points)


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
        # The groups each rank computed: all of the step's entries, each rank's rows.
        groups = row["rank_groups"]
        assert sum(rows for rank in groups for _, rows in rank) == row["ranks"] * row["tokens"] * row["top_k"]
        assert max(sum(rows for _, rows in rank) for rank in groups) == row["rows_max"]
        # Dispatch and combine: each rank's share of one launch; push and experts: each rank's own.
        shared = row["plan_us"] + (row["dispatch_us"] + row["combine_us"]) / row["ranks"]
        pushes = row["push_us_by_rank"]
        assert row["push_us"] == max(pushes)
        if row["arm"] == "classic":
            assert pushes == [0.0] * row["ranks"]
        assert row["layer_us"] == pytest.approx(shared + max(p + e for p, e in zip(pushes, row["experts_us"])))
        with_link = [shared + row["experts_us"][r] + model["dispatch"][r] + model["combine"][r]
                     + max(pushes[r], model["push"][r]) for r in range(row["ranks"])]
        assert row["layer_with_link_model_us"] == pytest.approx(max(with_link))
        # Rows that stay local plus rows sent: one per token and destination rank (dedup), each
        # row H bf16 values, plus every entry's metadata; dispatch_bytes counts the busiest rank's rows.
        meta, row_bytes = entry_metadata_bytes(row["dedup"]), row["hidden"] * 2
        rows = []
        for rank in range(row["ranks"]):
            sent = link["dispatch"]["egress"][rank] + link["dispatch"]["local"][rank] - row["tokens"] * row["top_k"] * meta
            assert sent % row_bytes == 0 and row["tokens"] <= sent // row_bytes <= row["tokens"] * row["top_k"]
            rows.append(sent // row_bytes)
        assert row["dispatch_bytes"] == max(rows) * row_bytes
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


def test_a_whole_step_that_runs_out_of_memory_keeps_the_cell(tmp_path, monkeypatch):
    """The whole-step timing uses the layer's worst-case buffers; when they do not fit, the cell keeps
    its phase timings (shards sized to the step) and says why step_us is missing."""
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("pretend: the whole-step buffers do not fit")

    monkeypatch.setattr(sweep_module, "ep_moe", out_of_memory)
    _, rows = _tiny_rows(tmp_path)
    ep_rows = [row for row in rows if row["arm"] != "dense"]
    assert ep_rows and all(row["step_us"] is None and "out of memory" in row["step_note"] for row in ep_rows)
    assert all(row["layer_us"] > 0 and row["dispatch_us"] > 0 for row in ep_rows)


def test_the_summary_says_how_many_phase_copies_a_graph_held():
    from flatep.bench.report import _virtual_meaning

    first = dict(timing="cuda_graph", iters=10, link_gbps_model=370)
    assert "one phase per graph" in _virtual_meaning({**first, "graph_calls": 1})
    assert "4 copies of the phase back to back" in _virtual_meaning({**first, "graph_calls": 4})
    assert "copies" not in _virtual_meaning({**first, "timing": "eager", "graph_calls": 4})


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


# Balancing pays under this profile: compute is slow and everything else nearly free, so under skew
# auto leaves classic (the tie-break's first choice when nothing is gained).
CHEAP_MOVES = dict(link_gbps=1e6, hbm_gbps=1e6, gemm_tflops=1e-4, group_us=1e-3, push_us=1e-3, tile_rows=1, name="cheap-moves")


def _sweep_rows(tmp_path, text, *extra, out_name="out"):
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    out = tmp_path / out_name
    assert main(["bench", str(path), "--out", str(out), "--device", "cpu", "--quiet", *extra]) == 0
    return out, [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


# fp8 needs H and I multiples of 128; align 16 keeps the padded shards (and the CPU GEMMs) small.
SMALL = "name: s\nmodel: {hidden: 128, experts: 4, top_k: 2, intermediate: 128}\nranks: 2\nalign: 16\nwarmup: 0\niters: 1\n"


@pytest.mark.parametrize("profile", ["generic", "cheap-moves"])
def test_every_ep_row_carries_the_plan_choice_the_moves_and_the_model_error(tmp_path, profile):
    cost = "generic"
    if profile == "cheap-moves":
        cost = str(tmp_path / "cheap.json")
        CostProfile(**CHEAP_MOVES).save(cost)
    _, rows = _sweep_rows(tmp_path, SMALL + f"tokens: [16]\nmaxvio: [0, 1]\narms: [flat, classic, auto]\ncost: {cost}\n")
    labels = [candidate.label() for candidate in CANDIDATES]
    expected = CostProfile.preset("generic") if profile == "generic" else CostProfile(**CHEAP_MOVES)
    for row in rows:
        assert row["cost_profile"] == expected.to_dict() and row["weights"] == "bf16"
        assert row["plan_choice"] == {"flat": "exact", "classic": "classic"}.get(row["arm"], row["plan_choice"])
        assert row["plan_choice"] in labels
        # What the bench counts from the plan and what the model counts agree.
        assert row["experts_moved"] == row["model_experts_moved"] == row["borrowed_experts"]
        assert row["weight_bytes_moved"] == row["push_bytes"] == row["experts_moved"] * row["expert_bytes"]
        assert row["predicted_us"] == pytest.approx(max(row["predicted_rank_us"])) and row["predicted_us"] > 0
        # The measured counterpart: each rank's experts and push, measured, and its rows over the profile's link.
        link = link_model_us(row["link_bytes"], expected.link_gbps)
        terms = [e + p + d + c for e, p, d, c in zip(row["experts_us"], row["push_us_by_rank"], link["dispatch"], link["combine"])]
        assert row["measured_for_model_us"] == pytest.approx(max(terms))
        assert row["model_error"] == pytest.approx(row["predicted_us"] / row["measured_for_model_us"] - 1)
        # classic and auto shards are sized to the step (as classic's always were), flat's are not.
        assert row["shard_sized_to_step"] == (row["arm"] != "flat")
    for row in (r for r in rows if r["arm"] == "auto"):
        candidates = row["auto_candidates"]
        assert [c["choice"] for c in candidates] == labels
        best = min(c["predicted_us"] for c in candidates)
        chosen = next(c for c in candidates if c["predicted_us"] == best)  # ties go to the first
        assert row["plan_choice"] == chosen["choice"] and row["predicted_us"] == pytest.approx(best)
        assert row["experts_moved"] == chosen["experts_moved"] and row["plan_policy"] == "auto"
    skewed = next(r for r in rows if r["arm"] == "auto" and r["maxvio_target"] == 1)
    flat = next(r for r in rows if r["arm"] == "flat" and r["maxvio_target"] == 1)
    assert flat["experts_moved"] > 0
    if profile == "generic":  # a push's fixed 30 µs outweighs every row of this tiny shape
        assert skewed["plan_choice"] == "classic" and skewed["experts_moved"] == 0
    else:
        assert skewed["plan_choice"] != "classic" and skewed["experts_moved"] > 0


def _row(arm, tokens, target, layer, error=None, choice=None):
    return dict(model="m", arm=arm, tokens=tokens, maxvio_target=target, maxvio=target, layer_us=layer,
                layer_with_link_model_us=layer + 1, model_error=error, plan_choice=choice, experts_moved=0)


def test_auto_ratio_and_model_error_distribution():
    rows = [
        _row("flat", 1, 0.0, 10.0, 0.10), _row("classic", 1, 0.0, 8.0, -0.20), _row("auto", 1, 0.0, 8.2, 0.05, "classic"),
        _row("flat", 1, 5.0, 6.0, -0.40), _row("classic", 1, 5.0, 9.0, 0.15), _row("auto", 1, 5.0, 7.0, 0.0, "exact"),
        _row("dense", 1, 5.0, 1.0),
    ]
    cells = auto_vs_best(rows)
    assert [(c["choice"], c["best_arm"], c["ratio"]) for c in cells] == [
        ("classic", "classic", pytest.approx(8.2 / 8.0)), ("exact", "flat", pytest.approx(7.0 / 6.0))]
    assert sum(c["ratio"] <= AUTO_SLACK for c in cells) == 1
    stats = {entry["arm"]: entry for entry in model_error_stats(rows)}
    assert set(stats) == {"flat", "classic", "auto", "all"}
    assert stats["all"]["cells"] == 6 and stats["all"]["within"] == 4  # |-0.20| and |-0.40| fall outside
    assert stats["all"]["median"] == pytest.approx(0.025) and stats["all"]["worst"] == pytest.approx(-0.40)
    assert stats["flat"]["worst"] == pytest.approx(-0.40) and stats["classic"]["within"] == 1


def test_summary_shows_the_auto_ratio_and_the_model_error(tmp_path):
    out, rows = _tiny_rows(tmp_path)
    summary = (out / "summary.md").read_text()
    cells = auto_vs_best(rows)
    assert len(cells) == 4
    kept = sum(c["ratio"] <= AUTO_SLACK for c in cells)
    assert f"auto <= {AUTO_SLACK:g} x min(flat, classic) in **{kept} of 4** cells" in summary
    for cell in cells:
        assert f"| {cell['choice']} |" in summary and f"**{cell['ratio']:.2f}**" in summary
    assert "## Cost model error (profile `generic`)" in summary and "within ±15%" in summary
    stats = model_error_stats(rows)
    assert stats[-1]["arm"] == "all" and stats[-1]["cells"] == 12
    assert f"| all | 12 | {stats[-1]['within']} | {100 * stats[-1]['median']:+.1f}% |" in summary


@pytest.mark.parametrize("weights, expert_bytes", [
    # w13 [256, 128] + w2 [128, 128] in e4m3, one fp32 scale per 128x128 block (2 + 1).
    ("fp8", 256 * 128 + 128 * 128 + 3 * 4),
    # Two e2m1 per byte, one e8m0 scale byte per 32 inputs.
    ("mxfp4", (256 * 128 + 128 * 128) // 2 + (256 * 128 + 128 * 128) // 32),
])
def test_quantized_sweeps_push_the_packed_bytes(tmp_path, weights, expert_bytes):
    _, rows = _sweep_rows(tmp_path, SMALL + f"tokens: [8]\nmaxvio: [0, 1]\narms: [flat, classic, auto, dense]\nweights: {weights}\n")
    assert len(rows) == 8 and all(row["weights"] == weights for row in rows)
    assert any(row.get("borrowed_experts", 0) > 0 for row in rows)
    for row in rows:
        if row["arm"] == "dense":
            assert row["push_bytes"] == 0 and row["dense_us"] > 0
            continue
        assert row["expert_bytes"] == expert_bytes == row["model_expert_bytes"]
        assert row["push_bytes"] == expert_bytes * row["borrowed_experts"]
        assert max(row["link_bytes"]["push"]["ingress"]) <= row["push_bytes"]
        assert sum(row["link_bytes"]["push"]["egress"]) == row["push_bytes"]


@pytest.mark.parametrize("weights", ["fp8", "mxfp4"])
def test_the_dense_arm_computes_the_ep_layer_with_the_same_packed_weights(weights):
    import torch

    from flatep.bench.sweep import Cell, _random_weights, dense_step
    from flatep.layer import ep_moe
    from flatep.transport.local import LocalGroup

    sweep = Sweep(name="q", model={"hidden": 128, "experts": 4, "top_k": 2, "intermediate": 128}, ranks=2, tokens=[8],
                  maxvio=[1], align=16, weights=weights)
    config = sweep.ep_config(8)
    device = torch.device("cpu")
    pool, (w13, w2), shared = _random_weights(config, device, ["flat", "dense"], weights)
    assert not shared and w13.format == weights and pool.weights == weights
    cell = Cell(sweep, config, 8, 1.0, device)
    ep = ep_moe(cell.x, cell.ids, cell.weights, config=config, group=LocalGroup(2, device), policy="exact", pool=pool,
                backend="torch")
    dense = dense_step(cell.x.reshape(-1, 128), cell.ids.reshape(-1, 2), cell.weights.reshape(-1, 2), w13, w2, "torch")
    torch.testing.assert_close(ep.reshape(-1, 128).float(), dense.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("weights: fp16\n", "weights must be one of"),
        ("weights: [fp8]\n", "weights must be one of"),
        ("weights: fp8\nmodel: {hidden: 64, experts: 8, top_k: 2, intermediate: 32}\n", "weights: fp8 does not fit model"),
        ("dispatch: fp16\n", "dispatch must be one of"),
        ("dispatch: fp8\nmodel: {hidden: 30, experts: 8, top_k: 2, intermediate: 32}\n", "dispatch: fp8 does not fit model"),
        ("cost: h100\n", "cost: cost profile preset must be one of"),
        ("cost: missing.json\n", "cost: profile file 'missing.json' does not exist"),
        ("cost: 370\n", "cost must be a preset name"),
    ],
)
def test_bad_weights_or_cost_is_named(tmp_path, extra, message):
    path = tmp_path / "sweep.yaml"
    base = "name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\n"
    if "model:" in extra:
        base = base.replace("model: kimi-k2\n", "")
    path.write_text(base + extra)
    with pytest.raises(ValueError, match=message):
        Sweep.load(str(path))


def test_a_bad_cost_profile_file_is_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**CHEAP_MOVES, "push_us": -1}))
    path = tmp_path / "sweep.yaml"
    path.write_text(f"name: x\nmodel: kimi-k2\nranks: 8\ntokens: [1]\nmaxvio: [0]\ncost: {bad}\n")
    with pytest.raises(ValueError, match=r"cost: .*bad.json: CostProfile.push_us must be"):
        Sweep.load(str(path))


def test_weights_and_cost_options_override_the_config_and_are_part_of_the_resume_identity(tmp_path, capsys):
    out, rows = _tiny_rows(tmp_path, "--weights", "mxfp4", "--cost", "h200")
    assert {row["weights"] for row in rows} == {"mxfp4"}
    assert {row["cost_profile"]["name"] for row in rows} == {"h200"}
    assert "weights: mxfp4, cost profile: h200" in (out / "summary.md").read_text()
    capsys.readouterr()
    for extra, shown in ((["--weights", "mxfp4"], "cost_profile"), (["--cost", "h200"], "weights: 'mxfp4' there, 'bf16' now")):
        assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet", "--resume", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "another sweep config" in err and shown in err
    assert main(["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet", "--resume", "--weights", "fp8"]) == 2
    assert "weights: fp8 does not fit model" in capsys.readouterr().err


def test_the_pools_layout_is_recorded_and_part_of_the_resume_identity(tmp_path, capsys, monkeypatch):
    """Rows record the pools' byte layout (``mma`` where mxfp4 runs on fp8 activations), and a resumed
    sweep refuses to mix the two."""
    from flatep.quant import tensor

    out, rows = _tiny_rows(tmp_path, "--weights", "mxfp4")
    assert {row["layout"] for row in rows} == {"words"}
    capsys.readouterr()
    monkeypatch.setattr(tensor, "MXFP4_FP8_ACTIVATIONS", True)
    resumed = ["bench", "tiny", "--out", str(out), "--device", "cpu", "--quiet", "--resume", "--weights", "mxfp4"]
    assert main(resumed) == 2
    assert "layout: 'words' there, 'mma' now" in capsys.readouterr().err


def test_shipped_configs_run_the_formats_the_models_ship_in():
    assert Sweep.load("default").weights == "fp8" and Sweep.load("kimi-k3").weights == "mxfp4"
    for name in ("default", "kimi-k3", "cpu", "tiny"):
        assert "auto" in Sweep.load(name).arms


def test_fp8_dispatch_sweeps_count_packed_rows_out_and_bf16_rows_back(tmp_path, capsys):
    """``dispatch: fp8`` (or ``--dispatch fp8``): the same plans as bf16, with dispatch's rows
    ``H + 4*ceil(H/128)`` bytes instead of ``2H``; combine's rows stay bf16. fp8 experts, which
    read the packed rows as they arrive."""
    text = SMALL + "tokens: [8]\nmaxvio: [0, 2]\narms: [flat, classic]\ndedup: true\nweights: fp8\n"
    _, plain = _sweep_rows(tmp_path, text, out_name="bf16")
    out, packed = _sweep_rows(tmp_path, text, "--dispatch", "fp8", out_name="fp8")
    assert {row["dispatch"] for row in packed} == {"fp8"} and {row["dispatch"] for row in plain} == {"bf16"}
    assert "dispatch: fp8" in (out / "summary.md").read_text()
    meta = entry_metadata_bytes(True)
    for bf16_row, fp8_row in zip(plain, packed):
        assert (bf16_row["arm"], bf16_row["maxvio_target"]) == (fp8_row["arm"], fp8_row["maxvio_target"])
        assert fp8_row["dispatch_bytes"] * 2 * 128 == bf16_row["dispatch_bytes"] * (128 + 4)
        assert fp8_row["combine_bytes"] == bf16_row["combine_bytes"]
        assert fp8_row["link_bytes"]["combine"] == bf16_row["link_bytes"]["combine"]
        for side, back in (("egress", "ingress"), ("ingress", "egress")):
            for bf16_bytes, fp8_bytes, returned in zip(bf16_row["link_bytes"]["dispatch"][side],
                                                       fp8_row["link_bytes"]["dispatch"][side],
                                                       fp8_row["link_bytes"]["combine"][back]):
                rows = returned // (2 * 128)  # combine returns one bf16 row per row dispatch sent
                assert bf16_bytes - rows * 2 * 128 == fp8_bytes - rows * (128 + 4)  # the same metadata
                assert (fp8_bytes - rows * (128 + 4)) % meta == 0
    with pytest.raises(SystemExit):
        main(["bench", "tiny", "--out", str(tmp_path / "odd"), "--device", "cpu", "--quiet", "--dispatch", "fp16"])
    assert "--dispatch: invalid choice: 'fp16'" in capsys.readouterr().err
