"""Human- and machine-readable summaries of a plan (used by ``flatep plan``)."""
from __future__ import annotations

from typing import Any

from flatep.config import EPConfig
from flatep.plan.types import Layout


def summarize(layout: Layout, config: EPConfig, element_size: int = 2) -> dict[str, Any]:
    """Per-rank load before and after balancing, borrowed experts and bytes to move.

    Returns:
        A JSON-serialisable dict: ``ranks`` (one dict per rank: ``home_rows`` = rows its own
        experts received from the router, ``rows`` = real rows it computes, ``padding_rows``,
        ``borrowed`` = global ids, ``donor``, ``weight_bytes_in``), and totals.
    """
    epn = config.experts_per_rank
    counts = layout.tokens_per_expert.long().sum(0).cpu()
    home_rows = counts.view(config.ranks, epn).sum(1).tolist()
    donors = layout.donors().tolist()
    ranks = []
    for rank in range(config.ranks):
        borrowed = [e for e in layout.slot_experts[rank].tolist() if e >= 0]
        ranks.append(
            {
                "rank": rank,
                "home_rows": home_rows[rank],
                "rows": int(layout.received[rank]),
                "padding_rows": int(layout.padding[rank, :, 1].sum()),
                "borrowed": borrowed,
                "donor": donors[rank],
                "weight_bytes_in": len(borrowed) * config.expert_bytes(element_size),
            }
        )
    rows = [r["rows"] for r in ranks]
    mean_rows = sum(rows) / len(rows)
    return {
        "policy": layout.policy,
        "shard_rows": layout.shard_rows,
        "ranks": ranks,
        "max_rows_before": max(home_rows),
        "max_rows_after": max(rows),
        "rank_imbalance_before": max(home_rows) / mean_rows - 1,
        "rank_imbalance_after": max(rows) / mean_rows - 1,
        "borrowed_experts": sum(len(r["borrowed"]) for r in ranks),
        "weight_bytes_moved": sum(r["weight_bytes_in"] for r in ranks),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """A fixed-width table of :func:`summarize`'s output."""
    lines = [
        f"{'rank':>4} {'rows before':>12} {'rows after':>11} {'padding':>8} {'donor':>6} {'weights in (MB)':>16}  borrowed experts",
    ]
    for r in summary["ranks"]:
        borrowed = ",".join(str(e) for e in r["borrowed"][:12]) + (" ..." if len(r["borrowed"]) > 12 else "")
        donor = "-" if r["donor"] < 0 else str(r["donor"])
        lines.append(
            f"{r['rank']:>4} {r['home_rows']:>12} {r['rows']:>11} {r['padding_rows']:>8} {donor:>6} "
            f"{r['weight_bytes_in'] / 1e6:>16.1f}  {borrowed or '-'}"
        )
    lines.append(
        f"slowest rank: {summary['max_rows_before']} rows before, {summary['max_rows_after']} after "
        f"(rank imbalance {summary['rank_imbalance_before']:.2f} -> {summary['rank_imbalance_after']:.2f}); "
        f"{summary['borrowed_experts']} borrowed experts, {summary['weight_bytes_moved'] / 1e9:.2f} GB of weights move"
    )
    return "\n".join(lines)


def plot_load(summary: dict[str, Any], path: str, title: str) -> None:
    """Bar chart of per-rank rows before and after balancing, written to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["rank"] for r in summary["ranks"]]
    width = 0.4
    figure, axes = plt.subplots(figsize=(max(6, len(ranks) * 0.6), 4))
    axes.bar([r - width / 2 for r in ranks], [r["home_rows"] for r in summary["ranks"]], width, label="home experts (classic EP)")
    axes.bar([r + width / 2 for r in ranks], [r["rows"] for r in summary["ranks"]], width, label=f"after plan ({summary['policy']})")
    axes.set_xlabel("EP rank")
    axes.set_ylabel("real token rows computed")
    axes.set_title(title)
    axes.set_xticks(ranks)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
