#!/usr/bin/env bash
# Second H200 session, second call: the layer with borrow slots shared by all layers (issue #3) on
# the GPU (Kimi-K2 layer tests, CUDA graphs, two layers in one graph, the NVLink transport with 2
# processes, the transformers models), then the Kimi-K2 sweep with the Triton planner and the tuned
# kernels. Logs and results go to $OUT.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
start=$SECONDS
timeout 200 python3 -m pytest -q -s tests/test_layer_gpu.py tests/kernels > "$OUT/layer_gpu_tests.log" 2>&1; echo "layer tests exit $? ($((SECONDS - start)) s)"
PROCS=2 SUITES=compare timeout 100 bash bench/scripts/nvlink_shared_gpu.sh > /dev/null 2>&1; echo "nvlink exit $? ($((SECONDS - start)) s)"
timeout 90 python3 bench/scripts/transformers_gpu.py > /dev/null 2>&1; echo "transformers exit $? ($((SECONDS - start)) s)"
timeout $((575 - SECONDS + start)) python3 -m flatep bench bench/scripts/h200-k2.yaml --out "$OUT/kimi-k2" --quiet > "$OUT/kimi-k2.log" 2>&1
echo "sweep exit $? ($((SECONDS - start)) s)"; wc -l "$OUT/kimi-k2/results.jsonl"
