#!/usr/bin/env bash
# One device call: planner benchmark, NVLink transport on a shared GPU, transformers models, sweeps.
source bench/scripts/gpu_env.sh
export PYTHONPATH
( timeout 80 python3 -m flatep.bench.planner --out "$OUT/planner.json" 2>&1 | tail -40 ) > "$OUT/planner.log"
( timeout 90 bash bench/scripts/nvlink_shared_gpu.sh 2>&1 | tail -30 ) > "$OUT/nvlink_driver.log"
( timeout 70 python3 bench/scripts/transformers_gpu.py 2>&1 | tail -30 ) > "$OUT/transformers_driver.log"
timeout 170 python3 -m flatep bench bench/scripts/h200-k2.yaml --out "$OUT/k2" --quiet > /dev/null 2>&1
timeout 130 python3 -m flatep bench bench/scripts/h200-k3.yaml --out "$OUT/k3" --quiet > /dev/null 2>&1
rm -f "$OUT"/k2/*.png "$OUT"/k3/*.png "$OUT"/k2/summary.md "$OUT"/k3/summary.md
tail -5 "$OUT/planner.log" "$OUT/nvlink_driver.log" "$OUT/transformers_driver.log"; wc -l "$OUT"/k2/results.jsonl "$OUT"/k3/results.jsonl; ls -R "$OUT"
