#!/usr/bin/env bash
# First look on the GPU: data-path tests at Kimi-K2 shape, CUDA-graph replay, and a small sweep.
source bench/scripts/gpu_env.sh
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -x -q -s tests/test_layer_gpu.py tests/kernels 2>&1 | tee "$OUT/gpu_tests.log"
cat > /tmp/quick.yaml <<'YAML'
name: quick
model: kimi-k2
ranks: 8
tokens: [128, 4096]
maxvio: [0, 10]
arms: [flat, classic, dense]
warmup: 2
iters: 5
YAML
timeout 240 python3 -m flatep bench /tmp/quick.yaml --out "$OUT/quick" --quiet 2>&1 | tail -30
