#!/usr/bin/env bash
# Result set: the Kimi-K2 and Kimi-K3 sweeps (bf16 weights; see the yaml files) on one GPU (R=8 virtual ranks, arms
# flat / classic / auto interleaved cell by cell, auto deciding with the profile calibrated first; 5 token
# sizes x 4 maxvio targets = 60 cells per model; 20 timed iterations per phase as CUDA-graph
# replays, per-rank link bytes, the labelled link model, and per cell the plan chosen with the cost
# model's prediction and error).
#   bash bench/scripts/sweeps.sh [k2] [k3]        (from the repository root; default: both)
# Calibrates a cost profile (`flatep calibrate --model kimi-<model> --link local`: the virtual ranks share
# one GPU, so their link is a copy within it; $OUT/profile-kimi-<model>.json),
# then runs `flatep bench bench/scripts/h200-<model>.yaml --cost` that profile for each and writes
# $OUT/kimi-<model>/{results.jsonl,summary.md,*.png} and $OUT/kimi-<model>.log (OUT defaults to
# ./bench-out). SWEEP_TIMEOUT (seconds, default 1800) bounds each sweep; `--resume` continues
# a sweep that was cut: run the same command again. WEIGHTS=fp8 or WEIGHTS=mxfp4 runs the sweep with
# packed experts and calibrates the profile on them (`--weights`; the files then end in -<weights>).
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
models=("$@")
[ ${#models[@]} -eq 0 ] && models=(k2 k3)
status=0
for model in "${models[@]}"; do
  # The profile auto decides with: measured here first (grouped GEMMs at the model's shapes, HBM
  # read, a copy within the GPU as the virtual ranks' link), kept across a resumed sweep so that its
  # rows agree. A profile already in $OUT is used as it is.
  weights=${WEIGHTS:-bf16}
  name="kimi-$model"
  [ "$weights" = bf16 ] || name="$name-$weights"
  profile="$OUT/profile-$name.json"
  [ -f "$profile" ] || timeout 240 python3 -m flatep calibrate --model "kimi-$model" --link local --weights "$weights" --out "$profile" > "$OUT/calibrate-$name.log" 2>&1
  bench_sweep "$name" "bench/scripts/h200-$model.yaml" "${SWEEP_TIMEOUT:-1800}" --cost "$profile" --weights "$weights" || status=1
done
exit $status
