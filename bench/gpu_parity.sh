#!/usr/bin/env bash
# GPU parity of train_fsdp2.py: ep = N (experts split over the N GPUs) against ep = 1 (experts
# replicated, dp = N), same global batch, in fp32 and in bf16. Writes metrics to $1 (default /tmp/parity).
# Usage: bash bench/gpu_parity.sh [OUT_DIR] [N=2]
set -euo pipefail
out=${1:-/tmp/parity}
n=${2:-2}
common="--max_steps 20 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --overwrite_output_dir true"
for dtype in fp32 bf16; do
  for ep in $n 1; do
    torchrun --standalone --nproc_per_node=$n train_fsdp2.py $common --dtype $dtype --ep_size $ep --output_dir $out/${dtype}_ep$ep 2>&1 | grep -E "^(summary|error)"
  done
  python3 bench/compare_runs.py $out/${dtype}_ep$n/metrics.jsonl $out/${dtype}_ep1/metrics.jsonl
done
