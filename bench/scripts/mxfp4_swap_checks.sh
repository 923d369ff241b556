#!/usr/bin/env bash
# Result set: the swapped Gluon mxfp4 kernel (flatep/kernels/mxfp4_swap.py) on one Hopper GPU, in one call:
#   1. its GPU tests (tests/kernels/test_mxfp4_swap.py: one-hot rows reading back every decoded
#      weight; against the Triton short tiles and the dequantized weights, home experts and slots,
#      both passes, in a CUDA graph) -> mxfp4_swap_tests.log; the rest is skipped if they fail;
#   2. the kernel against the Triton short tiles at 16 and 32 rows per expert
#      (bench/scripts/mxfp4_swap_tiles.py) -> mxfp4_swap_tiles.json, .log;
#   3. issue #15's Kimi-K3 cell (one rank's experts at s = 128, maxvio 0 and 10, classic) with the
#      kernel as the default for groups of 17-32 rows (FLATEP_MXFP4_SWAP=1, exported here)
#      against the GEMMs of $AGAINST (a revision from before the kernel, or a copy of its
#      flatep/kernels/ or of its quant_gemm.py where the checkout lacks the history), bf16 in the
#      same run
#      -> experts_k3_mxfp4_decode_swap.json, .log.
#   AGAINST=FILE bash bench/scripts/mxfp4_swap_checks.sh      (from the repository root, on an H100 or H200)
# Writes 6 files to $OUT (default ./bench-out). Exit status 0 iff the kernel's tests passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/smi.txt"; cat "$OUT/smi.txt"
timeout 150 python3 -m pytest -o addopts="" -q -p no:cacheprovider tests/kernels/test_mxfp4_swap.py \
  > "$OUT/mxfp4_swap_tests.log" 2>&1
code=$?
echo "mxfp4 swap tests: exit $code at ${SECONDS} s"; tail -15 "$OUT/mxfp4_swap_tests.log"
[ $code -eq 0 ] || exit 1
timeout 200 python3 bench/scripts/mxfp4_swap_tiles.py --out "$OUT/mxfp4_swap_tiles.json" \
  > "$OUT/mxfp4_swap_tiles.log" 2>&1
echo "tiles: exit $? at ${SECONDS} s"; cut -c1-160 "$OUT/mxfp4_swap_tiles.log"
export FLATEP_MXFP4_SWAP=1
timeout 150 python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 128 --maxvio 0 10 \
  --profile --against "${AGAINST:?AGAINST: the revision or quant_gemm.py to compare with}" \
  --out "$OUT/experts_k3_mxfp4_decode_swap.json" > "$OUT/experts_k3_mxfp4_decode_swap.log" 2>&1
echo "experts_phase: exit $? at ${SECONDS} s"
grep -A3 "slowest rank" "$OUT/experts_k3_mxfp4_decode_swap.log"
exit 0
