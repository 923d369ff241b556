#!/usr/bin/env bash
# Result set: a Kimi-K2 rank's fp8 experts against bf16 on one GPU (python -m flatep.bench.experts_phase:
# every rank's experts phase, the packed pool and its bf16 twin in the same run, the slowest rank's
# time beside the device's read ceiling measured in the run), at decode (s = 128) and prefill
# (s = 8192), maxvio 0 and 10, classic arm; each with the packed pool's rows dispatched in bf16
# (the experts quantize them) and in fp8 (quantized per token before dispatch, as
# ep_moe(dispatch_dtype=torch.float8_e4m3fn) runs; the bf16 pool keeps bf16 rows), with each
# variant's dispatch step timed beside it.
#   bash bench/scripts/fp8_experts.sh          (from the repository root, on a GPU)
# Writes to $OUT (default ./bench-out), each with its .log:
#   experts_k2_fp8_prefill.json, experts_k2_fp8_prefill_fp8_dispatch.json   s = 8192 (with --profile)
#   experts_k2_fp8_decode.json, experts_k2_fp8_decode_fp8_dispatch.json     s = 128
# Exit status 0 iff every step passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
status=0
step() {  # step NAME ARGS...: python -m flatep.bench.experts_phase ARGS into $OUT/NAME.json, its log in $OUT/NAME.log
  local name=$1
  shift
  python3 -m flatep.bench.experts_phase "$@" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code"
  grep "slowest rank" "$OUT/$name.log"
  [ $code -eq 0 ] || status=1
}
prefill=(bench/scripts/h200-prefill-k2-fp8.yaml --maxvio 0 10 --profile)
decode=(bench/scripts/h200-decode-k2-fp8.yaml --tokens 128 --maxvio 0 10)
step experts_k2_fp8_prefill "${prefill[@]}"
step experts_k2_fp8_prefill_fp8_dispatch "${prefill[@]}" --dispatch fp8
step experts_k2_fp8_decode "${decode[@]}"
step experts_k2_fp8_decode_fp8_dispatch "${decode[@]}" --dispatch fp8
exit $status
