# Sourced by the device scripts: environment for the H200 machine (no internet; wheels carried in .whl).
set -o pipefail
export OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# bench_sweep NAME CONFIG TIMEOUT [flatep bench options...]: run (or resume) the sweep CONFIG into
# $OUT/NAME/ with its log in $OUT/NAME.log, print its exit status and rows, return that status.
bench_sweep() {
  local name=$1 config=$2 limit=$3
  shift 3
  timeout "$limit" python3 -m flatep bench "$config" --out "$OUT/$name" "$@" --resume --quiet > "$OUT/$name.log" 2>&1
  local code=$?
  echo "$name: exit $code, $(wc -l 2>/dev/null < "$OUT/$name/results.jsonl" || echo 0) rows"
  return $code
}
