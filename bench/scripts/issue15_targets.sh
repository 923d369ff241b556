#!/usr/bin/env bash
# Result set: issue #15's experts-phase timing targets on one GPU, each against bf16 in the same run
# (python -m flatep.bench.experts_phase: every rank's experts phase, the packed pool and its bf16
# twin, the slowest rank's time beside the device's read ceiling measured in the run):
#   - Kimi-K2 fp8 at s = 8192 and s = 128, maxvio 0 and 10, bf16 and fp8 dispatch (fp8_experts.sh);
#   - Kimi-K3 mxfp4 at s = 128, maxvio 0 and 10 (with the slowest rank's time per kernel, and the
#     GEMMs' launches one after another as the in_turn variant beside the default side by side), then
#     the same cell with fp8 activations (FLATEP_MXFP4_FP8_ACTIVATIONS=1: pools in the mma layout).
#   bash bench/scripts/issue15_targets.sh          (from the repository root, on a GPU)
#   PARTS=mxfp4 bash bench/scripts/issue15_targets.sh     (one part: fp8 or mxfp4)
#   AGAINST=REV bash bench/scripts/issue15_targets.sh     (the Kimi-K3 cells also time the mxfp4 GEMMs of
#       git revision REV with its flatep/kernels/, or of a copy of that directory, or of a copy of
#       its quant_gemm.py alone, as the "against" arm)
# Writes to $OUT (default ./bench-out) fp8_experts.sh's files, experts_k3_mxfp4_decode.json, .log and
# experts_k3_mxfp4_fp8_activations.json, .log.
# Exit status 0 iff every step passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
for name in ${PARTS:-fp8 mxfp4}; do
  [[ " fp8 mxfp4 " == *" $name "* ]] || { echo "PARTS takes fp8 and mxfp4, got '$name'" >&2; exit 2; }
done
status=0
if [[ " ${PARTS:-fp8 mxfp4} " == *" fp8 "* ]]; then
  bash bench/scripts/fp8_experts.sh || status=1
fi
[[ " ${PARTS:-fp8 mxfp4} " == *" mxfp4 "* ]] || exit $status
python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 128 --maxvio 0 10 --profile \
  --in-turn ${AGAINST:+--against "$AGAINST"} --out "$OUT/experts_k3_mxfp4_decode.json" > "$OUT/experts_k3_mxfp4_decode.log" 2>&1
code=$?
echo "experts_k3_mxfp4_decode: exit $code"
grep "slowest rank" "$OUT/experts_k3_mxfp4_decode.log"
[ $code -eq 0 ] || status=1
FLATEP_MXFP4_FP8_ACTIVATIONS=1 python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml \
  --tokens 128 --maxvio 0 10 --profile ${AGAINST:+--against "$AGAINST"} \
  --out "$OUT/experts_k3_mxfp4_fp8_activations.json" \
  > "$OUT/experts_k3_mxfp4_fp8_activations.log" 2>&1
code=$?
echo "experts_k3_mxfp4_fp8_activations: exit $code"
grep "slowest rank" "$OUT/experts_k3_mxfp4_fp8_activations.log"
[ $code -eq 0 ] || status=1
exit $status
