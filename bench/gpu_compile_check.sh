#!/usr/bin/env bash
# GPU check of compile_dense in train_fsdp2.py (tiny model, N GPUs, ep = N): compiled attention and norms
# against eager, fp32 and bf16, and with activation checkpointing. Usage: bash bench/gpu_compile_check.sh OUT [N]
set -uo pipefail
out=${1:?output dir}; n=${2:-2}
common="--max_steps 20 --per_device_train_batch_size 4 --gradient_accumulation_steps 2 --overwrite_output_dir true"
run() { torchrun --standalone --nproc_per_node=$n train_fsdp2.py $common "$@" 2>&1 | grep -E "^(summary|error|compile_dense)|Error" | tail -3; }
for dtype in fp32 bf16; do
  run --dtype $dtype --compile_dense true --output_dir $out/${dtype}_compiled
  run --dtype $dtype --compile_dense false --output_dir $out/${dtype}_eager
  python3 bench/compare_runs.py $out/${dtype}_compiled/metrics.jsonl $out/${dtype}_eager/metrics.jsonl
done
run --dtype bf16 --compile_dense true --activation_checkpointing true --output_dir $out/bf16_compiled_ac
python3 bench/compare_runs.py $out/bf16_compiled_ac/metrics.jsonl $out/bf16_eager/metrics.jsonl
