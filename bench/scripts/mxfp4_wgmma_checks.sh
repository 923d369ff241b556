#!/usr/bin/env bash
# Result set: the Gluon mxfp4 kernel (flatep/kernels/mxfp4_wgmma.py) on one Hopper GPU, in one call:
#   1. its GPU tests (tests/kernels/test_mxfp4_wgmma.py: one-hot rows reading back every decoded
#      weight; against the Triton tile and the dequantized weights, home experts and slots, both
#      passes, in a CUDA graph) -> mxfp4_wgmma_tests.log; the rest is skipped if they fail;
#   2. issue #15's Kimi-K3 cell (one rank's experts at s = 128, maxvio 0 and 10, classic) against
#      the GEMMs of $AGAINST (default 8dbf463, before the kernel: a revision, or a copy of
#      flatep/kernels/quant_gemm.py where the checkout lacks the history), bf16 in the same run, with the
#      slowest rank's time per kernel -> experts_k3_mxfp4_decode_against.json, .log;
#   3. the kernel against the Triton tiles at 16-192 rows per expert (bench/scripts/mxfp4_wgmma_tiles.py)
#      -> mxfp4_wgmma_tiles.json, .log.
#   bash bench/scripts/mxfp4_wgmma_checks.sh          (from the repository root, on an H100 or H200)
# FLATEP_MXFP4_WGMMA=1 (exported here) makes the kernel the default for those groups in step 2.
# About 150 s on an H100. The whole test suite is bench/scripts/gpu_checks.sh's (PARTS=suite).
# Writes to $OUT (default ./bench-out). Exit status 0 iff the kernel's tests passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
export FLATEP_MXFP4_WGMMA=1
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
timeout 200 python3 bench/scripts/mxfp4_wgmma_tiles.py --out "$OUT/mxfp4_wgmma_tiles.json" \
  > "$OUT/mxfp4_wgmma_tiles.log" 2>&1
echo "tiles: exit $? at ${SECONDS} s"; tail -30 "$OUT/mxfp4_wgmma_tiles.log"
exit 0
