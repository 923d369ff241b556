#!/usr/bin/env bash
# Second H200 session, first call: the checks issues #6 and #8 still lacked, the CUDA-graph replay
# with planning inside the graph, and the kernel tuning sweep. Logs go to $OUT.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
timeout 150 python3 bench/scripts/transformers_gpu.py > /dev/null 2>&1; echo "transformers_gpu exit $?"
timeout 120 python3 -m pytest -q -s tests/test_layer_gpu.py -k cuda_graph 2>&1 | tee "$OUT/graph_tests.log" | tail -3
timeout 480 bash bench/scripts/nvlink_shared_gpu.sh > /dev/null 2>&1; echo "nvlink_shared_gpu exit $?"
for model in kimi-k2 kimi-k3; do
  timeout 120 python3 -m flatep.bench.kernels --model $model --tokens 1024 4096 --out "$OUT/kernels-$model.json" > "$OUT/kernels-$model.log" 2>&1
  echo "kernels $model exit $?"
done
