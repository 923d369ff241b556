#!/usr/bin/env bash
# Result set: the correctness checks on one GPU, as logs.
#   bash bench/scripts/gpu_checks.sh                (from the repository root)
# Writes to $OUT (default ./bench-out):
#   pytest_gpu.log         the whole test suite (`python -m pytest tests`), GPU tests included: the
#                          large-memory GPU files alone, one after another, then the rest over $JOBS
#                          pytest-xdist workers (default 8; JOBS=0 runs everything in one process);
#                          SUITE=heavy or SUITE=rest runs one half, each within one 10-minute device
#                          call (H100, JOBS=16: 382 and 393 s, bench/results/2026-12-07-h100-n; the
#                          heavy half before its 16 packed NVLink random steps, about 100 s more)
#   layer_gpu_tests.log    the layer at Kimi-K2 shape vs dense fp32, CUDA-graph replays, the kernels on the GPU
#   nvlink_shared_gpu.log  the NVLink transport with 2 and 4 processes sharing GPU 0 (bench/scripts/nvlink_shared_gpu.sh)
#   transformers_gpu.log   transformers models sharded over 8 virtual ranks (bench/scripts/transformers_gpu.py)
# PARTS (default "suite layer nvlink transformers") picks the parts. Exit status 0 iff every part passed.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
case "${SUITE:-all}" in
  all | heavy | rest) ;;
  *) echo "SUITE must be all, heavy or rest, got '$SUITE'" >&2; exit 2 ;;
esac
for name in ${PARTS:-suite layer nvlink transformers}; do
  [[ " suite layer nvlink transformers " == *" $name "* ]] || {
    echo "PARTS takes suite, layer, nvlink and transformers, got '$name'" >&2; exit 2; }
done
status=0
part() {  # part NAME LOG COMMAND...: run, keep the log, report the exit status
  local name=$1 log=$2
  shift 2
  "$@" > "$OUT/$log" 2>&1
  local code=$?
  echo "$name: exit $code ($(tail -1 "$OUT/$log"))"
  [ $code -eq 0 ] || status=1
}
# Kimi-K2-sized GPU tests take tens of GB each (up to ~110 GB together with the fixture's weights
# and pool): they run alone, one after another, then the rest over $JOBS workers.
HEAVY=(tests/test_layer_gpu.py tests/quant/test_quant_gpu.py tests/transport/test_nvlink_gpu.py)
suite() {
  if [ "${JOBS:-8}" -eq 0 ]; then python3 -m pytest -o addopts="" -q -p no:cacheprovider tests; return; fi
  local heavy=0 rest=0
  if [ "${SUITE:-all}" != rest ]; then
    python3 -m pytest -o addopts="" -q -p no:cacheprovider --durations=10 "${HEAVY[@]}"
    heavy=$?
  fi
  if [ "${SUITE:-all}" != heavy ]; then
    python3 -m pytest -o addopts="" -q -p no:cacheprovider --durations=10 -n "${JOBS:-8}" tests \
      $(printf -- "--ignore=%s " "${HEAVY[@]}")
    rest=$?
  fi
  return $(( heavy || rest ))
}
wanted() { [[ " ${PARTS:-suite layer nvlink transformers} " == *" $1 "* ]]; }
wanted suite && part "test suite" pytest_gpu.log suite
wanted layer && part "layer GPU tests" layer_gpu_tests.log python3 -m pytest -o addopts="" -rA -s tests/test_layer_gpu.py tests/kernels
wanted nvlink && part "NVLink, processes sharing one GPU" nvlink_driver.log bash bench/scripts/nvlink_shared_gpu.sh
wanted transformers && part "transformers models" transformers_driver.log python3 bench/scripts/transformers_gpu.py
exit $status
