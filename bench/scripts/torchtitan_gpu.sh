#!/usr/bin/env bash
# Result set: the tiny torchtitan Qwen3-MoE trained on one GPU with FlatEP and without
# (examples/torchtitan_train.py --device cuda), the same seeds, batches and loop as the CPU run.
#   bash bench/scripts/torchtitan_gpu.sh          (from the repository root)
# The GPU machine has no internet: torchtitan 0.3.0 and the packages it imports that the machine
# lacks travel as wheels in .whl/torchtitan/ (torchtitan, spmd_types, tyro, docstring_parser; made
# here with `pip download --no-deps -d .whl/torchtitan torchtitan==0.3.0 spmd_types==0.2.3
# tyro==1.0.17 docstring_parser==0.18.0`). They are installed for this run only, so the test
# suite of the same call does not see torchtitan.
# Writes $OUT/torchtitan-gpu/{losses.json,losses.png} and $OUT/torchtitan-gpu.log (OUT defaults to ./bench-out).
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/torchtitan-site \
  .whl/torchtitan/*.whl || exit 1
PYTHONPATH="$PYTHONPATH:/tmp/torchtitan-site" python3 examples/torchtitan_train.py --steps 50 --policy exact \
  --ranks "${RANKS:-4}" --device cuda --out "$OUT/torchtitan-gpu" > "$OUT/torchtitan-gpu.log" 2>&1
code=$?
echo "torchtitan on the GPU: exit $code"
tail -8 "$OUT/torchtitan-gpu.log"
exit $code
