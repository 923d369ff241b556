"""Train a tiny torchtitan Qwen3-MoE with FlatEP's expert parallelism and without, and compare the losses.

Both models start from the same seed and see the same batches (a fixed random Markov chain over
the vocabulary), trained by the same plain AdamW loop on the CPU (or a GPU: ``--device cuda``). The
FlatEP model is torchtitan's model switched by :func:`flatep.integrations.torchtitan.apply_flatep`
over ``--ranks`` virtual ranks of the local transport. Two comparisons:

- ``fp32``: FlatEP with ``expert_dtype=None`` against torchtitan's model whose routed experts compute
  in fp32 (:class:`flatep.integrations.tiny_torchtitan.ModelDtypeGroupedExperts`: torchtitan's
  ``GroupedExperts`` without its bfloat16 casts; router, dispatcher and combine are torchtitan's);
- ``bf16``: FlatEP with its default ``expert_dtype=torch.bfloat16`` against torchtitan's stock
  model, whose ``GroupedExperts`` runs forward and backward in bfloat16 (FlatEP's backward is fp32).

Writes ``losses.json`` (every curve, the sizes, the largest differences) and ``losses.png`` to ``--out``.

``--device cuda`` trains the same models on a GPU (the virtual ranks share it). torchtitan 0.3.0
imports ``torch.distributed.fsdp.DataParallelMeshDims`` when its Qwen3 package loads, for its FSDP
wrapping, and torch 2.11 does not have that name. On such a torch this script defines an empty
class under that name before it imports torchtitan, says so on stdout and in ``losses.json``
(``torch_compat``). No code that runs here uses it: the models are built by torchtitan's classes,
not wrapped by its FSDP.

Examples::

    python examples/torchtitan_train.py --steps 50 --policy exact --ranks 4 --out bench/results/torchtitan-cpu
    python examples/torchtitan_train.py --steps 50 --policy exact --ranks 8 --device cuda --out bench/results/torchtitan-h200
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.fsdp

import flatep


def define_missing_fsdp_mesh_dims() -> str | None:
    """Let torchtitan 0.3.0 import on a torch without ``torch.distributed.fsdp.DataParallelMeshDims``.

    Returns a description of what was defined, or ``None`` where torch has the name.
    """
    if hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        return None
    torch.distributed.fsdp.DataParallelMeshDims = type("DataParallelMeshDims", (), {})
    note = (f"torch {torch.__version__} has no torch.distributed.fsdp.DataParallelMeshDims: an empty class "
            "was defined under that name so that torchtitan imports (used only by its FSDP wrapping, not run here)")
    print(note)
    return note


TORCH_COMPAT = define_missing_fsdp_mesh_dims()

from flatep.integrations.tiny_torchtitan import TinyQwen3MoE, markov_batches, tiny_qwen3_moe, train  # noqa: E402
from flatep.integrations.torchtitan import apply_flatep  # noqa: E402

# torchtitan's router asks for fp32 autocast, which the CPU cannot do (it computes in fp32 anyway).
warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="training steps (one batch each)")
    parser.add_argument("--policy", choices=flatep.config.POLICIES, default="exact", help="FlatEP's planning policy")
    parser.add_argument("--ranks", type=int, default=4, help="virtual EP ranks of the local transport (divides 8)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and of the data")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models train")
    parser.add_argument("--out", type=Path, required=True, help="folder for losses.json and losses.png")
    return parser.parse_args()


def relative_differences(reference: list[float], other: list[float]) -> list[float]:
    return [abs(a - b) / abs(a) for a, b in zip(reference, other)]


def run(args: argparse.Namespace) -> dict:
    """Train the four models; their loss curves and the largest relative differences per comparison."""
    sizes = TinyQwen3MoE()
    batches = [batch.to(args.device) for batch in markov_batches(args.steps, args.batch, args.seq, sizes.vocab, seed=args.seed)]
    group = flatep.init_group("local", ranks=args.ranks, device=args.device)
    curves, seconds = {}, {}
    for name, bf16_experts, flat, expert_dtype in (
        ("torchtitan_fp32_experts", False, False, None),
        ("flatep_fp32_experts", True, True, None),
        ("torchtitan", True, False, None),
        ("flatep_bf16_experts", True, True, torch.bfloat16),
    ):
        model = tiny_qwen3_moe(sizes, seed=args.seed, bf16_experts=bf16_experts).to(args.device)
        if flat:
            apply_flatep(model, group, args.policy, expert_dtype=expert_dtype)
        start = time.perf_counter()
        curves[name] = train(model, batches, lr=args.lr)
        seconds[name] = round(time.perf_counter() - start, 2)
        print(f"{name:24s} first loss {curves[name][0]:.6f}  last {curves[name][-1]:.6f}  ({seconds[name]} s)")
    comparisons = {
        "fp32": relative_differences(curves["torchtitan_fp32_experts"], curves["flatep_fp32_experts"]),
        "bf16": relative_differences(curves["torchtitan"], curves["flatep_bf16_experts"]),
    }
    for name, differences in comparisons.items():
        print(f"{name}: largest relative loss difference {max(differences):.3e} (step {differences.index(max(differences))})")
    return {
        "model": {"flavour": "torchtitan Qwen3Model (MoE)", **dataclasses.asdict(sizes)},
        "training": {"steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr, "seed": args.seed,
                     "optimizer": "AdamW(weight_decay=0, foreach=False)", "dtype": "float32 parameters"},
        "flatep": {"policy": args.policy, "ranks": args.ranks, "transport": "local"},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "versions": {"torch": torch.__version__, "torchtitan": _torchtitan_version()},
        "torch_compat": TORCH_COMPAT,
        "losses": curves,
        "seconds": seconds,
        "relative_difference": comparisons,
        "max_relative_difference": {name: max(values) for name, values in comparisons.items()},
    }


def _torchtitan_version() -> str:
    from importlib.metadata import version

    return version("torchtitan")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses, differences = result["losses"], result["relative_difference"]
    steps = range(1, len(losses["torchtitan"]) + 1)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    top.plot(steps, losses["torchtitan_fp32_experts"], label="torchtitan, fp32 experts", lw=3, alpha=0.5)
    top.plot(steps, losses["flatep_fp32_experts"], "--", label=f"FlatEP, fp32 experts ({result['flatep']['ranks']} ranks)")
    top.plot(steps, losses["torchtitan"], label="torchtitan stock (bf16 experts)", lw=3, alpha=0.5)
    top.plot(steps, losses["flatep_bf16_experts"], ":", label="FlatEP, bf16 experts")
    top.set_ylabel("training loss")
    top.set_title(f"tiny torchtitan Qwen3-MoE on {result['device']}, FlatEP policy={result['flatep']['policy']!r}")
    top.legend()
    floor = 1e-9  # equal losses plot at the floor of the log axis
    bottom.semilogy(steps, [max(d, floor) for d in differences["fp32"]], label="fp32: |FlatEP - torchtitan| / torchtitan")
    bottom.semilogy(steps, [max(d, floor) for d in differences["bf16"]], label="bf16: |FlatEP - torchtitan| / torchtitan")
    bottom.set_xlabel("step")
    bottom.set_ylabel("relative loss difference")
    bottom.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS's deterministic mode needs it
    torch.use_deterministic_algorithms(True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (args.out / "losses.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "losses.png")
    print(f"wrote {args.out / 'losses.json'} and {args.out / 'losses.png'}")


if __name__ == "__main__":
    main()
