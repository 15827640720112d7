#!/bin/bash
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
which ncu; ncu --version | tail -1
timeout 240 ncu --clock-control none --kernel-name quantkey_mma --launch-skip 1 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
  --section SourceCounters --section InstructionStats --section LaunchStats --section MemoryWorkloadAnalysis \
  -o $OUT/qk python3 results/selection/pair_h200/ncu_probe.py > $OUT/ncu_log.txt 2>&1
echo "ncu rc=$?"; tail -5 $OUT/ncu_log.txt
ncu --import $OUT/qk.ncu-rep --page details > $OUT/details.txt 2>&1
ncu --import $OUT/qk.ncu-rep --page source --csv --print-source sass > $OUT/ncu_sass_7e54374.csv 2>&1
wc -l $OUT/ncu_sass_7e54374.csv
grep -E "Duration|DRAM Throughput|Compute \(SM\)|Achieved Occupancy|Theoretical Occupancy|Registers Per|Issued Ipc|Issue Slots Busy|No Eligible|Eligible Warps|Warp Cycles Per Issued|Executed Instructions  |Shared Memory Configuration|Dynamic Shared|Static Shared" $OUT/details.txt | cut -c1-140
