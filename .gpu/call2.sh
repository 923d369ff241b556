#!/usr/bin/env bash
source bench/scripts/gpu_env.sh
git log --oneline -1 > "$OUT/env.log" 2>&1
timeout 60 python3 -m flatep.bench.kernels --model kimi-k2 --tokens 128 --out "$OUT/kernels-k2-s128-parts.json" > "$OUT/kernels-k2-s128-parts.log" 2>&1
SWEEP_TIMEOUT=250 bash bench/scripts/decode.sh k2 > "$OUT/decode-driver.log" 2>&1
cd "$OUT" && tar czf decode-k2.tgz decode-k2 decode-k2-dedup decode-k2.log decode-k2-dedup.log && rm -rf decode-k2 decode-k2-dedup decode-k2.log decode-k2-dedup.log
