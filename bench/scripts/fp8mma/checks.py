"""The fp8-activation mxfp4 prototype (:mod:`mxfp4_fp8mma`) on a Hopper GPU: checked against a dense fp32
product, then timed against FlatEP's mxfp4 kernels on one Kimi-K3 rank's experts.

1. Accuracy: groups of 0-32 rows (and 0-16, 0-64 for those row tiles) over Kimi-K3's two K, each
   launch into a NaN-poisoned output: relative error (Frobenius) against ``rows @ W.T`` in fp32 over
   the dequantized weights, with FlatEP's default kernel beside it; the out-of-window flag on one
   scale byte past ``HIGH``.
2. Timing (CUDA-graph replays, interleaved, the read ceiling measured in the same run; the packed
   weight bytes, values and scales, counted once): 112 experts (gate/up N = 6144, K = 3584; down
   N = 3584, K = 3072) at 32 and 64 rows per expert, and a cell whose 28 MB of weights stay in the
   50 MB L2 (so the kernels' own work, not memory, bounds them): FlatEP's default tile
   (:func:`flatep.kernels.quant_gemm.default_config`) first, then the prototype's variants, then the
   activation split alone (torch and Triton). The prototype times exclude the split.

Scale bytes are drawn from ``LOW .. 128`` so that neither kernel needs its second pass.

    OUT=DIR python bench/scripts/fp8mma/checks.py        (from the repository root; writes DIR/fp8mma.jsonl)
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import mxfp4_fp8mma as fp8mma  # noqa: E402
from split import split_rows_triton  # noqa: E402

from flatep.bench.timing import device_name, read_ceiling_gbps, time_interleaved  # noqa: E402
from flatep.kernels.quant_gemm import default_config, mxfp4_grouped_mm_triton  # noqa: E402
from flatep.quant.mxfp4 import E2M1_VALUES, to_word_layout  # noqa: E402

DEVICE = torch.device("cuda")
CELLS = [(32, "w13", 6144, 3584, 112), (32, "w2", 3584, 3072, 112), (32, "l2-resident", 1024, 1024, 50),
         (64, "w13", 6144, 3584, 112), (64, "w2", 3584, 3072, 112)]
"""(rows per expert, GEMM, N, K, experts)."""
VARIANTS = {
    32: [dict(block_k=64, stages=6, check=True), dict(block_k=64, stages=6, check=False),
         dict(block_k=128, stages=4, check=True), dict(block_k=128, stages=4, check=False),
         dict(block_k=128, stages=3, check=False),
         dict(block_k=64, stages=6, check=False, programs_per_sm=4, max_registers=64)],
    64: [dict(block_m=64, block_k=64, stages=6, check=True), dict(block_m=64, block_k=128, stages=4, check=False),
         dict(block_m=64, block_k=128, stages=4, check=False, programs_per_sm=2, max_registers=128)],
}


def operands(experts: int, columns: int, inner: int, sizes: list[int], generator: torch.Generator,
             largest_scale: int = 128) -> tuple[torch.Tensor, ...]:
    """Random e2m1 codes ``[E, N, K]``, scales ``[E, K/32, N]`` (bytes ``LOW .. largest_scale``), the same
    weights in FlatEP's word layout and in the prototype's, group ends and bf16 rows."""
    codes = torch.randint(0, 16, (experts, columns, inner), dtype=torch.uint8, device=DEVICE, generator=generator)
    scales = torch.randint(fp8mma.LOW, largest_scale + 1, (experts, inner // 32, columns), dtype=torch.uint8,
                           device=DEVICE, generator=generator)
    checkpoint = codes[..., 0::2] | (codes[..., 1::2] << 4)
    words = torch.stack([to_word_layout(expert) for expert in checkpoint])
    mma_words = torch.stack([fp8mma.to_mma_words(expert) for expert in codes])
    offsets = torch.tensor(sizes, device=DEVICE).cumsum(0).to(torch.int32)
    rows = torch.randn(int(offsets[-1]), inner, device=DEVICE, generator=generator).to(torch.bfloat16)
    return codes, scales, words, mma_words, offsets, rows


def reference(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``rows @ W.T`` per group over the dequantized weights."""
    values = torch.tensor(E2M1_VALUES, device=DEVICE)
    out = torch.zeros(rows.shape[0], codes.shape[1], device=DEVICE)
    start = 0
    for expert, end in enumerate(offsets.tolist()):
        weight = values[codes[expert].long()] * torch.exp2(scales[expert].float().T - 127).repeat_interleave(32, 1)
        out[start:end] = rows[start:end].float() @ weight.T
        start = end
    return out


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected).norm() / expected.norm()).item()


def main() -> None:
    path = Path(os.environ.get("OUT", "."), "fp8mma.jsonl")
    log = path.open("a")

    def emit(**row) -> None:
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    generator = torch.Generator(device=DEVICE).manual_seed(1)
    emit(what="device", device=device_name(DEVICE))
    for block_m, tiles in ((32, [dict(block_k=64, stages=6), dict(block_k=128, stages=3)]), (16, [dict(block_k=64)]),
                           (64, [dict(block_k=64, stages=6), dict(block_k=128, stages=4)])):
        for columns, inner in ((384, 3584), (256, 3072)):
            sizes = torch.randint(0, block_m + 1, (12,), generator=torch.Generator().manual_seed(columns)).tolist()
            codes, scales, words, mma_words, offsets, rows = operands(12, columns, inner, sizes, generator)
            expected = reference(codes, scales, offsets, rows)
            hi_lo, factor = fp8mma.split_rows(rows)
            for tile in tiles:
                out = torch.full((rows.shape[0], columns), float("nan"), device=DEVICE, dtype=torch.bfloat16)
                flag = fp8mma.launch(hi_lo, factor, mma_words, scales, out, offsets, block_m=block_m, check=True,
                                     **tile)
                emit(what="accuracy", block_m=block_m, N=columns, K=inner, **tile, sizes=sizes,
                     relative_error=relative_error(out, expected), nan=int(out.isnan().sum()), flag=int(flag))
            out = torch.full((rows.shape[0], columns), float("nan"), device=DEVICE, dtype=torch.bfloat16)
            mxfp4_grouped_mm_triton(rows, words, scales.transpose(1, 2), offsets, out=out)
            emit(what="accuracy", arm="flatep default", block_m=block_m, N=columns, K=inner,
                 relative_error=relative_error(out, expected), nan=int(out.isnan().sum()))
    codes, scales, words, mma_words, offsets, rows = operands(4, 256, 3072, [32] * 4, generator)
    scales[2, 5, 7] = fp8mma.HIGH + 1
    hi_lo, factor = fp8mma.split_rows(rows)
    out = torch.empty(rows.shape[0], 256, device=DEVICE, dtype=torch.bfloat16)
    emit(what="flag past HIGH", flag=int(fp8mma.launch(hi_lo, factor, mma_words, scales, out, offsets, check=True)))

    ceiling = read_ceiling_gbps(DEVICE)
    emit(what="read ceiling", gbps=ceiling)
    for rows_per_expert, gemm, columns, inner, experts in CELLS:
        codes, scales, words, mma_words, offsets, rows = operands(experts, columns, inner, [rows_per_expert] * experts,
                                                                  generator)
        del codes
        hi_lo, factor = fp8mma.split_rows(rows)
        triton_hi_lo, triton_factor = split_rows_triton(rows, fp8mma.CENTER)
        emit(what="split: triton against torch", same_bits=bool(torch.equal(triton_hi_lo.view(torch.uint8),
                                                                            hi_lo.view(torch.uint8))),
             bytes_apart=int((triton_hi_lo.view(torch.uint8) != hi_lo.view(torch.uint8)).sum()),
             same_factor=bool(torch.equal(triton_factor, factor)))
        config = default_config(rows.shape[0], experts, "mxfp4", DEVICE)
        arms = [(f"flatep {config.label}", lambda out, config=config: mxfp4_grouped_mm_triton(
            rows, words, scales.transpose(1, 2), offsets, config=config, out=out))]
        for variant in VARIANTS[rows_per_expert]:
            arms.append((f"fp8mma {variant}", lambda out, variant=variant: fp8mma.launch(
                hi_lo, factor, mma_words, scales, out, offsets, **variant)))
        arms.append(("split (torch)", lambda out: fp8mma.split_rows(rows)))
        arms.append(("split (triton)", lambda out: split_rows_triton(rows, fp8mma.CENTER)))
        outputs = [torch.full((rows.shape[0], columns), float("nan"), device=DEVICE, dtype=torch.bfloat16)
                   for _ in arms]
        for (_, run), out in zip(arms, outputs):
            run(out)
        timings = time_interleaved([lambda run=run, out=out: run(out) for (_, run), out in zip(arms, outputs)],
                                   DEVICE, warmup=1, iters=8, graph=True, calls=5)
        weight_bytes = experts * columns * (inner // 2 + inner // 32)
        for (label, _), timing in zip(arms, timings):
            emit(what="time", gemm=gemm, rows_per_expert=rows_per_expert, arm=label, us=round(timing.median, 1),
                 read_fraction=round(weight_bytes / timing.median / 1e3 / ceiling, 3))


if __name__ == "__main__":
    main()
