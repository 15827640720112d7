#!/bin/bash
# Nsight Compute on the scoring kernel (speed of light, occupancy, warp stalls, memory), 2 and 4 bits, STAGES 0
# and 2; the second launch of each setting. Usage: bash results/selection/ring_h200/run2.sh
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 300 ncu --clock-control none --kernel-name quantkey_mma \
  --launch-count 8 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
  python3 results/selection/ring_h200/ncu_quantkey.py > $OUT/ncu_quantkey.txt 2>&1
echo "ncu rc=$?"
grep -E "bits|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Issued Ipc|No Eligible|Warp Cycles Per Issued|Stall|L1/TEX Hit|L2 Hit|Mem Busy|Max Bandwidth" $OUT/ncu_quantkey.txt | cut -c1-150 | head -120
