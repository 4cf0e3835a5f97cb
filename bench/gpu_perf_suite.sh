#!/usr/bin/env bash
# One device call for the performance issue: GPU correctness of the layer, then the L-layer
# Mixtral-width benchmark on all GPUs: (a) eager, (b) grouped_mm, (c) ours before the change (code in
# $BASE, a copy of the previous commit), ours after without and with --reuse_casts (+ a profile).
# Usage: bash bench/gpu_perf_suite.sh OUT_DIR [LAYERS] [BASE_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output dir}; layers=${2:-8}; base=${3:-}
gpus=$(nvidia-smi -L | wc -l)
run() { echo "== $(date +%T) $*"; "$@"; }
run torchrun --standalone --nproc_per_node=1 bench/gpu_layer_check.py 2>&1 | tail -n 15
common="--layers $layers --grad_accum 4 --steps 10 --warmup 3 --fused_adamw"
bench="torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py $common"
table=$out/h200x${gpus}_L${layers}.jsonl
levers=$out/levers_h200x${gpus}_L${layers}.jsonl
run $bench --config eager --out $table 2>&1 | grep -E '^\{|Error' 
run $bench --config grouped_mm --out $table 2>&1 | grep -E '^\{|Error'
if [ -n "$base" ]; then
  (cd "$base" && run torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py $common --config ep --out $levers 2>&1 | grep -E '^\{|Error')
fi
run $bench --config ep --out $levers 2>&1 | grep -E '^\{|Error'
run $bench --config ep --reuse_casts --out $levers --profile $out/profile_ep_h200x${gpus}_L${layers}.txt 2>&1 | grep -E '^\{|Error'
tail -n 1 $levers >> $table
echo "== $(date +%T) done"
