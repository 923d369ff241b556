"""Greedy generation with a transformers MoE model before and after FlatEP shards its routed experts.

Builds a tiny randomly initialised model of a chosen family from its config (no downloads), or loads
a local checkpoint folder, decodes greedily, shards the routed experts with
:func:`flatep.integrations.transformers.shard_moe`, decodes again and prints both outputs side by
side with each step's routing imbalance: the router's maxvio per MoE layer and how unevenly the EP
ranks would be loaded under classic EP against the rows FlatEP actually gave each rank.

Examples::

    python examples/generate.py --family deepseek-v3 --ranks 4
    python examples/generate.py --family gpt-oss --ranks 8 --device cuda --dtype bfloat16
    python examples/generate.py --checkpoint /models/Qwen3-30B-A3B --ranks 8 --device cuda --dtype bfloat16 \\
        --prompt "The capital of France is"
    # one process per rank (each rank decodes its own prompts; only the experts are sharded):
    torchrun --nproc-per-node 2 examples/generate.py --family qwen3-moe --transport collective

Kimi-K2 checkpoints run as DeepSeek-V3 (same architecture); quantized experts (MXFP4, FP8) must be
loaded dequantized.
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from flatep import init_group
from flatep.integrations.tiny_models import TINY_FAMILIES, tiny_model
from flatep.integrations.transformers import shard_moe, sharded_experts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--family", choices=TINY_FAMILIES, default="qwen3-moe", help="tiny random model of this family")
    source.add_argument("--checkpoint", help="a local checkpoint folder (config, weights, tokenizer if any)")
    parser.add_argument("--transport", choices=["local", "collective", "nvlink"], default="local",
                        help="local: virtual ranks in this process; else one process per rank (torchrun)")
    parser.add_argument("--ranks", type=int, default=4, help="virtual ranks (local transport)")
    parser.add_argument("--policy", choices=["exact", "none"], default="exact")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens")
    parser.add_argument("--prompt", action="append", help="prompt text (checkpoints with a tokenizer); repeatable")
    parser.add_argument("--batch", type=int, default=2, help="random prompts (tiny models)")
    parser.add_argument("--prompt-length", type=int, default=12, help="tokens per random prompt")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def load(args: argparse.Namespace, device: torch.device):
    """``(model, tokenizer or None, description)``."""
    dtype = DTYPES[args.dtype]
    if args.checkpoint is None:
        model = tiny_model(args.family, dtype=dtype, device=device, seed=args.seed)
        return model, None, f"tiny random {args.family}"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, local_files_only=True).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer, args.checkpoint


def prompts_for(args: argparse.Namespace, tokenizer, vocab: int, rank: int, device: torch.device) -> torch.Tensor:
    """``[B, P]`` prompt ids: the given texts (left-padded), else random ids (different on every rank)."""
    if args.prompt and tokenizer is not None:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer(args.prompt, return_tensors="pt", padding=True).input_ids.to(device)
    if args.prompt:
        raise SystemExit("--prompt needs a checkpoint with a tokenizer")
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    return torch.randint(0, vocab, (args.batch, args.prompt_length), generator=generator).to(device)


def greedy(model, prompts: torch.Tensor, tokens: int, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(new tokens [B, tokens], logits [B, tokens, V])``; exactly ``tokens`` steps (every rank in lockstep)."""
    with torch.no_grad():
        out = model.generate(
            prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=pad_token_id,
            output_logits=True, return_dict_in_generate=True,
        )
    return out.sequences[:, prompts.shape[1]:], torch.stack(out.logits, 1).float()


def show(token: int, tokenizer) -> str:
    return repr(tokenizer.decode([token])) if tokenizer is not None else str(token)


def main() -> int:
    args = parse_args()
    distributed = args.transport != "local"
    if distributed:
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
        rank = dist.get_rank()
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if args.device.startswith("cuda") else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
    else:
        rank, device = 0, torch.device(args.device)
    prefix = f"[rank {rank}] " if distributed else ""

    model, tokenizer, description = load(args, device)
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    prompts = prompts_for(args, tokenizer, model.config.vocab_size, rank, device)
    unsharded, unsharded_logits = greedy(model, prompts, args.tokens, pad)

    group = init_group(process_group=None, transport=args.transport) if distributed else init_group(
        "local", ranks=args.ranks, device=device)
    summary = shard_moe(model, group, args.policy, capacity=prompts.numel(), record_routing=True)
    sharded, sharded_logits = greedy(model, prompts, args.tokens, pad)

    print(f"{prefix}{description}, {args.dtype} on {device}; FlatEP over {group.world} ranks ({args.transport}), "
          f"policy {args.policy}")
    print(f"{prefix}{summary}")
    layers = sharded_experts(model)
    names = [name.split(".mlp")[0].replace("model.layers.", "L") for name, _ in layers]
    print(f"{prefix}step  {'unsharded':>18}  {'sharded':>18}   maxvio per layer ({' '.join(names)})   "
          f"rank load max/mean-1: classic EP -> FlatEP (worst layer)")
    for step in range(args.tokens):
        before = " ".join(show(int(t), tokenizer) for t in unsharded[:, step])
        after = " ".join(show(int(t), tokenizer) for t in sharded[:, step])
        mark = "=" if torch.equal(unsharded[:, step], sharded[:, step]) else "!"
        maxvio = " ".join(f"{experts.maxvio(slice(step, step + 1))[0]:.2f}" for _, experts in layers)
        classic = max(experts.rank_imbalance(classic=True)[step] for _, experts in layers)
        flat = max(experts.rank_imbalance()[step] for _, experts in layers)
        print(f"{prefix}{step:4d}  {before:>18}  {after:>18} {mark} {maxvio:>24}   {classic:.2f} -> {flat:.2f}")
    equal = torch.equal(unsharded, sharded)
    first = next((step for step in range(args.tokens) if not torch.equal(unsharded[:, step], sharded[:, step])), args.tokens)
    diff = (sharded_logits[:, :first] - unsharded_logits[:, :first]).abs().max().item() if first else 0.0
    print(f"{prefix}greedy tokens {'equal' if equal else f'differ from step {first}'}; logits max |diff| {diff:.2e} "
          f"(up to the first differing step)")
    print(f"{prefix}maxvio over the whole run per layer: "
          + ", ".join(f"{name} {experts.maxvio(total=True)[0]:.2f}" for name, (_, experts) in zip(names, layers)))
    if tokenizer is not None:
        for row in range(prompts.shape[0]):
            print(f"{prefix}unsharded: {tokenizer.decode(unsharded[row])!r}\n{prefix}sharded:   {tokenizer.decode(sharded[row])!r}")
    group.close()  # before the process group goes: a group left open keeps it alive to the exit
    if distributed:
        dist.destroy_process_group()
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
