#!/usr/bin/env bash
# Second H200 session, third call: shared slots with the row-bounded activation and copy kernels.
# Layer tests (Kimi-K2, CUDA graphs, two layers in one graph), the NVLink transport with 2
# processes, the transformers models, then the Kimi-K2 and Kimi-K3 sweeps (EP phases timed as
# CUDA-graph replays). Logs and results go to $OUT.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
start=$SECONDS
timeout 200 python3 -m pytest -o addopts="" -rA -s tests/test_layer_gpu.py tests/kernels > "$OUT/layer_gpu_tests.log" 2>&1; echo "layer tests exit $? ($((SECONDS - start)) s)"
tail -3 "$OUT/layer_gpu_tests.log"
timeout 200 python3 -m flatep bench bench/scripts/h200-k2.yaml --out "$OUT/kimi-k2" --quiet > "$OUT/kimi-k2.log" 2>&1; echo "k2 sweep exit $? ($((SECONDS - start)) s)"
PROCS=2 SUITES=compare timeout 100 bash bench/scripts/nvlink_shared_gpu.sh > /dev/null 2>&1; echo "nvlink exit $? ($((SECONDS - start)) s)"
timeout 90 python3 bench/scripts/transformers_gpu.py > /dev/null 2>&1; echo "transformers exit $? ($((SECONDS - start)) s)"
timeout $((570 - SECONDS + start)) python3 -m flatep bench bench/scripts/h200-k3.yaml --out "$OUT/kimi-k3" --quiet > "$OUT/kimi-k3.log" 2>&1
echo "k3 sweep exit $? ($((SECONDS - start)) s)"; wc -l "$OUT"/kimi-k*/results.jsonl
rm -f "$OUT"/kimi-k*/summary.md
