#!/usr/bin/env bash
# Result set: a rank's packed experts against bf16 on one GPU, without the layer around them
# (python -m flatep.bench.experts_phase: every rank's experts phase of a sweep config's cells, the
# packed pool and its bf16 twin in the same run, the slowest rank's time reported beside the
# device's read ceiling measured in the run), and cuBLAS's block-scaled fp8 GEMM as a reference.
#   bash bench/scripts/packed_experts.sh                      (from the repository root)
#   AGAINST=qg_old.py bash bench/scripts/packed_experts.sh    (also time another copy of
#                      flatep/kernels/quant_gemm.py in every experts-phase cell, interleaved with
#                      this tree's, e.g. `git show REV:flatep/kernels/quant_gemm.py > qg_old.py`)
# Writes to $OUT (default ./bench-out), each with its .log:
#   experts_k3_mxfp4_ab.json    Kimi-K3 decode (mxfp4), s in {32, 128}, maxvio {0, 10}, classic
#   experts_k2_fp8.json         Kimi-K2 decode (fp8), the same cells
#                               (both with per-kernel times of the slowest rank, --profile)
#   experts_k2_fp8_prefill.json, experts_k3_mxfp4_prefill.json   s = 8192, maxvio 0
#   fp8_blockwise_cublas.log    bench/scripts/fp8_blockwise_cublas.py
#   act_quant_launch.log        bench/scripts/act_quant_launch.py
#   quant_quick_fp8.json        python -m flatep.quant.bench --quick: every fp8 tile candidate at
#                               21 rows per expert (Kimi-K2 decode, s = 128) and 1024 (prefill)
#   quant_quick_mxfp4.json      the same for every mxfp4 tile candidate at 16 and 32 rows per
#                               expert (Kimi-K3 decode: the 16- and 32-row launches' groups)
# Exit status 0 iff every step passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
status=0
step() {  # step NAME COMMAND...: run with its log in $OUT/NAME.log, report its exit status
  local name=$1
  shift
  "$@" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code"
  [ $code -eq 0 ] || status=1
}
against=(${AGAINST:+--against "$AGAINST"})
step experts_k3_mxfp4_ab python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml \
  "${against[@]}" --profile --out "$OUT/experts_k3_mxfp4_ab.json"
step experts_k2_fp8 python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k2-fp8.yaml \
  "${against[@]}" --profile --out "$OUT/experts_k2_fp8.json"
step fp8_blockwise_cublas python3 bench/scripts/fp8_blockwise_cublas.py
step experts_k2_fp8_prefill python3 -m flatep.bench.experts_phase bench/scripts/h200-prefill-k2-fp8.yaml \
  "${against[@]}" --maxvio 0 --out "$OUT/experts_k2_fp8_prefill.json"
step experts_k3_mxfp4_prefill python3 -m flatep.bench.experts_phase bench/scripts/h200-prefill-k3-mxfp4.yaml \
  --maxvio 0 --out "$OUT/experts_k3_mxfp4_prefill.json"
step act_quant_launch python3 bench/scripts/act_quant_launch.py
step quant_quick_fp8 python3 -m flatep.quant.bench --quick --budget 90 --formats fp8 --rows 21 1024 \
  --out "$OUT/quant_quick_fp8.json"
step quant_quick_mxfp4 python3 -m flatep.quant.bench --quick --budget 160 --formats mxfp4 --rows 16 32 \
  --out "$OUT/quant_quick_mxfp4.json"
exit $status
