#!/usr/bin/env bash
# Result set: the fp8-activation mxfp4 prototype's checks and timings (checks.py) in one device call;
# on an H200, issue #15's targets (bench/scripts/issue15_targets.sh, into $OUT/targets.tgz) first.
#   bash bench/scripts/fp8mma/run.sh           (from the repository root, on a Hopper GPU)
# Writes to $OUT (default ./bench-out) fp8mma.jsonl, fp8mma.log and smi.txt. Exit status 0 iff all passed.
cd "$(dirname "$0")/../../.."
source bench/scripts/gpu_env.sh
nvidia-smi > "$OUT/smi.txt" 2>&1
status=0
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  targets=$(mktemp -d)
  OUT=$targets timeout "${TARGETS_LIMIT:-330}" bash bench/scripts/issue15_targets.sh > "$targets/targets.log" 2>&1 || status=1
  cat "$targets/targets.log"
  tar czf "$OUT/targets.tgz" -C "$targets" .
fi
timeout $(( ${LIMIT:-585} - SECONDS )) python3 bench/scripts/fp8mma/checks.py > "$OUT/fp8mma.log" 2>&1 || status=1
grep -v '"what": "accuracy"' "$OUT/fp8mma.log" | tail -45 | cut -c1-240
grep '"what": "accuracy"' "$OUT/fp8mma.log" | cut -c1-240
exit $status
