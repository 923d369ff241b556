#!/usr/bin/env bash
# Result set: the correctness checks on one GPU, as logs.
#   bash bench/scripts/gpu_checks.sh                (from the repository root)
# Writes to $OUT (default ./bench-out):
#   pytest_gpu.log         the whole test suite (`python -m pytest tests`), GPU tests included
#   layer_gpu_tests.log    the layer at Kimi-K2 shape vs dense fp32, CUDA-graph replays, the kernels on the GPU
#   nvlink_shared_gpu.log  the NVLink transport with 2 and 4 processes sharing GPU 0 (bench/scripts/nvlink_shared_gpu.sh)
#   transformers_gpu.log   transformers models sharded over 8 virtual ranks (bench/scripts/transformers_gpu.py)
# Exit status 0 iff every part passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
status=0
part() {  # part NAME LOG COMMAND...: run, keep the log, report the exit status
  local name=$1 log=$2
  shift 2
  "$@" > "$OUT/$log" 2>&1
  local code=$?
  echo "$name: exit $code ($(tail -1 "$OUT/$log"))"
  [ $code -eq 0 ] || status=1
}
part "test suite" pytest_gpu.log python3 -m pytest -o addopts="" -q tests
part "layer GPU tests" layer_gpu_tests.log python3 -m pytest -o addopts="" -rA -s tests/test_layer_gpu.py tests/kernels
part "NVLink, processes sharing one GPU" nvlink_driver.log bash bench/scripts/nvlink_shared_gpu.sh
part "transformers models" transformers_driver.log python3 bench/scripts/transformers_gpu.py
exit $status
