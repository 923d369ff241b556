#!/usr/bin/env bash
# Result set: a packed GEMM's launches side by side on CUDA streams (flatep.kernels.streams, the
# default) against one after another on one stream, interleaved replay by replay in the same run
# (python -m flatep.bench.experts_phase --in-turn: every rank's experts phase, the slowest rank's
# time beside the bf16 pool's and the device's read ceiling measured in the run):
#   - Kimi-K3 mxfp4 at s = 32 and 128, maxvio 0 and 10 (three launches: 16-, 32- and 64-row tiles);
#   - Kimi-K2 fp8 at s = 128, maxvio 0 and 10 (two launches: short tiles, and tall ones for hot groups).
#   bash bench/scripts/launches_side_by_side.sh          (from the repository root, on a GPU)
# Writes to $OUT (default ./bench-out): experts_k3_mxfp4_decode.json and experts_k2_fp8_decode.json,
# each with its .log.
# Exit status 0 iff both runs passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
status=0
run() {  # run NAME CONFIG ARGS...: the experts phase with the in_turn variant into $OUT/NAME.json, its log in $OUT/NAME.log
  local name=$1
  shift
  python3 -m flatep.bench.experts_phase "$@" --in-turn --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code"
  grep "slowest rank" "$OUT/$name.log"
  [ $code -eq 0 ] || status=1
}
run experts_k3_mxfp4_decode bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 32 128 --maxvio 0 10
run experts_k2_fp8_decode bench/scripts/h200-decode-k2-fp8.yaml --tokens 128 --maxvio 0 10
exit $status
