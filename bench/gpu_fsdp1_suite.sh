#!/usr/bin/env bash
# One device call for train_fsdp1.py on N GPUs of one host (default 4, ~4 min on 4 H200s at L = 8):
#  1. bench/gpu_fsdp1_check.sh on the tiny model (fp32 equality with train_fsdp2.py, resume, bf16 tolerance),
#     while the Mixtral-width L-layer checkpoint that 2. needs is written to local disk in the background;
#  2. configuration (d) of the throughput benchmark: train_fsdp1.py (Trainer + accelerate FSDP1 + EP) at
#     Mixtral width, L layers, seq 4096 (bench/bench_fsdp1.py);
#  3. if less than ~3.5 min have passed, configuration (c) (bench_moe.py --config ep --fused_adamw) on the
#     same GPUs, to set (d) beside the same EP layer without Trainer and FSDP1.
# Usage: bash bench/gpu_fsdp1_suite.sh OUT_DIR [N=4] [LAYERS=8]
# BENCH_ARGS (e.g. "--hidden 64 --intermediate 128 --seq 128" for a CPU smoke test) goes to bench_fsdp1.py and bench_moe.py.
# OUT_DIR (flat) gets suite.log, bench_L<L>.jsonl (one record per configuration), fsdp1_ep_metrics.jsonl,
# fsdp1_ep_summary.json and fsdp1_ep_launch.log (the (d) run's own), fsdp1_check.tar.gz (the check's
# per-step metrics) and bench_L<L>.png where matplotlib is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$1
n=${2:-4}
layers=${3:-8}
mkdir -p "$out"

main() {
  local base
  base=$(mktemp -d /tmp/fsdp1_suite.XXXXXX)  # on the local disk: the checkpoint is 23 GB at L = 8, the run's export 45 GB
  local ckpt=$base/mixtral-L$layers work=$base/bench_fsdp1 check=$base/fsdp1_check
  local results="$out/bench_L$layers.jsonl"
  stamp() { echo "[suite t=${SECONDS}s] $*"; }
  nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv,noheader || true
  df -h /tmp | tail -n 1
  python3 -c "import torch, transformers, accelerate, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
  # The tiny model first: the check and the checkpoint writer (its tokenizer) both need it.
  [ -d tiny-mixtral ] || python3 -c "from megablocks_utils.model.tiny import make_tiny_mixtral; make_tiny_mixtral('tiny-mixtral', 'data.json')"
  stamp "writing the L=$layers checkpoint to $ckpt in the background (CPU only)"
  python3 bench/bench_fsdp1.py write --dir "$ckpt" --layers "$layers" ${BENCH_ARGS:-} > "$base/write.log" 2>&1 &
  local writer=$!
  stamp "1. bench/gpu_fsdp1_check.sh on $n GPUs"
  bash bench/gpu_fsdp1_check.sh "$check" "$n"
  tar -czf "$out/fsdp1_check.tar.gz" -C "$base" fsdp1_check
  stamp "waiting for the checkpoint writer"
  wait "$writer" || echo "the writer failed; bench_fsdp1.py run writes the checkpoint itself"
  cat "$base/write.log"
  stamp "2. (d) train_fsdp1.py, L=$layers, $n GPUs"
  python3 bench/bench_fsdp1.py run --dir "$ckpt" --layers "$layers" --gpus "$n" --work "$work" --timeout 240 --out "$results" ${BENCH_ARGS:-}
  cp "$work/run/metrics.jsonl" "$out/fsdp1_ep_metrics.jsonl"
  cp "$work/run/summary.json" "$out/fsdp1_ep_summary.json"
  cp "$work/launch.log" "$out/fsdp1_ep_launch.log"
  if (( SECONDS < 200 )); then
    stamp "3. (c) bench_moe.py --config ep --fused_adamw, same GPUs and layers"
    timeout 80 torchrun --standalone --nproc_per_node "$n" bench/bench_moe.py --config ep --layers "$layers" --fused_adamw \
      --out "$results" ${BENCH_ARGS:-} 2>&1 | grep -E '^\{|Error|error' || true
  else
    stamp "3. skipped: (c) would not finish within ~5 min"
  fi
  python3 bench/plot_results.py "$results"
  rm -rf "$base"
  stamp "done"
}

main 2>&1 | tee "$out/suite.log"
