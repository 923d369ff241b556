"""Tuning sweep of the dispatch, combine and push kernels against the device-copy ceiling.

``python -m flatep.bench.kernels [--model kimi-k2] [--tokens 4096] [--graph-calls 10] [--out FILE.json]``
times each kernel configuration (tokens per program, columns per step, warps) on R virtual ranks of
one GPU and prints achieved bandwidth (bytes read + written) beside the copy ceiling measured in the
same run. Eager launches by default; ``--graph-calls N`` times N launches captured in one CUDA graph
per replay instead (per launch), as a serving step's graph runs them. Bytes counted: dispatch reads
each token row once and writes its carriers' rows (K rows per token without ``EPConfig.dedup``, one per destination rank with it); combine reads those rows and
writes one; push reads and writes every pushed expert. Only the two exchange kernels are timed:
with dedup the destinations' expansion after dispatch and the run sums before combine
(:func:`flatep.kernels.dispatch.expand_triton`, :func:`flatep.kernels.combine.sum_runs_triton`)
are not, so their figures are those of the link-facing kernels alone.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch

from flatep.bench.accounting import carried
from flatep.kernels import backend
from flatep.bench.timing import copy_ceiling_gbps, device_name, time_us
from flatep.config import preset
from flatep.kernels.combine import combine_triton
from flatep.kernels.dispatch import dispatch_triton
from flatep.kernels.push import PoolCopy, push_triton
from flatep.layer import link_buffer
from flatep.plan.reference import make_plan
from flatep.routing import skewed_topk
from flatep.transport.local import LocalGroup


def _time_push(group: LocalGroup, config, plan, ceiling: float, timing: dict) -> tuple[int, float, float]:
    """Time the push of this plan's borrowed experts (w13 projection): slots, µs, copy fraction."""
    shape = (config.experts_per_rank, 2 * config.intermediate, config.hidden)
    home = group.symmetric_empty(shape, torch.bfloat16)
    slots = group.symmetric_empty(shape, torch.bfloat16)
    pushed = int((plan.slot_experts >= 0).sum())
    numel = home[0, 0].numel()
    pool = PoolCopy(home, group.peer_offsets(home), slots, group.peer_offsets(slots), numel)
    push_us = time_us(lambda: push_triton([pool], plan.slot_experts, 0, config.ranks), home.device, **timing)
    return pushed, push_us, (2 * pushed * numel * 2 / push_us / 1e3 / ceiling if pushed else 0.0)


def main(argv: list[str] | None = None) -> int:
    """Sweep the kernels' launch parameters on one GPU and print their bandwidth against the copy ceiling."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="kimi-k2")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--block-t", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="tokens per program to try")
    parser.add_argument("--block-h", type=int, nargs="+", default=[512, 1024, 2048], help="columns per step to try")
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="warps per program to try")
    parser.add_argument("--split-below", type=int, nargs="+", default=[backend.SPLIT_BELOW_ITEMS],
                        help="values of flatep.kernels.backend.SPLIT_BELOW_ITEMS to try (token blocks below which "
                             "dispatch makes every column chunk of a row its own work item)")
    parser.add_argument("--graph-calls", type=int, default=0,
                        help="time N launches per CUDA-graph replay (0: eager launches)")
    parser.add_argument("--out", help="write the measurements as JSON")
    args = parser.parse_args(argv)
    if args.graph_calls < 0:
        parser.error(f"--graph-calls must be >= 0, got {args.graph_calls}")
    timing = dict(warmup=3, iters=10, graph=args.graph_calls > 0, calls=max(args.graph_calls, 1))
    device = torch.device("cuda")
    ceiling = copy_ceiling_gbps(device)
    print(f"{device_name(device)}: copy ceiling {ceiling:.0f} GB/s (read+write)")
    records = []
    library_split = backend.SPLIT_BELOW_ITEMS  # --split-below changes it while it times; put back at the end
    for tokens in args.tokens:
        config = preset(args.model, ranks=args.ranks, capacity=tokens)
        group = LocalGroup(args.ranks, device)
        ids = skewed_topk(args.ranks, config.experts, config.top_k, tokens, args.sigma, device=device)
        plan = make_plan(ids, config)
        x = torch.randn(args.ranks, tokens, config.hidden, device=device).bfloat16()
        weights = torch.rand(args.ranks, tokens, config.top_k, device=device)
        shard = group.buffer("shard", (plan.shard_rows, config.hidden), torch.bfloat16)
        shard_weights = group.buffer("shard_weights", (plan.shard_rows,), torch.float32)
        links = link_buffer(group, plan.shard_rows)
        peers, weight_peers, link_peers = (group.peer_offsets(t) for t in (shard, shard_weights, links))
        out = torch.empty_like(x)
        row_bytes = config.hidden * 2
        moved = (args.ranks * tokens + int(carried(plan).sum())) * row_bytes
        for block_t, block_h, warps, split in itertools.product(args.block_t, args.block_h, args.warps, args.split_below):
            if block_t * block_h > 16384:
                continue
            backend.SPLIT_BELOW_ITEMS = split  # read by column_parts at each launch
            dispatch_us = time_us(lambda: dispatch_triton(
                x, weights, plan.dest_rank, plan.dest_row, plan.carrier, plan.send_order, shard, shard_weights, links,
                peers, weight_peers, link_peers, plan.dedup, block_t=block_t, block_h=block_h, num_warps=warps),
                device, **timing)
            combine_us = time_us(lambda: combine_triton(
                out, plan.dest_rank, plan.dest_row, plan.carrier, plan.send_order, shard, peers, block_t=block_t,
                block_h=block_h, num_warps=warps), device, **timing)
            record = dict(kernel_config=dict(block_t=block_t, block_h=block_h, num_warps=warps, split_below=split), tokens=tokens,
                          dispatch_us=dispatch_us, combine_us=combine_us,
                          dispatch_fraction=moved / dispatch_us / 1e3 / ceiling,
                          combine_fraction=moved / combine_us / 1e3 / ceiling)
            records.append(record)
            print(f"s={tokens:5d} block_t={block_t:2d} block_h={block_h:4d} warps={warps} split_below={split:5d}: dispatch {dispatch_us:8.1f} us "
                  f"({100 * record['dispatch_fraction']:.0f}%), combine {combine_us:8.1f} us ({100 * record['combine_fraction']:.0f}%)")
        slots, push_us, push_fraction = _time_push(group, config, plan, ceiling, timing)
        print(f"s={tokens}: push of {slots} w13 experts {push_us:.1f} us ({100 * push_fraction:.0f}% of copy ceiling)")
        records.append(dict(tokens=tokens, push_us=push_us, push_slots=slots, push_fraction=push_fraction))
        group.close()
    backend.SPLIT_BELOW_ITEMS = library_split
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(dict(device=device_name(device), copy_ceiling_gbps=ceiling, graph_calls=args.graph_calls, command=" ".join(sys.argv), records=records), handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
