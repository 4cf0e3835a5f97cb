#!/usr/bin/env bash
# One device call for the performance issue: GPU correctness of the MoE layer, then the L-layer
# Mixtral-width benchmark on all GPUs of the machine.
#   table (TABLE=1):  (a) eager, (b) grouped_mm, (c) ours with every kept lever, 2 sequences x 2 micro-steps
#                     per GPU (and ours also 4 x 1), (e) megablocks if it imports; all with --compile_dense
#   levers (LEVERS=1): ours with levers switched off one at a time, and with $BASE's code (a copy of an
#                      earlier commit) when BASE is set
#   parity (PARITY=1): bench/gpu_parity.sh (train_fsdp2 ep=2 vs ep=1 on the tiny model, fp32 and bf16)
# LAYER_CHECK=0 skips bench/gpu_layer_check.py.
# Usage: [TABLE=1] [LEVERS=1] [PARITY=1] [BASE=dir] bash bench/gpu_perf_suite.sh OUT_DIR [LAYERS]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output dir}; layers=${2:-8}
gpus=$(nvidia-smi -L | wc -l)
run() { echo "== $(date +%T) $*"; "$@"; }
[ "${LAYER_CHECK:-1}" = 1 ] && run torchrun --standalone --nproc_per_node=1 bench/gpu_layer_check.py 2>&1 | grep -E "rel|bound|Error|error|torch "
common="--layers $layers --grad_accum 4 --steps 10 --warmup 3 --fused_adamw"
bench="torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py $common"
table=$out/h200x${gpus}_L${layers}.jsonl
levers=$out/levers_h200x${gpus}_L${layers}.jsonl
keep() { grep -E '^\{|Error|error'; }
if [ "${TABLE:-0}" = 1 ]; then
  # Same global batch (4 sequences per GPU per step) as 2 x 2 micro-steps; ours also as one micro-step of 4.
  # Every configuration with compiled attention and norms (--compile_dense), as train_fsdp2.py does on GPUs.
  t="--compile_dense --micro_batch 2 --grad_accum 2 --out $table"
  run $bench --config eager $t 2>&1 | keep
  run $bench --config grouped_mm $t 2>&1 | keep
  run $bench --config ep --compile_loss $t --profile $out/profile_ep_h200x${gpus}_L${layers}.txt 2>&1 | keep
  run $bench --config ep --compile_loss --compile_dense --micro_batch 4 --grad_accum 1 --out $table 2>&1 | keep
  if python3 -c "import megablocks" 2>/dev/null; then
    run $bench --config megablocks --compile_loss $t 2>&1 | keep
  fi
fi
if [ "${LEVERS:-0}" = 1 ]; then
  if [ -n "${BASE:-}" ]; then
    (cd "$BASE" && run torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py $common --config ep --out $levers 2>&1 | keep)
  fi
  run $bench --config ep --no_compile --out $levers 2>&1 | keep
  run $bench --config ep --no_compile --out $levers 2>&1 | keep
  run $bench --config ep --out $levers --profile $out/profile_levers.txt 2>&1 | keep
  run $bench --config ep --micro_batch 2 --grad_accum 2 --out $levers 2>&1 | keep
fi
if [ "${PARITY:-0}" = 1 ]; then
  run bash bench/gpu_parity.sh /tmp/parity 2>&1 | tail -n 12
fi
echo "== $(date +%T) done"
