#!/usr/bin/env bash
# Result set: prefill steps on one GPU with packed experts and their bf16 twins (R=8 virtual ranks,
# s = 8192, maxvio {0, 10}, flat / classic): Kimi-K2 in FP8 (h200-prefill-k2-fp8.yaml) and Kimi-K3
# in MXFP4 (h200-prefill-k3-mxfp4.yaml), each sweep followed by the same cells with
# `--weights bf16` (prefill-<model>-<format>-as-bf16), so that the packed experts are timed in the
# same run as the bf16 ones.
#   bash bench/scripts/prefill_formats.sh        (from the repository root)
# Writes $OUT/prefill-k2-fp8, prefill-k2-fp8-as-bf16, prefill-k3-mxfp4, prefill-k3-mxfp4-as-bf16
# (results.jsonl, summary.md, plots) and their .log files (OUT defaults to ./bench-out).
# SWEEP_TIMEOUT (seconds, default 900) bounds each sweep; run the same command again to continue a
# cut one (--resume).
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
status=0
for name in prefill-k2-fp8 prefill-k3-mxfp4; do
  bench_sweep "$name" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" || status=1
  bench_sweep "$name-as-bf16" "bench/scripts/h200-$name.yaml" "${SWEEP_TIMEOUT:-900}" --weights bf16 || status=1
done
exit $status
