#!/usr/bin/env bash
# Result set: issue #15's cells on one Hopper GPU and the Gluon mxfp4 kernels' K steps in chunks
# (CHUNK_STEPS of flatep/kernels/mxfp4_swap.py and mxfp4_fp8mma.py), in one call of at most BUDGET
# seconds (default 560):
#   1. issue #15's Kimi-K2 fp8 cells (PARTS=fp8 bash bench/scripts/issue15_targets.sh) -> fp8_experts.sh's files;
#   2. both kernels' GPU tests, K steps one by one and in chunks (tests/kernels/test_mxfp4_swap.py,
#      test_mxfp4_fp8mma.py) -> mxfp4_chunk_tests.log;
#   3. issue #15's Kimi-K3 cells, word layout and fp8 activations (PARTS=mxfp4 bash
#      bench/scripts/issue15_targets.sh), with this tree's kernels as the packed arm and, where step 2
#      passed, the chunked candidate (bench/scripts/chunk_candidate.py) as the "against" arm, bf16 in
#      the same run -> experts_k3_mxfp4_*.json, .log;
#   4. the swapped kernel at chunks of 1, 2, 4 and 8 K steps against each other and the Triton tile of
#      its height, per GEMM at 32 and 64 rows per expert (bench/scripts/mxfp4_swap_chunks.py --rows 32 64:
#      the 16-row groups keep the Triton tile) -> mxfp4_swap_chunks.json, .log (rows logged as they come).
#   bash bench/scripts/mxfp4_chunk_checks.sh        (from the repository root, on an H100 or H200)
# Each step's timeout is what is left of BUDGET; a step with less than 20 s left is skipped.
# Writes to $OUT (default ./bench-out). Exit status 0 iff every step ran and passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
BUDGET=${BUDGET:-560}
[[ "$BUDGET" =~ ^[0-9]+$ ]] || { echo "BUDGET takes whole seconds, got '$BUDGET'" >&2; exit 2; }
status=0
# left: the seconds left of BUDGET, or status 1 where fewer than 20 are.
left() { local seconds=$((BUDGET - SECONDS)); [ $seconds -ge 20 ] && echo $seconds; }
# skip NAME: say so, and count it as a failed step.
skip() { echo "$1: skipped, $((BUDGET - SECONDS)) s of the budget left"; status=1; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/smi.txt"; cat "$OUT/smi.txt"
if limit=$(left); then
  PARTS=fp8 timeout "$limit" bash bench/scripts/issue15_targets.sh || status=1
  echo "issue15 fp8: done at ${SECONDS} s"
else skip "issue15 fp8"; fi
tests=1
if limit=$(left); then
  # 8 workers compile the kernels' variants side by side (their GPU work is small)
  timeout "$limit" python3 -m pytest -o addopts="" -q -p no:cacheprovider -n 8 tests/kernels/test_mxfp4_swap.py \
    tests/kernels/test_mxfp4_fp8mma.py > "$OUT/mxfp4_chunk_tests.log" 2>&1
  tests=$?
  echo "chunk tests: exit $tests at ${SECONDS} s"; tail -5 "$OUT/mxfp4_chunk_tests.log"
else skip "chunk tests"; fi
[ $tests -eq 0 ] || status=1
against=
if [ $tests -eq 0 ]; then  # without a candidate the Kimi-K3 cells still run, this tree's kernels alone
  against=$(python3 bench/scripts/chunk_candidate.py "$(mktemp -d)") || { echo "no candidate" >&2; against=; status=1; }
fi
if limit=$(left); then
  PARTS=mxfp4 AGAINST=$against timeout "$limit" bash bench/scripts/issue15_targets.sh || status=1
  echo "issue15 mxfp4 (against: ${against:-none}): done at ${SECONDS} s"
else skip "issue15 mxfp4"; fi
if [ $tests -eq 0 ] && limit=$(left); then
  timeout "$limit" python3 bench/scripts/mxfp4_swap_chunks.py --rows 32 64 --out "$OUT/mxfp4_swap_chunks.json" \
    > "$OUT/mxfp4_swap_chunks.log" 2>&1 || status=1
  echo "chunk timings: done at ${SECONDS} s"; cut -c1-200 "$OUT/mxfp4_swap_chunks.log"
elif [ $tests -eq 0 ]; then skip "chunk timings"; fi
exit $status
