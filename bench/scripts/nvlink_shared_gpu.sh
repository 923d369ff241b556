#!/usr/bin/env bash
# The NVLink transport's code path on one GPU shared by 2 and 4 processes (torchrun, gloo process
# group for set-up, symmetric memory for data; correctness only, not link speed):
#   1. ep_moe per process equals the local transport (virtual ranks, same GPU) bit for bit and the
#      dense MoE within bf16 tolerance: both policies, several maxvio, adversarial routings, bf16
#      and fp32, H=1024 I=512 E=32 K=4 s=256 (and s=97), then ranks disagreeing on s / config /
#      valid ids must all raise ValueError;
#   2. the last process exits early: the others must raise TimeoutError naming it within the
#      barrier timeout (10 s).
# Log: $OUT/nvlink_shared_gpu.log (OUT defaults to ./bench-out). Exit status 0 iff all passed.
# PROCS (default "2 4") picks the process counts; SUITES (default "compare dead-rank") the parts.
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
set -o pipefail
export TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export CUDA_VISIBLE_DEVICES=0  # every process on GPU 0
LOG="$OUT/nvlink_shared_gpu.log"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

echo "== environment ($(date -u +%FT%TZ))"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)"
env | grep -E '^(TORCH_SYMM|NCCL_NVLS|NVSHMEM|CUDA_VISIBLE|PYTHONPATH|OUT)=' | sort

status=0
check() {  # check NAME SECONDS COMMAND...: run with a hard time limit, report, remember failures
  local name=$1 limit=$2
  shift 2
  echo
  echo "== $name"
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@"
  local code=$?
  if [ $code -eq 0 ]; then
    echo "== $name: PASSED in $((SECONDS - start)) s"
  else
    echo "== $name: FAILED (exit $code$([ $code -eq 124 ] && echo ', timed out') after $((SECONDS - start)) s)"
    status=1
  fi
}

PROCS=${PROCS:-2 4}
SUITES=${SUITES:-compare dead-rank}
for procs in $PROCS; do
  [[ " $SUITES " == *" compare "* ]] || continue
  check "ep_moe equals the local transport, $procs processes on GPU 0" 420 \
    torchrun --standalone --nproc-per-node "$procs" -m tests.transport.worker \
      --transport nvlink --backend gloo --size mid --compare --timeout 60
done
for procs in $PROCS; do
  [[ " $SUITES " == *" dead-rank "* ]] || continue
  check "barrier timeout names a rank that stopped, $procs processes on GPU 0" 180 \
    torchrun --standalone --nproc-per-node "$procs" -m tests.transport.worker \
      --transport nvlink --backend gloo --size mid --suite dead-rank --timeout 10
done

echo
echo "== overall: $([ $status -eq 0 ] && echo PASSED || echo FAILED)"
exit $status
