#!/usr/bin/env bash
# Result set: mxfp4 experts with fp8 activations (pools in the mma layout, FLATEP_MXFP4_FP8_ACTIVATIONS=1)
# on one Hopper GPU, in one device call:
#   1. their tests on the GPU (pytest_fp8_activations.log): the kernel with slots in CUDA graphs, scale
#      bytes outside its window, the split, and the layer against dense fp32 under exact, none and auto;
#   2. issue #15's Kimi-K3 cell (s = 128, maxvio 0 and 10; python -m flatep.bench.experts_phase, each
#      with its bf16 twin in the same run) with the pools in FlatEP's word layout (bf16 activations,
#      experts_k3_mxfp4_decode.json, .log) and then in the mma layout (fp8 activations,
#      experts_k3_mxfp4_fp8_activations.json, .log).
#   bash bench/scripts/fp8_activations.sh          (from the repository root)
# Writes to $OUT (default ./bench-out), with smi.txt. Exit status 0 iff every step passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
nvidia-smi > "$OUT/smi.txt" 2>&1
status=0
python3 -m pytest -o addopts="" -q -p no:cacheprovider -rf tests/kernels/test_mxfp4_fp8mma.py \
  tests/kernels/test_fp8_split.py tests/quant/test_mma_layout.py tests/quant/test_layer_quant.py \
  > "$OUT/pytest_fp8_activations.log" 2>&1 || status=1
echo "tests: $(tail -1 "$OUT/pytest_fp8_activations.log")"
cell() {  # cell NAME [environment...]: the Kimi-K3 cell into $OUT/NAME.json, its log in $OUT/NAME.log
  local name=$1
  shift
  env "$@" python3 -m flatep.bench.experts_phase bench/scripts/h200-decode-k3-mxfp4.yaml --tokens 128 --maxvio 0 10 \
    --profile --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || status=1
  echo "$name:"
  grep -A 2 "slowest rank" "$OUT/$name.log" | cut -c1-400
}
cell experts_k3_mxfp4_decode FLATEP_MXFP4_FP8_ACTIVATIONS=0
cell experts_k3_mxfp4_fp8_activations FLATEP_MXFP4_FP8_ACTIVATIONS=1
exit $status
