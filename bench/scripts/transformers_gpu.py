"""On one GPU: tiny bf16 models of every supported transformers family, sharded over 8 virtual ranks,
generate the unsharded model's greedy tokens.

For each family (Qwen3-MoE, DeepSeek-V3, Kimi-K2, gpt-oss) and policy: build the tiny model in bf16
on CUDA (no downloads), greedy-decode 32 tokens for a batch of prompts, shard it with
``shard_moe(model, init_group("local", ranks=8))``, decode again, and compare tokens and logits.
It also reports, per MoE layer, the router imbalance (maxvio) of the prefill and of all decode steps
together, the rows each rank computed (flat under ``exact``) against what classic EP would have
given, and the routed-expert memory per rank before and after sharding.

bf16 greedy decoding of a random model is fragile: a one-ulp difference can flip a router's top-k
or a near-tied argmax, and the flip then grows. As a yardstick, the unsharded model is also run with
transformers' ``eager`` experts loop (its default is ``grouped_mm``); both runs, and FlatEP's, are
also compared teacher-forced (the reference tokens fed to all), which counts only the steps whose
argmax differs instead of every step after the first.

Usage (on the GPU machine, from the repository root)::

    PYTHONPATH=. python3 bench/scripts/transformers_gpu.py [--ranks 8] [--tokens 32] [--precision native]

The log goes to ``$OUT/transformers_gpu.log`` (``OUT`` defaults to ``./bench-out``). Exit status 1
when any greedy token differs.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from flatep import init_group
from flatep.integrations.tiny_models import TINY_FAMILIES, tiny_model
from flatep.integrations.transformers import shard_moe, sharded_experts

# A size up from the CPU tests: hidden 256, 32 experts, and the families' own top-k where it fits.
LARGER = dict(hidden_size=256, num_attention_heads=8, vocab_size=512)
OVERRIDES = {
    "qwen3-moe": dict(LARGER, head_dim=32, num_hidden_layers=4, moe_intermediate_size=128, num_experts=32,
                      num_experts_per_tok=4),
    "deepseek-v3": dict(LARGER, num_key_value_heads=8, num_hidden_layers=4, moe_intermediate_size=128, n_routed_experts=32,
                        num_experts_per_tok=8, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
                        qk_nope_head_dim=32, v_head_dim=32),
    "kimi-k2": dict(LARGER, num_key_value_heads=8, num_hidden_layers=4, moe_intermediate_size=128, n_routed_experts=32,
                    num_experts_per_tok=8, kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=16,
                    qk_nope_head_dim=32, v_head_dim=32),
    "gpt-oss": dict(LARGER, head_dim=32, num_hidden_layers=4, intermediate_size=128, num_local_experts=32,
                    num_experts_per_tok=4, sliding_window=16),
}


def greedy(model: torch.nn.Module, prompts: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sequences [B, P + tokens], logits [B, tokens, V] fp32)`` of greedy decoding with the KV cache."""
    with torch.no_grad():
        out = model.generate(
            prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences, torch.stack(out.logits, 1).float()


def teacher_forced(model: torch.nn.Module, sequences: torch.Tensor, prompt: int) -> torch.Tensor:
    """``[B, tokens, V]`` fp32 logits predicting each generated token of ``sequences`` in one forward pass."""
    with torch.no_grad():
        return model(sequences).logits[:, prompt - 1 : -1].float()


def compare(name: str, expected: torch.Tensor, sequences: torch.Tensor, expected_forced: torch.Tensor,
            forced: torch.Tensor, prompt: int, log) -> bool:
    """Log how ``sequences`` (and the teacher-forced logits ``forced``) differ from the reference; True if equal.

    Teacher forcing feeds both models the reference tokens, so their logits stay comparable at every
    step, and an argmax that differs there is a near-tie of the reference unless the margin is large.
    """
    new = sequences[:, prompt:]
    reference = expected[:, prompt:]
    agree = (new == reference).all(1).tolist()
    parted = [int((new[b] != reference[b]).nonzero()[0]) for b in range(len(agree)) if not agree[b]]
    top2 = expected_forced.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    flipped = forced.argmax(-1) != expected_forced.argmax(-1)
    flips = ", ".join(f"{float(m):.4f}" for m in margin[flipped].tolist()[:8]) or "-"
    diff = (forced - expected_forced).abs().max().item()
    log(f"   {name:34s} greedy {'EQUAL    ' if all(agree) else 'DIFFERENT'} per prompt {agree} "
        f"(first differing step per differing prompt {parted or '-'})")
    log(f"   {'':34s} teacher-forced: logits max |diff| {diff:.3e} (max |logit| {expected_forced.abs().max().item():.2f}), "
        f"argmax differs at {int(flipped.sum())}/{flipped.numel()} steps, reference top-2 margins there: {flips}")
    return all(agree)


def run_family(family: str, policy: str, args: argparse.Namespace, log) -> bool:
    """Compare the sharded and unsharded tiny model of ``family``; True when every greedy token agrees.

    As a yardstick for bf16 rounding, the unsharded model also runs with transformers' ``eager``
    experts loop instead of its default ``grouped_mm``: both are the unsharded model.
    """
    device = torch.device(args.device)
    model = tiny_model(family, dtype=torch.bfloat16, device=device, seed=args.seed, **OVERRIDES[family])
    generator = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=generator).to(device)
    default = model.config._experts_implementation
    expected, _ = greedy(model, prompts, args.tokens)
    expected_forced = teacher_forced(model, expected, args.prompt)
    log(f"\n== {family}, policy {policy}, precision {args.precision}, {args.ranks} virtual ranks, bf16 on {describe(device)}, "
        f"{args.batch} prompts x {args.prompt} tokens, {args.tokens} new tokens; reference: unsharded, {default} experts")
    model.set_experts_implementation("eager")
    eager, _ = greedy(model, prompts, args.tokens)
    compare("unsharded, eager experts (yardstick)", expected, eager, expected_forced,
            teacher_forced(model, expected, args.prompt), args.prompt, log)
    model.set_experts_implementation(default)
    group = init_group("local", ranks=args.ranks, device=device)
    summary = shard_moe(model, group, policy, capacity=args.batch * args.prompt, record_routing=True,
                        precision=args.precision)
    log(f"   {summary}")
    start = time.perf_counter()
    sequences, _ = greedy(model, prompts, args.tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    same = compare(f"FlatEP ({elapsed:.2f} s)", expected, sequences, expected_forced,
                   teacher_forced(model, expected, args.prompt), args.prompt, log)
    log("   per layer: maxvio prefill | maxvio decode (all steps) | rank rows max/mean-1 under this policy "
        "(worst call) | classic EP (worst call)")
    decode = slice(1, args.tokens)
    for name, experts in sharded_experts(model):
        log(f"   {name:32s} {experts.maxvio()[0]:6.2f} | {experts.maxvio(decode, total=True)[0]:6.2f} | "
            f"{max(experts.rank_imbalance()):6.2f} | {max(experts.rank_imbalance(classic=True)):6.2f}")
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return same


def describe(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--batch", type=int, default=4, help="prompts")
    parser.add_argument("--prompt", type=int, default=16, help="prompt length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", default=["exact", "none"])
    parser.add_argument("--families", nargs="+", default=list(TINY_FAMILIES), choices=TINY_FAMILIES)
    parser.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a smoke run)")
    parser.add_argument("--precision", choices=["native", "fp32"], default="native", help="see flatep.experts.grouped")
    parser.add_argument("--log", default="transformers_gpu.log", help="log file name under $OUT")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA GPU: pass --device cpu for a smoke run", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", "./bench-out"))
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    with open(out / args.log, "w") as handle:
        def log(line: str) -> None:
            print(line, flush=True)
            handle.write(line + "\n")

        log(f"torch {torch.__version__}, transformers {transformers.__version__}, {describe(torch.device(args.device))}")
        results = {(family, policy): run_family(family, policy, args, log) for family in args.families
                   for policy in args.policies}
        failed = [f"{family}/{policy}" for (family, policy), same in results.items() if not same]
        log(f"\n{'ALL GREEDY TOKENS EQUAL' if not failed else 'GREEDY TOKENS DIFFER: ' + ', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
