#!/usr/bin/env bash
# Result set: the fp8-activation mxfp4 prototype in one device call, each step within what is left of LIMIT seconds:
#   1. issue #15's Kimi-K3 cell with the prototype as the --against arm (quant_gemm_fp8mma.py) beside FlatEP's
#      kernels (experts_k3_mxfp4_decode.json, .log);
#   2. on an H200, issue #15's fp8 targets (bench/scripts/fp8_experts.sh, packed into fp8_targets.tgz);
#   3. checks.py: accuracy and per-GEMM timings (fp8mma.jsonl, fp8mma.log).
#   bash bench/scripts/fp8mma/run.sh           (from the repository root, on a Hopper GPU)
# Writes to $OUT (default ./bench-out), with smi.txt. Exit status 0 iff every step passed.
cd "$(dirname "$0")/../../.."
source bench/scripts/gpu_env.sh
nvidia-smi > "$OUT/smi.txt" 2>&1
status=0
left() { echo $(( ${LIMIT:-585} - SECONDS )); }
PARTS=mxfp4 AGAINST=bench/scripts/fp8mma/quant_gemm_fp8mma.py timeout "$(left)" bash bench/scripts/issue15_targets.sh \
  || status=1
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  targets=$(mktemp -d)
  OUT=$targets timeout $(( $(left) - ${CHECKS_SECONDS:-150} )) bash bench/scripts/fp8_experts.sh || status=1
  tar czf "$OUT/fp8_targets.tgz" -C "$targets" .
fi
timeout "$(left)" python3 bench/scripts/fp8mma/checks.py > "$OUT/fp8mma.log" 2>&1 || status=1
grep -v '"what": "accuracy"' "$OUT/fp8mma.log" | tail -40 | cut -c1-220
grep '"what": "accuracy"' "$OUT/fp8mma.log" | cut -c1-220
exit $status
