#!/usr/bin/env bash
# Result set: decode steps on one GPU (R=8 virtual ranks, bf16 weights, CUDA-graph timing, ten copies of each phase per graph), Kimi-K2
# and Kimi-K3, s in {1, 8, 32, 64, 128} x maxvio {0, 2, 10}, flat / classic / auto, each with dedup
# off (the default) and on (bench/scripts/h200-decode-<model>[-dedup].yaml).
#   bash bench/scripts/decode.sh [k2] [k3]        (from the repository root; default: both)
# auto decides with the cost profile PROFILE_DIR/profile-kimi-<model>.json when it exists (a
# `flatep calibrate --model kimi-<model> --out ...` of the same GPU), else with the h200 preset.
# Writes $OUT/decode-<model>[-dedup]/{results.jsonl,summary.md,*.png} and $OUT/decode-<model>[-dedup].log
# (OUT defaults to ./bench-out). SWEEP_TIMEOUT (seconds, default 900) bounds each sweep; a sweep
# that was cut continues (--resume) when the same command runs again.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(k2 k3)
status=0
for model in "${models[@]}"; do
  profile="${PROFILE_DIR:-bench/results/2026-12-03-h200-c}/profile-kimi-$model.json"
  cost=()
  [ -f "$profile" ] && cost=(--cost "$profile")
  for variant in "" "-dedup"; do
    name="decode-$model$variant"
    bench_sweep "$name" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" "${cost[@]}" || status=1
  done
done
exit $status
