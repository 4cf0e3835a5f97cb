#!/usr/bin/env bash
# One device call: what sharding experts over dp costs inside one node, and activation checkpointing's
# price, at Mixtral width (bench_moe.py, all GPUs of the machine, 4 sequences of 4096 per GPU per step).
#   sharding: ep = gpus/2 (dp = 2) with experts FSDP-sharded over dp vs replicated; ep = gpus as the reference
#   ac:       ep = gpus, no checkpointing vs full vs selective
# Usage: bash bench/gpu_expert_sharding.sh OUT_DIR [LAYERS] [PARTS (default "sharding ac")]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?output dir}; layers=${2:-8}; parts=${3:-sharding ac}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(nvidia-smi -L | wc -l)
mkdir -p "$out"
file=$out/expert_sharding_h200x${gpus}_L${layers}.jsonl
bench="torchrun --standalone --nproc_per_node=$gpus bench/bench_moe.py --config ep --layers $layers --steps 8 --warmup 3
       --fused_adamw --compile_dense --compile_loss --micro_batch 2 --grad_accum 2 --out $file"
run() { echo "== $(date +%T) $*"; "$@" 2>&1 | grep -E '^\{|Error|error' | cut -c1-600; }
for part in $parts; do
  case $part in
    sharding)
      run $bench --ep "$gpus"
      run $bench --ep $((gpus / 2)) --shard_experts true
      run $bench --ep $((gpus / 2)) --shard_experts false ;;
    ac)
      run $bench --ep "$gpus" --ac
      run $bench --ep "$gpus" --ac --selective_ac ;;
  esac
done
python3 - "$file" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(f"{'ep':>3} {'shard':>6} {'ac':>10} {'s/step':>7} {'tok/s/GPU':>9} {'MFU':>6} {'alloc GiB':>9}")
for r in rows:
    ac = ("selective" if r.get("selective_ac") else "full") if r["activation_checkpointing"] else "none"
    if r["status"] != "ok":
        print(f"{r['ep']:>3} {str(r['shard_experts']):>6} {ac:>10} {r['status']}")
        continue
    print(f"{r['ep']:>3} {str(r['shard_experts']):>6} {ac:>10} {r['step_time_s']:7.3f} {r['tokens_per_s_per_gpu']:9.0f} "
          f"{r['mfu']:6.1%} {r['peak_allocated_gib']:9.1f}")
EOF
