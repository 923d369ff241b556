#!/usr/bin/env bash
# One-off: the whole suite on the H200 (dedup fix included), then the comm-kernel tuning sweep at decode size.
source bench/scripts/gpu_env.sh
nvidia-smi -L > "$OUT/env.log" 2>&1
git log --oneline -1 >> "$OUT/env.log" 2>&1
PARTS=suite JOBS=12 timeout 470 bash bench/scripts/gpu_checks.sh > "$OUT/checks.log" 2>&1
echo "checks exit $?" >> "$OUT/checks.log"
timeout 100 python3 -m flatep.bench.kernels --model kimi-k2 --tokens 128 --out "$OUT/kernels-k2-s128.json" > "$OUT/kernels-k2-s128.log" 2>&1
echo "kernels exit $?" >> "$OUT/kernels-k2-s128.log"
