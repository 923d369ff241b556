#!/usr/bin/env bash
# Result set: two unmerged variants of the swapped Gluon mxfp4 kernel (flatep/kernels/mxfp4_swap.py) on one
# Hopper GPU, each against the one before it, in one call:
#   - PREP, an export of branch swap-prepermuted: the rows copied into the kernel's K order before the
#     launch (k_ordered_rows), the MMAs reading the TMA stages; against this tree's kernels;
#   - UNR, an export of branch swap-unroll (on swap-prepermuted): two stages decoded before one wait for
#     their four MMAs, the producer warp at 24 registers; against PREP's kernels.
# For each: its GPU tests (tests/kernels/test_mxfp4_swap.py, test_mxfp4_swap_k_order.py; UNR without the
# compile test, which its Triton 3.9 stack frame fails) -> NAME_tests.log; issue #15's Kimi-K3 cell
# (python -m flatep.bench.experts_phase, s = 128, maxvio 0 and 10, the slowest rank's time per kernel, bf16
# in the same run) -> k3_NAME.json, .log; then, time allowing, both trees' kernels against the Triton
# short tiles (bench/scripts/mxfp4_swap_tiles.py) -> tiles_NAME.json, .log. On an H200 it first runs
# this tree's issue #15 targets (bench/scripts/issue15_targets.sh) into main_targets/.
#   for b in swap-prepermuted swap-unroll; do mkdir -p _exp/$b && git archive $b flatep tests bench/scripts \
#     pyproject.toml | tar -x -C _exp/$b; done
#   PREP=_exp/swap-prepermuted UNR=_exp/swap-unroll bash bench/scripts/swap_branches.sh   (repository root)
# Everything goes to $OUT/all.tgz (the device returns a few files only), packed again after each step so that
# a call cut short still returns what ran; LIMIT (default 560) is the seconds the call may take.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
ROOT=$PWD
PREP=$(realpath "${PREP:?PREP: an export of branch swap-prepermuted}")
UNR=$(realpath "${UNR:?UNR: an export of branch swap-unroll}")
FINAL=$OUT WORK=$(mktemp -d)  # the steps write to WORK/w, packed into FINAL/all.tgz
export OUT=$WORK/w
mkdir -p "$OUT"
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "GPU: $name" | tee "$OUT/smi.txt"
tests() {  # tests TREE NAME [pytest args...]
  (cd "$1" && PYTHONPATH=$PWD timeout 120 python3 -m pytest -o addopts="" -q -p no:cacheprovider "${@:3}" \
    > "$OUT/$2_tests.log" 2>&1; echo "$2 tests: exit $? at $SECONDS s")
  tail -2 "$OUT/$2_tests.log"
}
k3() {  # k3 TREE AGAINST NAME
  (cd "$1" && PYTHONPATH=$PWD timeout 120 python3 -m flatep.bench.experts_phase \
    bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 128 --maxvio 0 10 --profile --against "$2" \
    --out "$OUT/k3_$3.json" > "$OUT/k3_$3.log" 2>&1
   echo "k3 $3: exit $? at $SECONDS s")
  grep -A3 "slowest rank" "$OUT/k3_$3.log" | cut -c1-220
}
LIMIT=${LIMIT:-560}
pack() { tar czf "$FINAL/all.tgz.part" -C "$WORK" w && mv "$FINAL/all.tgz.part" "$FINAL/all.tgz"; }
tiles() {  # tiles TREE NAME, if at least 90 s are left
  [ "$SECONDS" -lt $((LIMIT - 90)) ] || { echo "tiles $2: skipped at $SECONDS s"; return; }
  (cd "$1" && PYTHONPATH=$PWD timeout $((LIMIT - 10 - SECONDS)) python3 bench/scripts/mxfp4_swap_tiles.py \
    --out "$OUT/tiles_$2.json" > "$OUT/tiles_$2.log" 2>&1; echo "tiles $2: exit $? at $SECONDS s")
  grep '"rows_per_expert": 32' "$OUT/tiles_$2.log" | grep '"default": true\|s6 g8 p3' | cut -c1-200
}
pack
if [[ "$name" == *H200* ]]; then
  OUT=$OUT/main_targets timeout 170 bash bench/scripts/issue15_targets.sh; echo "targets: exit $? at $SECONDS s"; pack
fi
tests "$PREP" prep tests/kernels/test_mxfp4_swap.py tests/kernels/test_mxfp4_swap_k_order.py; pack
k3 "$PREP" "$ROOT/flatep/kernels" prep; pack
tests "$UNR" unr tests/kernels/test_mxfp4_swap.py tests/kernels/test_mxfp4_swap_k_order.py -k "not compiles"; pack
k3 "$UNR" "$PREP/flatep/kernels" unr; pack
tiles "$PREP" prep; pack
tiles "$UNR" unr; pack
rm -rf "$WORK"
