"""One rank of the multi-process transformers check, spawned by :mod:`tests.integrations.test_transformers_distributed`.

Every rank builds the same tiny model of each family (same seed), greedy-decodes its own prompts
with the unsharded model, shards the routed experts over the process group with
``init_group(process_group=None, transport=...)``, decodes again and compares tokens and logits.
Ranks have different prompts and batch sizes, so their token counts per MoE call differ (data-
parallel attention, expert-parallel experts); once more with ``fixed_capacity`` (every call padded
to the capacity, never agreed on). Prints one ``RESULT`` line per family and policy and
exits 1 when any check of this rank failed.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

from flatep import init_group
from flatep.integrations.tiny_models import TINY_FAMILIES, tiny_model
from flatep.integrations.transformers import FlatEPExperts, shard_moe, sharded_experts

# 16 decode steps, each with different token counts on the two ranks: enough calls to cover the
# agreed and padded sizes, at half the run time of 32 (the suite's longest test).
NEW_TOKENS = 16


def greedy(model: torch.nn.Module, prompts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            prompts, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1)


def check(family: str, policy: str, transport: str, rank: int, fixed_capacity: bool = False) -> bool:
    # Rank r decodes r + 2 prompts of 11 - 2r tokens: the ranks' token counts differ at every step.
    prompts = torch.randint(0, 128, (rank + 2, 11 - 2 * rank), generator=torch.Generator().manual_seed(100 + rank))
    model = tiny_model(family)
    expected, expected_logits = greedy(model, prompts)
    group = init_group(process_group=None, transport=transport)
    # fixed_capacity: every call padded to 32 tokens (the largest is rank 1's prefill, 27), sizes never agreed on.
    summary = shard_moe(model, group, policy, capacity=32 if fixed_capacity else 4, backend="torch", record_routing=True,
                        fixed_capacity=fixed_capacity)
    agreed = FlatEPExperts._group_step
    if fixed_capacity:
        FlatEPExperts._group_step = _never_called
    try:
        sequences, logits = greedy(model, prompts)
    finally:
        FlatEPExperts._group_step = agreed
    refused = True
    if fixed_capacity:  # a call over the capacity raises on this rank before any exchange
        experts = sharded_experts(model)[0][1]
        hidden = torch.zeros(33, experts.config.hidden)
        try:
            experts(hidden, torch.zeros(33, experts.config.top_k, dtype=torch.int64), torch.ones(33, experts.config.top_k))
            refused = False
        except ValueError as error:
            refused = "more than the fixed capacity of 32" in str(error)
    same = torch.equal(sequences, expected)
    diff = float((logits - expected_logits).abs().max())
    close = diff <= 1e-5 * float(expected_logits.abs().max())
    layers = sharded_experts(model)
    # Every rank sees the same gathered histogram, hence the same group-wide maxvio.
    maxvio = [round(experts.maxvio(total=True)[0], 3) for _, experts in layers]
    flat = all(
        int(rows.max() - rows.min()) <= 1 for _, experts in layers for rows in experts.received
    ) if policy == "exact" else True
    # epn home experts per layer plus one set of epn slots shared by the L layers: (L+1)/(L*R) of before.
    shrunk = summary.bytes_after * group.world * len(layers) == summary.bytes_before * (len(layers) + 1)
    label = f"{policy}+fixed_capacity" if fixed_capacity else policy
    print(f"RESULT rank={rank} family={family} policy={label} tokens_equal={same} logits_max_diff={diff:.2e} "
          f"flat={flat} refused={refused} memory={summary.bytes_before}->{summary.bytes_after} maxvio={maxvio}", flush=True)
    group.close()  # lets go of the process group before it is destroyed
    return same and close and flat and shrunk and refused


def _never_called(self, tokens: int) -> int:
    raise AssertionError("fixed_capacity: the ranks must not agree on a call's size")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init-method", required=True)
    parser.add_argument("--transport", default="collective")
    parser.add_argument("--families", nargs="+", default=list(TINY_FAMILIES))
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)
    try:
        results = [check(family, "exact", args.transport, rank) for family in args.families]
        results.append(check(args.families[0], "none", args.transport, rank))
        results.append(check(args.families[0], "exact", args.transport, rank, fixed_capacity=True))
    finally:
        dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
