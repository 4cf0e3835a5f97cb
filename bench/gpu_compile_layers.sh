#!/usr/bin/env bash
# The whole-decoder-layer compile lever (issue #17), one call on a 2-GPU machine: bench_moe's configuration (c) at
# 4 layers without and with --compile_layers, alternating twice, then a profile of (c) as it is now.
# Usage, from the repo root with .whl carried: bash bench/gpu_compile_layers.sh
# Results: $OUT/compile_layers.jsonl, $OUT/profile_ep_h200x2_L4_after.txt (+ .jsonl).
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
out=${OUT:-/tmp/compile_layers_out}; mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
b="--config ep --fused_adamw --compile_loss --compile_dense --layers ${LAYERS:-4} --seq 4096 --micro_batch 2 --grad_accum 2 --warmup 3 --steps 6"
for f in "" "--compile_layers" "" "--compile_layers"; do
  echo "== $(date +%T) ours $f"
  timeout 150 torchrun --standalone --nproc_per_node="$gpus" bench/bench_moe.py $b $f --out "$out/compile_layers.jsonl" 2>&1 | grep -E "Error:" | tail -2
  python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1]); print(r['compile_layers'], r['status'], r.get('step_time_s'), r.get('mfu'), r.get('peak_allocated_gib'), str(r.get('error',''))[:300])" "$out/compile_layers.jsonl"
done
echo "== $(date +%T) profile of (c)"
timeout 150 torchrun --standalone --nproc_per_node="$gpus" bench/bench_moe.py $b --profile "$out/profile_ep_h200x${gpus}_L${LAYERS:-4}_after.txt" \
  --out "$out/profile_after.jsonl" 2>&1 | grep -E "Error:" | tail -2
echo "== $(date +%T) done in $SECONDS s"
