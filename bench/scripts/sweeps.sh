#!/usr/bin/env bash
# Result set: the Kimi-K2 (fp8) and Kimi-K3 (mxfp4) sweeps on one GPU (R=8 virtual ranks, arms
# flat / classic / auto interleaved cell by cell, auto deciding with the h200 cost profile; 5 token
# sizes x 4 maxvio targets = 60 cells per model; 10 timed iterations per phase as CUDA-graph
# replays, per-rank link bytes, the labelled link model, and per cell the plan chosen with the cost
# model's prediction and error).
#   bash bench/scripts/sweeps.sh [k2] [k3]        (from the repository root; default: both)
# Runs `flatep bench bench/scripts/h200-<model>.yaml` for each and writes
# $OUT/kimi-<model>/{results.jsonl,summary.md,*.png} and $OUT/kimi-<model>.log (OUT defaults to
# ./bench-out). SWEEP_TIMEOUT (seconds, default 1800) bounds each sweep; `--resume` continues
# a sweep that was cut: run the same command again.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(k2 k3)
status=0
for model in "${models[@]}"; do
  timeout "${SWEEP_TIMEOUT:-1800}" python3 -m flatep bench "bench/scripts/h200-$model.yaml" --out "$OUT/kimi-$model" \
    --resume --quiet > "$OUT/kimi-$model.log" 2>&1
  code=$?
  echo "kimi-$model sweep: exit $code, $(wc -l < "$OUT/kimi-$model/results.jsonl" 2>/dev/null || echo 0) cells"
  [ $code -eq 0 ] || status=1
done
exit $status
