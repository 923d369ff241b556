#!/usr/bin/env bash
# Issue 7: validation and benchmarks on 2, 4 and 8 H200 of one host (one process per GPU).
# Run from the repo root on a multi-GPU machine: `bash bench/multigpu.sh [N ...]` (default: every
# power of two up to the GPU count). Writes logs and results.jsonl files under $OUT/x<N>/
# (OUT defaults to ./bench-out); commit them as bench/results/<date>-h200x<N>/.
#   1. the test suite on the GPU, then ep_moe per process equal to the local transport bit for bit
#      over NVLink P2P (gloo for set-up) and over the collective transport with NCCL;
#   2. the sweep: Kimi-K2 and Kimi-K3, s in {128, 1024, 4096, 8192}, maxvio in {0, 1, 5, 10, 20},
#      arms flat, classic and the plain all_to_all_single baseline (times of every rank, slowest rank);
#   3. decode: s = 128 per rank, hidden 7168, K = 8 (the Kimi-K2 rows of the sweep at s = 128).
source bench/scripts/gpu_env.sh
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
sizes=("$@")
if [ ${#sizes[@]} -eq 0 ]; then for n in 2 4 8; do [ "$n" -le "$gpus" ] && sizes+=("$n"); done; fi
echo "GPUs: $gpus; group sizes: ${sizes[*]}"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
timeout 900 python3 -m pytest -q tests 2>&1 | tail -5 | tee "$OUT/pytest_gpu.log"
for n in "${sizes[@]}"; do
  dir="$OUT/x$n"; mkdir -p "$dir"
  for transport in nvlink collective; do
    backend=gloo; [ "$transport" = collective ] && backend=nccl
    timeout 900 torchrun --standalone --nproc-per-node "$n" -m tests.transport.worker \
      --transport "$transport" --backend "$backend" --size mid --compare --timeout 60 \
      > "$dir/equivalence_$transport.log" 2>&1
    echo "x$n $transport equivalence: exit $? ($(grep -c ' ok ' "$dir/equivalence_$transport.log") checks ok)"
  done
  timeout 900 torchrun --standalone --nproc-per-node "$n" -m tests.transport.worker \
    --transport nvlink --backend gloo --size mid --suite dead-rank --timeout 10 > "$dir/dead_rank.log" 2>&1
  echo "x$n barrier timeout on a dead rank: exit $?"
  for model in kimi-k2 kimi-k3; do
    timeout 1800 torchrun --standalone --nproc-per-node "$n" -m flatep.bench.distributed --model "$model" \
      --tokens 128 1024 4096 8192 --maxvio 0 1 5 10 20 --arms flat classic a2a --out "$dir/$model" \
      2>&1 | grep -v '^W' | tee "$dir/$model.log"
    python3 -m flatep bench --report "$dir/$model/results.jsonl" > /dev/null
  done
done
