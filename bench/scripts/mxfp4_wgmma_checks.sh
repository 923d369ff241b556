#!/usr/bin/env bash
# Result set: the Gluon mxfp4 kernel (flatep/kernels/mxfp4_wgmma.py) on one Hopper GPU, in one call:
#   1. its GPU tests (tests/kernels/test_mxfp4_wgmma.py: against the Triton tile and the dequantized
#      weights, home experts and slots, both passes, in a CUDA graph) -> mxfp4_wgmma_tests.log;
#      the rest is skipped if they fail;
#   2. issue #15's Kimi-K3 cell (one rank's experts at s = 128, maxvio 0 and 10, classic) against
#      the GEMMs of $AGAINST (default 8dbf463, before the kernel: a revision, or a copy of
#      flatep/kernels/quant_gemm.py where the checkout lacks the history), bf16 in the same run, with the
#      slowest rank's time per kernel -> experts_k3_mxfp4_decode_against.json, .log;
#   3. the GPU tests of tests/quant, tests/kernels and tests/bench (16 workers; the large-memory
#      file one test at a time) -> pytest_gpu_packed.log; then, if about 460 s of $BUDGET seconds
#      (default 575) are left, the whole test suite (bench/scripts/gpu_checks.sh PARTS=suite,
#      JOBS=16) -> pytest_gpu.log.
#   bash bench/scripts/mxfp4_wgmma_checks.sh          (from the repository root, on an H100 or H200)
# Writes to $OUT (default ./bench-out). Exit status 0 iff the kernel's tests passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/smi.txt"; cat "$OUT/smi.txt"
timeout 100 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/kernels/test_mxfp4_wgmma.py \
  > "$OUT/mxfp4_wgmma_tests.log" 2>&1
code=$?
echo "mxfp4 wgmma tests: exit $code at ${SECONDS} s"; tail -15 "$OUT/mxfp4_wgmma_tests.log"
[ $code -eq 0 ] || exit 1
timeout 120 python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 128 --maxvio 0 10 \
  --profile --against "${AGAINST:-8dbf463}" --out "$OUT/experts_k3_mxfp4_decode_against.json" \
  > "$OUT/experts_k3_mxfp4_decode_against.log" 2>&1
echo "experts_phase: exit $? at ${SECONDS} s"
grep -A3 "slowest rank" "$OUT/experts_k3_mxfp4_decode_against.log"
left=$(( ${BUDGET:-575} - SECONDS ))
echo "the GPU tests of the packages the kernel touches get $left s"
timeout "$left" python3 -m pytest -o addopts="" -q -p no:cacheprovider --durations=10 -n 16 tests/quant tests/kernels \
  tests/bench > "$OUT/pytest_gpu_packed.log" 2>&1
echo "tests/quant, tests/kernels, tests/bench: exit $? at ${SECONDS} s"; tail -3 "$OUT/pytest_gpu_packed.log"
left=$(( ${BUDGET:-575} - SECONDS ))
if [ $left -lt 470 ]; then echo "the whole suite needs about 460 s: $left s left, not run"; exit 0; fi
PARTS=suite JOBS=16 timeout "$left" bash bench/scripts/gpu_checks.sh
echo "suite: exit $? at ${SECONDS} s"
grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest_gpu.log" | tail -12
exit 0
