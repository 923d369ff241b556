"""Summary table and plots of a sweep, made from ``results.jsonl`` alone."""
from __future__ import annotations

import importlib.util
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

ARM_STYLE = {"flat": ("tab:blue", "o"), "classic": ("tab:red", "s"), "dense": ("tab:gray", "^"), "a2a": ("tab:green", "v"),
             "auto": ("tab:purple", "D"), "bounded": ("tab:orange", "P")}
"""Colour and marker of each arm in the plots; an arm not listed is drawn in the next default colour."""


def _arm_styles(rows: list[dict[str, Any]]) -> list[tuple[str, tuple[str | None, str]]]:
    """``(arm, (colour, marker))`` of every arm in ``rows``, in the order they first appear."""
    arms = list(dict.fromkeys(row["arm"] for row in rows))
    return [(arm, ARM_STYLE.get(arm, (None, "x"))) for arm in arms]
PHASES = ("plan_us", "dispatch_us", "push_us", "experts_us_max", "combine_us")
AUTO_SLACK = 1.03
"""``auto`` counts as keeping up in a cell when its time is at most this times min(flat, classic)."""
MODEL_BAND = 0.15
"""The model error band the summary counts cells inside (``|predicted/measured - 1| <= 0.15``)."""


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def flatness(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (model, arm, tokens): layer time at the largest maxvio over its time at maxvio 0."""
    groups: dict[tuple, dict[float, float]] = defaultdict(dict)
    for row in rows:
        groups[(row["model"], row["arm"], row["tokens"])][row["maxvio_target"]] = row["layer_us"]
    out = []
    for (model, arm, tokens), by_target in sorted(groups.items()):
        if 0.0 not in by_target or len(by_target) < 2:
            continue
        ratios = {target: us / by_target[0.0] for target, us in sorted(by_target.items())}
        out.append({"model": model, "arm": arm, "tokens": tokens, "ratio_vs_maxvio0": ratios})
    return out


def _spread(row: dict[str, Any], name: str) -> str:
    """``median (min-max)`` of a timed field, or the median alone when no spread was recorded."""
    spread = row.get(f"{name}_spread")
    if not spread:
        return _fmt(row.get(name))
    return f"{_fmt(row[name])} ({_fmt(spread[0])}-{_fmt(spread[1])})"


def _ceilings(first: dict[str, Any]) -> str:
    if first.get("copy_ceiling_gbps") is None:
        return ("No ceilings on the CPU: the copy% and GEMM% fractions are GPU figures, not reported here; "
                "times are CPU times of the plain-torch paths, and planning is the host reference planner "
                "(in Python: `auto` there plans each candidate that would move rows, so its plan time "
                "is several classic ones; the Triton planner plans them in one pass).")
    read = f", device read {first['read_ceiling_gbps']:.0f} GB/s" if first.get("read_ceiling_gbps") else ""
    return (f"Ceilings measured in this run: device copy {first['copy_ceiling_gbps']:.0f} GB/s (read+write), "
            f"dense bf16 GEMM {first['gemm_ceiling_tflops']:.0f} TFLOP/s{read}.")


def _calls_meaning(first: dict[str, Any]) -> str:
    calls = first.get("graph_calls") or 1
    if calls == 1:
        return " (one phase per graph: each time includes a replay's fixed cost)"
    return f" ({calls} copies of the phase back to back in one graph, time per copy)"


def _virtual_meaning(first: dict[str, Any]) -> str:
    on_gpu = first.get("timing") == "cuda_graph"
    where = "one GPU" if on_gpu else "the CPU"
    return (
        f"Times in µs: median over {first.get('iters', '?')} timed iterations, (min-max) beside it"
        f"{', every phase timed as CUDA-graph replays' if on_gpu else ''}"
        f"{_calls_meaning(first) if on_gpu else ''}; the arms of a cell ran back to back. "
        "A difference inside the spread is not a result. `layer` = slowest-rank layer time: planning + the "
        "per-rank share of the dispatch and combine launches (each covers all R virtual ranks) + the largest "
        "over ranks of the rank's own push (the slower of the part it receives and the part it lends, each "
        "timed alone; none under classic, which launches no push) and its experts; `push` = the busiest rank's "
        "push. The spread adds the phases' minima (maxima). `dense` = one device computing "
        f"all tokens, shown as its per-rank share (total / R). The R virtual ranks share {where}: link time "
        "is not measured. `link model` (a model, not a measurement) = per rank and phase (dispatch, push, "
        "combine), max(bytes the rank sends, bytes it receives over the link) / "
        f"{first.get('link_gbps_model')} GB/s, summed over phases, for the busiest rank; rows that stay on "
        "their rank are not counted; a push is paid by its donor. `layer + link` = the largest over ranks "
        "of the layer with that rank's experts and modelled dispatch and combine link time, its push "
        "taking the slower of the copy measured and the modelled link time. Bytes: dispatch = logical, the busiest "
        "rank's rows x H x 2 (s*K rows per rank without dedup, one per token and destination rank with it); "
        "push = expert-weight bytes moved in all; egress/ingress max = the busiest rank's link bytes in dispatch "
        "and push (combine mirrors dispatch's rows, without their per-entry metadata); `disp + comb per rank` = "
        "(dispatch + combine) / R, a rank's share of the launches"
        + ("; copy% = dispatch/combine kernels' bytes read+written over the copy ceiling; GEMM% = slowest "
           "rank's expert TFLOP/s over the ceiling; read% = the weights of the slowest rank's experts that hold "
           "rows (GB, read once) over its experts time, as a fraction of the read ceiling." if on_gpu else ".")
    )


def _mb(value: Any) -> str:
    return "-" if value is None else f"{value / 1e6:.3g}"


def _link_cells(row: dict[str, Any]) -> str:
    link = row.get("link_bytes")
    if not link:
        return "- | -"
    dispatch = f"{_mb(max(link['dispatch']['egress']))}/{_mb(max(link['dispatch']['ingress']))}"
    push = f"{_mb(max(link['push']['egress']))}/{_mb(max(link['push']['ingress']))}"
    return f"{dispatch} | {push}"


def auto_vs_best(rows: list[dict[str, Any]], field: str = "layer_us") -> list[dict[str, Any]]:
    """Per (model, tokens, maxvio target) cell with ``auto``, ``flat`` and ``classic`` rows: auto's
    choice and its ``field`` (µs) over the smaller of flat's and classic's in the same run.

    Returns:
        ``[{"model", "tokens", "maxvio", "maxvio_target", "choice", "experts_moved", "auto_us",
        "best_arm", "best_us", "ratio"}]`` sorted by model, tokens and target.
    """
    by_cell: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for row in rows:
        by_cell[(row["model"], row["tokens"], row["maxvio_target"])][row["arm"]] = row
    out = []
    for (model, tokens, target), arms in sorted(by_cell.items()):
        if not {"auto", "flat", "classic"} <= set(arms) or any(arms[a].get(field) is None for a in ("auto", "flat", "classic")):
            continue
        best = min(("flat", "classic"), key=lambda arm: arms[arm][field])
        auto = arms["auto"]
        out.append(dict(
            model=model, tokens=tokens, maxvio=auto["maxvio"], maxvio_target=target, choice=auto.get("plan_choice"),
            experts_moved=auto.get("experts_moved"), auto_us=auto[field], best_arm=best, best_us=arms[best][field],
            ratio=auto[field] / arms[best][field],
        ))
    return out


def model_error_stats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost model's error (``model_error = predicted/measured - 1``) per arm, then over all arms.

    Returns:
        ``[{"arm", "cells", "within", "median", "worst"}]``: ``within`` counts cells with
        ``|error| <= MODEL_BAND``; ``worst`` is the error of largest magnitude (signed). Arm
        ``all`` comes last; arms without model errors are left out.
    """
    errors: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        if row.get("model_error") is not None:
            errors[row["arm"]].append(row["model_error"])
    if not errors:
        return []
    errors["all"] = [error for values in list(errors.values()) for error in values]
    return [
        dict(arm=arm, cells=len(values), within=sum(abs(error) <= MODEL_BAND for error in values),
             median=statistics.median(values), worst=max(values, key=abs))
        for arm, values in errors.items()
    ]


def _auto_section(rows: list[dict[str, Any]]) -> list[str]:
    """Markdown lines comparing the auto arm with min(flat, classic) and the cost model's error."""
    lines: list[str] = []
    measured, with_link = auto_vs_best(rows), auto_vs_best(rows, "layer_with_link_model_us")
    if measured:
        linked = {(c["model"], c["tokens"], c["maxvio_target"]): c for c in with_link}
        kept = sum(c["ratio"] <= AUTO_SLACK for c in measured)
        kept_link = sum(c["ratio"] <= AUTO_SLACK for c in with_link)
        lines += [
            "", "## policy auto against min(flat, classic), same run", "",
            f"auto <= {AUTO_SLACK:g} x min(flat, classic) in **{kept} of {len(measured)}** cells by `layer` (measured), "
            f"in **{kept_link} of {len(with_link)}** by `layer + link` (the link is a model). auto chooses with its cost "
            "profile's model, which includes the link; on virtual ranks `layer` has no link time.", "",
            "| s | maxvio (target) | auto's choice | experts moved | auto layer | best of flat/classic | ratio | "
            "auto layer + link | best | ratio |",
            "|" + "---|" * 10,
        ]
        for cell in measured:
            link = linked.get((cell["model"], cell["tokens"], cell["maxvio_target"]))
            link_cells = "- | - | -" if link is None else (
                f"{_fmt(link['auto_us'])} | {link['best_arm']} {_fmt(link['best_us'])} | {link['ratio']:.2f}")
            lines.append(
                f"| {cell['tokens']} | {cell['maxvio']:.2f} ({cell['maxvio_target']:g}) | {cell['choice']} | "
                f"{_fmt(cell['experts_moved'])} | {_fmt(cell['auto_us'])} | {cell['best_arm']} {_fmt(cell['best_us'])} | "
                f"**{cell['ratio']:.2f}** | {link_cells} |"
            )
    stats = model_error_stats(rows)
    if stats:
        first = next(row for row in rows if row.get("model_error") is not None)
        profile = first.get("cost_profile") or {}
        lines += [
            "", f"## Cost model error (profile `{profile.get('name', '?')}`)", "",
            "`model_error` = predicted / measured - 1 per cell of every EP arm. predicted = the model's busiest-rank "
            "time for the plan that ran (auto: its own prediction for the candidate it chose; other arms: the same "
            "model evaluated on their plan). measured = the same terms, measured: the largest over ranks of that "
            "rank's experts time + its own push (measured) + its dispatch and combine bytes over the profile's link "
            "bandwidth (the model's row terms: virtual ranks send no row over a link); planning and the on-device "
            "dispatch/combine copies are in neither.",
        ]
        lines += ["", f"| arm | cells | within ±{100 * MODEL_BAND:.0f}% | median | worst |", "|---|---|---|---|---|"]
        for entry in stats:
            lines.append(f"| {entry['arm']} | {entry['cells']} | {entry['within']} | {100 * entry['median']:+.1f}% | "
                         f"{100 * entry['worst']:+.1f}% |")
    return lines


def summary_markdown(rows: list[dict[str, Any]]) -> str:
    """The sweep as a Markdown table, with the flatness ratios and what each column counts."""
    if not rows:
        return "No results.\n"
    first = rows[0]
    processes = first.get("ranks_kind") == "processes"
    meaning = (
        "Times in µs (median), each the slowest of the R processes (one per rank). `layer` = a whole "
        "`ep_moe` step of the slowest rank; for `a2a` (plain `all_to_all_single` of classic-EP rows, no "
        "experts) dispatch + combine. Bytes: dispatch = logical, the busiest rank's rows x H x 2 (s*K without "
        "dedup, one per token and destination rank with it), local rows included; "
        "egress/ingress max = the busiest rank's bytes over the link, local rows excluded; "
        "`disp + comb per rank` = dispatch + combine."
        if processes else _virtual_meaning(first)
    )
    backend = f", kernels: {first['backend']}" if first.get("backend") else ""
    lines = [
        f"# flatep bench: {first['model']} (H={first['hidden']}, E={first['experts']}, K={first['top_k']}, "
        f"I={first['intermediate']}, align={first.get('align', 128)}), R={first['ranks']} "
        f"{'processes' if processes else 'virtual ranks'} on {first['device']}{backend}"
        f"{', weights: ' + first['weights'] if first.get('weights') else ''}"
        f"{', dispatch: ' + first['dispatch'] if first.get('dispatch', 'bf16') != 'bf16' else ''}"
        f"{', cost profile: ' + first['cost_profile']['name'] if first.get('cost_profile') else ''}",
        "",
        _ceilings(first),
        "",
        meaning,
        "",
        "| arm | s | maxvio (target) | plan | dispatch | push | experts max | experts mean | combine | "
        "disp + comb per rank | layer | link model | layer + link | dispatch MB/rank | dispatch egress/ingress max MB | "
        "push egress/ingress max MB | push MB | copy% disp/comb | GEMM% | read% (GB) | rows max |",
        "|" + "---|" * 21,
    ]
    # Virtual ranks: one dispatch and one combine launch cover all R ranks, so a rank's share is 1/R
    # of them; processes: each rank's own.
    ranks_per_launch = 1 if processes else first["ranks"]
    for row in sorted(rows, key=lambda r: (r["arm"], r["tokens"], r["maxvio_target"])):
        copy = "-"
        if row.get("dispatch_copy_fraction") is not None:
            copy = f"{100 * row['dispatch_copy_fraction']:.0f}/{100 * row['combine_copy_fraction']:.0f}"
        gemm = "-" if row.get("experts_gemm_fraction") is None else f"{100 * row['experts_gemm_fraction']:.0f}"
        read = "-"
        if row.get("experts_read_fraction") is not None:
            read = f"{100 * row['experts_read_fraction']:.0f} ({row['weight_bytes_read_slowest'] / 1e9:.2f})"
        lines.append(
            f"| {row['arm']} | {row['tokens']} | {row['maxvio']:.2f} ({row['maxvio_target']:g}) | {_fmt(row['plan_us'])} | "
            f"{_fmt(row['dispatch_us'])} | {_fmt(row['push_us'])} | {_fmt(row['experts_us_max'])} | "
            f"{_fmt(row['experts_us_mean'])} | {_fmt(row['combine_us'])} | "
            f"{_fmt((row['dispatch_us'] + row['combine_us']) / ranks_per_launch, 2)} | **{_spread(row, 'layer_us')}** | "
            f"{_fmt(row.get('link_model_us'))} | {_fmt(row.get('layer_with_link_model_us'))} | "
            f"{_mb(row['dispatch_bytes'])} | {_link_cells(row)} | {row['push_bytes'] / 1e6:.0f} | "
            f"{copy} | {gemm} | {read} | {_fmt(row.get('rows_max'))} |"
        )
    lines += ["", "## Layer time relative to maxvio 0 (slowest rank)", "", "| arm | s | ratios by maxvio target |", "|---|---|---|"]
    for entry in flatness(rows):
        ratios = ", ".join(f"{target:g}: {ratio:.2f}" for target, ratio in entry["ratio_vs_maxvio0"].items())
        lines.append(f"| {entry['arm']} | {entry['tokens']} | {ratios} |")
    lines += _auto_section(rows)
    return "\n".join(lines) + "\n"


def _pyplot():
    """matplotlib's pyplot on a file-only backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    _pyplot().close(figure)


def _title(rows: list[dict[str, Any]], what: str) -> str:
    first = rows[0]
    kind = "processes" if first.get("ranks_kind") == "processes" else "virtual ranks"
    return f"{what}\n{first['model']}, R={first['ranks']} {kind}, {first['device']}"


def plot_headline(rows: list[dict[str, Any]], path: Path) -> None:
    """Slowest-rank layer time vs maxvio per arm, one panel per tokens-per-rank."""
    plt = _pyplot()
    tokens = sorted({r["tokens"] for r in rows})
    figure, axes = plt.subplots(1, len(tokens), figsize=(4.2 * len(tokens), 4), squeeze=False)
    for axis, count in zip(axes[0], tokens):
        for arm, (color, marker) in _arm_styles(rows):
            points = sorted((r["maxvio"], r["layer_us"]) for r in rows if r["arm"] == arm and r["tokens"] == count)
            if points:
                axis.plot(*zip(*points), color=color, marker=marker, label=arm if arm != "dense" else "dense (total / R)")
        axis.set_title(f"s = {count} tokens per rank")
        axis.set_xlabel("router imbalance maxvio")
        axis.set_ylabel("slowest-rank layer time (µs)")
        axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
    axes[0][0].legend()
    figure.suptitle(_title(rows, "MoE layer time vs router skew (lower is better)"))
    _save(figure, path)


def plot_breakdown(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked per-phase time (per-rank share) of every EP arm at the largest s, per maxvio."""
    plt = _pyplot()
    largest = max(r["tokens"] for r in rows)
    arms = [arm for arm, _ in _arm_styles(rows) if arm not in ("dense", "a2a")]
    figure, axes = plt.subplots(1, max(len(arms), 1), figsize=(6 * max(len(arms), 1), 4), squeeze=False)
    for axis, arm in zip(axes[0], arms):
        cells = sorted((r for r in rows if r["arm"] == arm and r["tokens"] == largest), key=lambda r: r["maxvio_target"])
        labels = [f"{r['maxvio']:.1f}" for r in cells]
        bottom = [0.0] * len(cells)
        for phase in PHASES:
            share = [r[phase] if phase in ("plan_us", "experts_us_max") else r[phase] / r["ranks"] for r in cells]
            axis.bar(labels, share, bottom=bottom, label=phase.replace("_us", "").replace("_max", " (slowest rank)"))
            bottom = [b + v for b, v in zip(bottom, share)]
        axis.set_title(f"{arm}, s = {largest}")
        axis.set_xlabel("router imbalance maxvio")
        axis.set_ylabel("time per rank (µs)")
    if arms:
        axes[0][0].legend(fontsize=8)
    figure.suptitle(_title(rows, "Per-phase time of the slowest rank"))
    _save(figure, path)


def plot_tokens(rows: list[dict[str, Any]], path: Path) -> None:
    """Slowest-rank layer time vs tokens per rank, at the smallest and the largest maxvio."""
    plt = _pyplot()
    targets = sorted({r["maxvio_target"] for r in rows})
    chosen = [targets[0], targets[-1]] if len(targets) > 1 else targets
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for arm, (color, marker) in _arm_styles(rows):
        for target, style in zip(chosen, ("-", "--")):
            points = sorted((r["tokens"], r["layer_us"]) for r in rows if r["arm"] == arm and r["maxvio_target"] == target)
            if points:
                axis.plot(*zip(*points), style, color=color, marker=marker, label=f"{arm}, maxvio {target:g}")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_xlabel("tokens per rank s")
    axis.set_ylabel("slowest-rank layer time (µs)")
    axis.grid(alpha=0.3, which="both")
    axis.legend(fontsize=8)
    axis.set_title(_title(rows, "Layer time vs tokens per rank"))
    _save(figure, path)


PLOTS_SKIPPED = "plots skipped: matplotlib is not installed (pip install 'flatep[plots]' to get them)"


def have_matplotlib() -> bool:
    """Whether the optional plotting dependency can be imported."""
    return importlib.util.find_spec("matplotlib") is not None


def write_report(rows: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write ``summary.md`` and, when matplotlib is installed, the three PNG plots into ``out_dir``.

    Returns the paths written, ``summary.md`` first (only it when matplotlib is missing: the plots
    are optional, see :data:`PLOTS_SKIPPED`).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "summary.md"]
    paths[0].write_text(summary_markdown(rows))
    if rows and have_matplotlib():
        for name, plot in (("layer_vs_maxvio.png", plot_headline), ("breakdown.png", plot_breakdown), ("layer_vs_tokens.png", plot_tokens)):
            plot(rows, out_dir / name)
            paths.append(out_dir / name)
    return paths


REQUIRED_FIELDS = (
    "model", "ranks", "tokens", "maxvio_target", "maxvio", "arm", "device", "plan_us", "dispatch_us", "push_us",
    "experts_us_max", "experts_us_mean", "combine_us", "layer_us", "dispatch_bytes", "push_bytes",
    "copy_ceiling_gbps", "gemm_ceiling_tflops",
)
