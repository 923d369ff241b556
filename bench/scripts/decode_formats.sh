#!/usr/bin/env bash
# Result set: decode steps on one GPU with the arms interleaved (R=8 virtual ranks, CUDA-graph
# timing, ten copies of each phase per graph): Kimi-K2 and Kimi-K3 in bf16
# (bench/scripts/h200-decode-<model>.yaml: s in {1, 8, 32, 64, 128} x maxvio {0, 2, 10}, flat /
# classic / auto), then Kimi-K2 in FP8 (h200-decode-k2-fp8.yaml: s in {32, 128} x maxvio {0, 10},
# flat / classic) and the same cells in bf16 (`--weights bf16`: decode-k2-fp8-as-bf16), so that
# the fp8 experts are timed in the same run as the bf16 ones, and the fp8 cells again with fp8
# dispatch (`--dispatch fp8`: decode-k2-fp8-dispatch, where the fp8 experts read the packed rows as
# they arrive); then Kimi-K3 in MXFP4 and bf16 alike
# (h200-decode-k3-mxfp4.yaml: decode-k3-mxfp4, decode-k3-mxfp4-as-bf16).
#   bash bench/scripts/decode_formats.sh        (from the repository root)
# auto decides with the profiles PROFILE_DIR/profile-kimi-<model>.json (default: those the
# 2026-12-04-h200-d sweeps calibrated (planned steps, --link local) on an H200). Writes $OUT/decode-k2, decode-k3,
# decode-k2-fp8, decode-k2-fp8-as-bf16, decode-k2-fp8-dispatch, decode-k3-mxfp4, decode-k3-mxfp4-as-bf16 (results.jsonl, summary.md,
# plots) and their .log files (OUT defaults to ./bench-out). FORMATS_ONLY=1 runs the five packed-format sweeps only. SWEEP_TIMEOUT (seconds, default 900) bounds each sweep; run the same command again
# to continue a cut one (--resume).
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
profiles="${PROFILE_DIR:-bench/results/2026-12-04-h200-d}"
status=0
names="decode-k2 decode-k3 decode-k2-fp8 decode-k3-mxfp4"
[ "${FORMATS_ONLY:-0}" = 1 ] && names="decode-k2-fp8 decode-k3-mxfp4"
for name in $names; do
  model=${name#decode-}
  model=${model%-*}
  bench_sweep "$name" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" --cost "$profiles/profile-kimi-$model.json" || status=1
  if [ "$name" != "${name%-fp8}" ] || [ "$name" != "${name%-mxfp4}" ]; then
    bench_sweep "$name-as-bf16" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" --weights bf16 \
      --cost "$profiles/profile-kimi-$model.json" || status=1
  fi
  if [ "$name" = decode-k2-fp8 ]; then
    bench_sweep "$name-dispatch" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" --dispatch fp8 \
      --cost "$profiles/profile-kimi-$model.json" || status=1
  fi
done
exit $status
