"""The benchmark with one process per rank: ``torchrun --nproc-per-node N -m flatep.bench.distributed``.

Every rank runs the same cells in lockstep and times its own phases (CUDA events on a GPU);
rank 0 gathers them and writes one JSON object per cell with every rank's times and the slowest
rank's (what the layer waits for). Arms: ``flat`` (policy ``exact``), ``classic`` (policy
``none``) and ``a2a``: plain ``torch.distributed.all_to_all_single`` of the same classic-EP rows
(dispatch and the reverse combine only, no experts), the baseline of any EP library.

Bytes: ``dispatch_bytes`` is logical, the busiest rank's rows times ``H*2`` (one row per token and
destination rank with ``EPConfig.dedup``, one per selected expert without: ``s*K*H*2``; local
rows included); every rank's ``link_bytes`` (dispatch, combine, push: egress, ingress, and the
local rows apart) come from its own plan (:func:`flatep.bench.accounting.rank_link_bytes`), and
``link_bytes_max`` is the most any rank sends or receives in dispatch. With ``--static-splits``
(collective transport) dispatch and combine send fixed-size messages, and their link bytes are those
messages' sizes, padding included (:func:`flatep.bench.accounting.static_link_bytes`), not the plan's
rows. With ``--dispatch fp8`` the EP arms send packed fp8 rows (``H + 4*ceil(H/128)`` bytes,
:mod:`flatep.kernels.fp8_rows`) and their dispatch link bytes count those; combine rows stay bf16.
With ``--link-gbps`` a
labelled link model charges each rank ``max(egress, ingress) / link_gbps`` per phase
(``link_model_us``: the busiest rank).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flatep.bench.accounting import PHASES, carried, link_model_us, rank_link_bytes, rows_to_ranks, static_link_bytes
from flatep.bench.timing import copy_ceiling_gbps, device_name, experts_outputs, gemm_ceiling_tflops, time_us
from flatep.config import MODEL_SHAPES, EPConfig, preset
from flatep.experts.pool import ExpertPool
from flatep.kernels.fp8_rows import DISPATCH_FORMATS, dispatch_row_bytes
from flatep.layer import combine_step, dispatch_step, ep_moe, experts_step, plan_step
from flatep.routing import sigma_for_maxvio, skewed_topk
from flatep.transport import init_group

ARMS = {"flat": "exact", "classic": "none", "a2a": "none"}


def _config(args: argparse.Namespace, world: int, capacity: int) -> EPConfig:
    if args.model in MODEL_SHAPES:
        return preset(args.model, ranks=world, capacity=capacity)
    hidden, experts, top_k, intermediate = (int(v) for v in args.model.split(","))
    return EPConfig(ranks=world, experts=experts, top_k=top_k, hidden=hidden, intermediate=intermediate, capacity=capacity)


def _a2a_baseline(x: torch.Tensor, ids: torch.Tensor, config: EPConfig, timing: dict[str, Any]) -> dict[str, float]:
    """Classic EP rows by ``all_to_all_single``: sort entries by home rank, exchange, exchange back, sum."""
    top_k = ids.shape[1]
    destination = (ids.long() // config.experts_per_rank).reshape(-1)
    order = torch.argsort(destination, stable=True)
    send_counts = torch.bincount(destination, minlength=config.ranks)
    receive_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(receive_counts, send_counts)
    send_split, receive_split = send_counts.tolist(), receive_counts.tolist()  # host sync, as every a2a caller
    rows = x[order // top_k]
    received = torch.empty(sum(receive_split), x.shape[1], dtype=x.dtype, device=x.device)
    returned = torch.empty_like(rows)

    def dispatch() -> None:
        dist.all_to_all_single(received, x[order // top_k], receive_split, send_split)

    def combine() -> torch.Tensor:
        dist.all_to_all_single(returned, received, send_split, receive_split)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        return out.index_add_(0, order // top_k, returned.float()).to(x.dtype)

    del rows
    return dict(dispatch_us=time_us(dispatch, **timing), combine_us=time_us(combine, **timing))


def _ep_cell(
    group, pool: ExpertPool, x, ids, weights, config: EPConfig, policy: str, timing: dict[str, Any],
    dispatch_dtype: torch.dtype | None,
) -> dict[str, Any]:
    sent = dict(dispatch_dtype=dispatch_dtype)
    plan_us = time_us(lambda: plan_step(ids, config, group, policy, dtype=x.dtype, **sent), **timing)
    plan = plan_step(ids, config, group, policy, dtype=x.dtype, **sent)
    dispatch_us = time_us(lambda: dispatch_step(x, weights, plan, group, **sent), **timing)
    push_us = time_us(lambda: pool.push(plan.slot_experts), **timing)
    shard, shard_weights = dispatch_step(x, weights, plan, group, **sent)
    [out] = experts_outputs([shard])  # every replay computes on the dispatched rows
    experts_us = time_us(lambda: experts_step(shard, shard_weights, pool, plan, group, 0, out=out), **timing)
    combine_us = time_us(lambda: combine_step(shard, plan, group, x.shape[0], config.top_k, x.dtype), **timing)
    step_us = time_us(lambda: ep_moe(x, ids, weights, config=config, group=group, policy=policy, pool=pool, **sent),
                      **timing)
    # The rows other ranks send here are in their plans, not this one: one all-to-all of the counts.
    rows_out = rows_to_ranks(plan)
    rows_in = torch.empty_like(rows_out)
    dist.all_to_all_single(rows_in, rows_out)
    rank = group.first_rank
    row_bytes = config.hidden * x.element_size()
    sent_row_bytes = dispatch_row_bytes(config.hidden, x.element_size(), dispatch_dtype)
    link_bytes = rank_link_bytes(plan, sent_row_bytes, config.expert_bytes(x.element_size()),
                                 int(rows_in.sum() - rows_in[rank]), combine_row_bytes=row_bytes)
    if group.static_splits:
        link_bytes.update(static_link_bytes(x.shape[0], config.top_k, plan.dedup, sent_row_bytes, group.world,
                                            combine_row_bytes=row_bytes))
    return dict(
        plan_us=plan_us, dispatch_us=dispatch_us, push_us=push_us, experts_us=experts_us, combine_us=combine_us,
        step_us=step_us, rows=int(plan.received[rank]),
        sent_rows=int(carried(plan).sum()),
        link_bytes=link_bytes,
        borrowed=int((plan.slot_experts[rank] >= 0).sum()),
    )


def _link_summary(per_rank: list[dict[str, Any]], link_gbps: float | None) -> dict[str, Any]:
    """Every rank's link bytes by phase (``{phase: {direction: [R]}}``) and, with a bandwidth, the model."""
    if not all("link_bytes" in rank for rank in per_rank):
        return {}
    link = {
        phase: {direction: [rank["link_bytes"][phase][direction] for rank in per_rank] for direction in per_rank[0]["link_bytes"][phase]}
        for phase in PHASES
    }
    summary: dict[str, Any] = dict(
        link_bytes=link, link_bytes_max=max(max(link["dispatch"]["egress"]), max(link["dispatch"]["ingress"])),
    )
    if link_gbps:
        model = link_model_us(link, link_gbps)
        summary.update(link_model_us_per_rank=model, link_model_us=max(model["total"]))
    return summary


def _summarize(per_rank: list[dict[str, Any]], config: EPConfig, tokens: int, link_gbps: float | None = None) -> dict[str, Any]:
    """The slowest rank's figures (the layer waits for it) plus every rank's."""
    def slowest(name: str) -> float:
        return max(rank.get(name, 0.0) for rank in per_rank)

    # The busiest rank's dispatch rows (a2a cells send every entry).
    logical = max(rank.get("sent_rows", tokens * config.top_k) for rank in per_rank) * config.hidden * 2
    experts = [rank.get("experts_us", 0.0) for rank in per_rank]
    summary = dict(
        plan_us=slowest("plan_us"), dispatch_us=slowest("dispatch_us"), push_us=slowest("push_us"),
        experts_us_max=max(experts), experts_us_mean=sum(experts) / len(experts), combine_us=slowest("combine_us"),
        layer_us=slowest("step_us") or slowest("dispatch_us") + slowest("combine_us"),
        dispatch_bytes=logical, combine_bytes=logical,
        push_bytes=sum(rank.get("borrowed", 0) for rank in per_rank) * config.expert_bytes(),
        dispatch_gbps_logical=logical / slowest("dispatch_us") / 1e3,
        combine_gbps_logical=logical / slowest("combine_us") / 1e3,
        **_link_summary(per_rank, link_gbps),
        rows_max=max(rank.get("rows", 0) for rank in per_rank),
        per_rank=per_rank,
    )
    summary["experts_tflops_slowest"] = summary["rows_max"] * 6 * config.hidden * config.intermediate / max(summary["experts_us_max"], 1e-9) / 1e6
    return summary


def _use_gpu(device: str, local_processes: int) -> bool:
    """Whether each process gets its own GPU; ``device="cuda"`` without enough GPUs raises."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and gpus < local_processes:
        raise SystemExit(f"--device cuda needs one GPU per local process: {local_processes} processes, {gpus} GPU(s)")
    return device == "cuda" or (device == "auto" and gpus >= local_processes)


def main(argv: list[str] | None = None) -> int:
    """Run the per-process benchmark (every rank of a torchrun job calls this); rank 0 writes results."""
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m flatep.bench.distributed",
        description="The EP benchmark with one process per rank: every rank times its own phases; "
        "rank 0 writes results.jsonl with every rank's times and the slowest rank's.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", default="kimi-k2", help=f"one of {sorted(MODEL_SHAPES)} or 'hidden,experts,top_k,intermediate'")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024, 4096, 8192], help="tokens per rank s")
    parser.add_argument("--maxvio", type=float, nargs="+", default=[0, 1, 5, 10, 20], help="target router imbalance")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS), help="arms, run one after another in every cell")
    parser.add_argument("--transport", default="auto", choices=["auto", "nvlink", "collective"], help="EP transport (flatep.init_group)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"],
                        help="auto: one GPU per process when the host has as many GPUs as local processes, else the CPU "
                        "(gloo); several processes cannot share one GPU under NCCL")
    parser.add_argument("--static-splits", action="store_true",
                        help="collective transport: fixed-size dispatch and combine messages, no host read (init_group)")
    parser.add_argument("--dispatch", default="bf16", choices=list(DISPATCH_FORMATS),
                        help="dtype of the rows the EP arms dispatch (fp8: e4m3 with a scale per 128 columns)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="bandwidth per direction of the labelled link model, GB/s (None: no model, bytes only)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before timing")
    parser.add_argument("--iters", type=int, default=10, help="timed calls (median reported)")
    parser.add_argument("--out", default="bench-out", help="folder for results.jsonl (written by rank 0)")
    parser.add_argument("--init-method", default="env://", help="torch.distributed init method")
    args = parser.parse_args(argv)

    on_gpu = _use_gpu(args.device, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if on_gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=args.init_method,
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0 and not on_gpu and args.device == "auto" and torch.cuda.is_available():
        print(f"flatep.bench.distributed: {torch.cuda.device_count()} GPU(s) for more local processes: running on the CPU "
              "with gloo (NCCL needs one GPU per process)", flush=True)
    device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
    group = init_group(transport=args.transport, device=device, static_splits=args.static_splits)
    timing = dict(device=device, warmup=args.warmup, iters=args.iters)
    config = _config(args, world, max(args.tokens))
    ceilings = dict(copy_ceiling_gbps=copy_ceiling_gbps(device, 1024 if on_gpu else 64),
                    gemm_ceiling_tflops=gemm_ceiling_tflops(device, 8192 if on_gpu else 256))
    pool = ExpertPool(config, group, torch.bfloat16)
    generator = torch.Generator(device=device).manual_seed(100 + rank)
    for tensor in (pool.w13, pool.w2):
        tensor.copy_(torch.randn(tensor.shape, device=device, generator=generator) * tensor.shape[-1] ** -0.5)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        results = (out / "results.jsonl").open("w")
    for tokens in args.tokens:
        for target in args.maxvio:
            sigma, reached = sigma_for_maxvio(target, world, config.experts, config.top_k, tokens, device=device)
            ids = skewed_topk(world, config.experts, config.top_k, tokens, sigma, device=device)[rank].contiguous()
            x = torch.randn(tokens, config.hidden, device=device, generator=generator).bfloat16()
            weights = torch.rand(tokens, config.top_k, device=device, generator=generator) / config.top_k
            for arm in args.arms:
                if arm == "a2a":
                    measured = _a2a_baseline(x, ids, config, timing)
                else:
                    measured = _ep_cell(group, pool, x, ids, weights, config, ARMS[arm], timing,
                                        DISPATCH_FORMATS[args.dispatch])
                gathered: list[Any] = [None] * world
                dist.all_gather_object(gathered, {**measured, **ceilings})
                if rank == 0:
                    row = dict(
                        model=args.model, ranks=world, ranks_kind="processes", transport=type(group).__name__,
                        static_splits=group.static_splits, dispatch=args.dispatch if arm != "a2a" else "bf16",
                        tokens=tokens, maxvio_target=target, maxvio=reached, sigma=sigma, arm=arm,
                        device=device_name(device), hidden=config.hidden, experts=config.experts, top_k=config.top_k,
                        intermediate=config.intermediate, link_gbps_model=args.link_gbps,
                        copy_ceiling_gbps=min(g["copy_ceiling_gbps"] for g in gathered),
                        gemm_ceiling_tflops=min(g["gemm_ceiling_tflops"] for g in gathered),
                        command="torchrun -m flatep.bench.distributed " + " ".join(sys.argv[1:]),
                        **_summarize(gathered, config, tokens, args.link_gbps),
                    )
                    row["experts_gemm_fraction"] = row["experts_tflops_slowest"] / row["gemm_ceiling_tflops"]
                    results.write(json.dumps(row) + "\n")
                    results.flush()
                    print(f"{arm:8s} s={tokens:5d} maxvio={reached:5.2f}: dispatch {row['dispatch_us']:9.1f} us "
                          f"({row['dispatch_gbps_logical']:6.1f} GB/s logical), combine {row['combine_us']:9.1f} us, "
                          f"layer {row['layer_us']:9.1f} us (slowest rank)", flush=True)
    if rank == 0:
        results.close()
    group.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
