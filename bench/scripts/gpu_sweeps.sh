#!/usr/bin/env bash
# The Kimi-K2 and Kimi-K3 sweeps of bench/results/2026-12-02-h200-b/shared_slots (EP phases timed
# as CUDA-graph replays). Only the results.jsonl files come back ($OUT/kimi-k2.jsonl,
# $OUT/kimi-k3.jsonl); `flatep bench --report FILE` rebuilds the summary and plots from them.
# SWEEPS (default "k2 k3") names the configs bench/scripts/h200-$SWEEP.yaml to run.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
for model in ${SWEEPS:-k2 k3}; do
  timeout 200 python3 -m flatep bench bench/scripts/h200-$model.yaml --out /tmp/kimi-$model --quiet > "$OUT/kimi-$model.log" 2>&1
  echo "kimi-$model sweep exit $?"
  cp /tmp/kimi-$model/results.jsonl "$OUT/kimi-$model.jsonl"
done
