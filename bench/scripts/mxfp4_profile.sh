#!/usr/bin/env bash
# Result set: where the mxfp4 decode tiles' time goes. Nsight Compute (ncu, clocks left alone) profiles
# the one-multiply pass of one Kimi-K3 rank's mxfp4 gate/up GEMM at 16 and 32 rows per expert
# (bench/scripts/mxfp4_profile_target.py, the default tiles), with warp-state sampling per SASS
# instruction; then bench/scripts/mxfp4_registers.py times the tiles at other register limits and
# programs per SM. On a GPU whose runtime lets ncu read counters (a Firecracker machine):
#   bash bench/scripts/mxfp4_profile.sh                  (from the repository root; the layer's copies)
#   COPIES=pointers bash bench/scripts/mxfp4_profile.sh  (pointer copies: bench/results/2026-12-06-h100-d)
# Writes to $OUT (default ./bench-out): details16.txt, details32.txt (ncu's sections),
# source16.csv.gz, source32.csv.gz (samples per SASS instruction), mx_registers.json.
# Summarise the samples with: python bench/scripts/ncu_stalls.py $OUT/source16.csv.gz
cd "$(dirname "$0")/../.."
source bench/scripts/gpu_env.sh
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
status=0
for rows in 16 32; do
  ROWS=$rows timeout 300 "$NCU" --clock-control none -k regex:_mxfp4_grouped_kernel --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
    --section InstructionStats --section SourceCounters --import-source no -o "$OUT/prof$rows" \
    python3 bench/scripts/mxfp4_profile_target.py || status=1
  "$NCU" -i "$OUT/prof$rows.ncu-rep" --page details --print-details all > "$OUT/details$rows.txt" || status=1
  "$NCU" -i "$OUT/prof$rows.ncu-rep" --page source --print-source sass --csv > "$OUT/source$rows.csv" || status=1
  gzip -f "$OUT/source$rows.csv"
  rm -f "$OUT/prof$rows.ncu-rep"
done
python3 bench/scripts/mxfp4_registers.py --out "$OUT/mx_registers.json" || status=1
exit $status
