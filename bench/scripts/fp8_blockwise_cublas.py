"""Result set: can cuBLAS's block-scaled fp8 GEMM (``torch._scaled_mm`` with 1x128 activation and
128x128 weight scales, the checkpoints' own layout) do a Kimi-K2 rank's expert GEMMs faster than
FlatEP's Triton fp8 kernel, on one GPU?

One rank's 48 Kimi-K2 experts (H = 7168, I = 2048) at 128 and 1024 rows per expert, each GEMM
(gate/up ``[rows, H] -> [rows, 2I]``, down ``[rows, I] -> [rows, H]``) timed as a CUDA graph of two
calls (flatep.bench.timing.time_us, median of 10 replays), arms side by side in the same run:

- ``bf16``: ``torch._grouped_mm`` over the bf16 weights (the baseline);
- ``flatep``: ``flatep.kernels.quant_gemm.fp8_grouped_mm_triton`` (default tiles; its activation
  quantization included);
- ``cublas loop``: the same activation quantization, then one ``torch._scaled_mm`` per expert with
  block scales. The group sizes are Python ints here; a layer knows them only on the device, so this
  arm would need a host sync per step and is a reference point, not a FlatEP path;
- ``cublas dense``: one ``torch._scaled_mm`` over all rows with row-wise scales (one weight, the same
  FLOPs): the speed cuBLAS fp8 reaches at this size, the ceiling the grouped arms are read against.

Bytes are not the bound here (1024 rows per expert is compute bound); each line prints TFLOP/s
(2 x rows x N x K per GEMM). Each packed arm's output is checked against the torch reference of
the block-scaled product first (relative error printed); an arm the build lacks prints its error.
    python3 bench/scripts/fp8_blockwise_cublas.py        (from the repository root, on a GPU)
"""
import torch

from flatep.bench.timing import time_us
from flatep.experts.grouped import quantized_grouped_mm
from flatep.kernels.fp8_activations import quantize_fp8_activations_triton
from flatep.kernels.quant_gemm import fp8_grouped_mm_triton
from flatep.quant.bench import model_weights
from flatep.quant.tensor import QuantizedTensor

device = torch.device("cuda")
torch.manual_seed(0)


def cublas_loop(rows: torch.Tensor, packed: QuantizedTensor, per_expert: int):
    def call() -> torch.Tensor:
        end = torch.full((1,), rows.shape[0], dtype=torch.int32, device=device)
        values, scales = quantize_fp8_activations_triton(rows, end)
        outs = []
        for expert in range(packed.values.shape[0]):
            start = expert * per_expert
            # 1x128 scales must be [m, K/128] with strides (1, m); 128x128 ones [K/128, N/128] for mat2 = W.T.
            expert_scales = scales[start:start + per_expert].t().contiguous().t()
            outs.append(torch._scaled_mm(values[start:start + per_expert], packed.values[expert].t(), expert_scales,
                                         packed.scales[expert].t(), out_dtype=torch.bfloat16))
        return torch.cat(outs)
    return call


def cublas_dense(rows: torch.Tensor, weight: torch.Tensor):
    row_scales = rows.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    row_values = (rows.float() / row_scales).to(torch.float8_e4m3fn)
    weight_scales = weight.float().abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    weight_values = (weight.float() / weight_scales).to(torch.float8_e4m3fn)
    return lambda: torch._scaled_mm(row_values, weight_values.t(), row_scales, weight_scales.t(), out_dtype=torch.bfloat16)


HIDDEN, INTERMEDIATE, EXPERTS, w13, w2, q13, q2 = model_weights("kimi-k2", "fp8", device)
print(torch.__version__, torch.cuda.get_device_name(), flush=True)
for per_expert in (128, 1024):
    rows_total = EXPERTS * per_expert
    offsets = (torch.arange(1, EXPERTS + 1, device=device) * per_expert).to(torch.int32)
    for gemm, inner, plain, packed in (("w13", HIDDEN, w13, q13), ("w2", INTERMEDIATE, w2, q2)):
        rows = torch.randn(rows_total, inner, device=device).bfloat16()
        reference = quantized_grouped_mm(rows, packed, offsets, backend="torch").float()
        flops = 2 * rows_total * plain.shape[1] * inner
        arms = {
            "bf16": lambda: torch._grouped_mm(rows, plain.transpose(-2, -1), offs=offsets),
            "flatep": lambda: fp8_grouped_mm_triton(rows, packed.values, packed.scales, offsets),
            "cublas loop": cublas_loop(rows, packed, per_expert),
            "cublas dense": cublas_dense(rows, plain[0]),
        }
        line, bf16_us = [], None
        for name, call in arms.items():
            try:
                out = call()
                error = "" if name in ("bf16", "cublas dense") else \
                    f", rel err {float((out.float() - reference).norm() / reference.norm()):.1e}"
                us = time_us(call, device, warmup=1, iters=10, graph=True, calls=2)
            except (RuntimeError, TypeError, NotImplementedError) as failure:
                line.append(f"{name}: failed ({str(failure).splitlines()[0][:200]})")
                continue
            bf16_us = bf16_us or us
            line.append(f"{name} {us:.0f} us ({us / bf16_us:.2f}x, {flops / us / 1e6:.0f} TFLOP/s{error})")
        print(f"rows/expert {per_expert} {gemm}: " + "; ".join(line), flush=True)
