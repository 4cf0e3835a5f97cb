#!/usr/bin/env bash
# Full-size Mixtral-8x7B (32 layers, random weights) on one 4 x H200 machine, ours against transformers' own
# FSDP2 + EP, each variant a fresh launch with 1 x 4 micro-batches of 4096 tokens per GPU, 2 warmup + 3 measured steps:
#   hf          transformers' DistributedConfig FSDP2 + EP (bench/bench_peer_hf.py): pure bf16, activation checkpointing
#   ours_sel    train_fsdp2.py with $OURS_SEL (bf16 AdamW, selective checkpointing, experts FSDP-sharded)
#   ours_full   the same with full checkpointing ($OURS_FULL)
#   ours_part   full checkpointing on $PART_LAYERS of the layers only, the rest keep their activations ($OURS_PART)
#   ours_none   no checkpointing ($OURS_NONE)
#   emul16      train_fsdp2.py, 16 layers on 4 GPUs each capped at $EMUL_GIB GiB: the memory per GPU of 32 layers
#               on 8 x 80 GB ($EMUL16)
#   hf_emul16   the peer in the same 16-layer, capped setting
# Usage, from the repo root with .whl carried (transformers 5.23 wheels, installed to /tmp/site):
#   bash bench/full_size.sh [VARIANT ...]          (default: hf ours_full; ours_sel ran out of memory at 32 layers
#                                                   on 4 x H200, 2026-11-22)
# The 93 GB checkpoint is written to $CKPT once per machine (~130 s; kept while the machine stays warm between
# calls); the 16-layer one is a view of its first 16 layers (links, no copy). Each variant gets a timeout, and one that no longer fits in $BUDGET_S seconds
# from the start is skipped, so the call ends inside the device's 10 minutes. train_fsdp2 runs stop after their
# last step, before the final export (bench_fsdp1.py --skip_export): their peak memory is rank 0's.
# Results: $OUT/full_size.jsonl (one record per variant), $OUT/<variant>.log, and a table printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
source bench/device_env.sh
variants=${*:-hf ours_full}
out=${OUT:-/tmp/full_size_out}; mkdir -p "$out"
results=$out/full_size.jsonl
full=${LAYERS:-32}; half=$((full / 2))  # Mixtral-8x7B's 32 (fewer for a CPU smoke test)
ckpt=${CKPT:-/tmp/mixtral-L$full}; ckpt_half=$ckpt-first$half
budget=${BUDGET_S:-560}
gpus=${GPUS:-$(nvidia-smi -L | wc -l)}
EMUL_GIB=${EMUL_GIB:-78}  # an H100 80GB gives PyTorch 79.2 GiB, about 78 of it past the CUDA context
# Ours: train_fsdp2.py settings of each variant (edit here; the batch, steps and data are bench_fsdp1.py's flags below).
OURS_SEL=${OURS_SEL:-"--ep_size $gpus --optim adamw_bf16 --activation_checkpointing selective --shard_experts true"}
OURS_FULL=${OURS_FULL:-"--ep_size $gpus --optim adamw_bf16 --activation_checkpointing full --shard_experts true"}
OURS_PART=${OURS_PART:-"$OURS_FULL --activation_checkpointing_layers ${PART_LAYERS:-$((full / 2))}"}
OURS_NONE=${OURS_NONE:-"--ep_size $gpus --optim adamw_bf16 --activation_checkpointing none --shard_experts true"}
EMUL16=${EMUL16:-"$OURS_SEL --gpu_memory_gib $EMUL_GIB"}
# The peer: bench_peer_hf.py flags.
HF=${HF:-"--precision bf16 --ac"}
batch="--seq ${SEQ:-4096} --micro_batch 1 --grad_accum 4 --warmup 2 --steps 3"
dims="--hidden ${HIDDEN:-4096} --intermediate ${INTERMEDIATE:-14336}"  # Mixtral-8x7B's (smaller ones for a CPU smoke test)
echo "== $(date +%T) $gpus GPUs; variants: $variants; torch $(python3 -c 'import torch; print(torch.__version__)'), transformers $(python3 -c 'import transformers; print(transformers.__version__)')"

left() { echo $((budget - SECONDS)); }
# fits NAME LIMIT: the timeout for the variant (LIMIT, or what is left of the budget), or nothing when under 90 s
fits() {
  local t=$(( $2 < $(left) - 10 ? $2 : $(left) - 10 ))
  if [ "$t" -lt 90 ]; then
    echo "== $(date +%T) $1: skipped, $(left) s left of the ${budget} s budget"
    echo "{\"config\": \"$1\", \"status\": \"skipped\", \"error\": \"$(left) s left of the ${budget} s budget\"}" >>"$results"
    return 1
  fi
  echo "$t"
}
checkpoint() {  # checkpoint LAYERS DIR
  python3 -c "import sys; sys.path.insert(0, 'bench'); from bench_fsdp1 import checkpoint_complete as c; sys.exit(0 if c('$2', $1, ${HIDDEN:-4096}, ${INTERMEDIATE:-14336}) else 1)" && return 0
  if [ "$1" = "$full" ]; then
    echo "== $(date +%T) writing the $full-layer checkpoint to $2"
    python3 bench/bench_fsdp1.py write --dir "$2" --layers "$full" $dims 2>&1 | grep -vi warn
  else
    checkpoint "$full" "$ckpt" && python3 bench/bench_fsdp1.py view --dir "$2" --source "$ckpt" --layers "$1"
  fi
}
peer() {  # peer NAME LAYERS DIR LIMIT FLAGS...
  local name=$1 layers=$2 dir=$3 limit=$4; shift 4
  checkpoint "$layers" "$dir" || return
  local t; t=$(fits "$name" "$limit") || { echo "$t"; return; }
  echo "== $(date +%T) $name (timeout $t s): bench_peer_hf.py $*"
  timeout -k 10 "$t" torchrun --standalone --nproc_per_node="$gpus" bench/bench_peer_hf.py --dir "$dir" $batch "$@" \
    --out "$out/$name.jsonl" >"$out/$name.log" 2>&1
  local rc=$?
  grep -E '^step |Error|error' "$out/$name.log" | tail -n 12 | cut -c1-400
  if [ -s "$out/$name.jsonl" ]; then  # the record, named by variant
    python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1]); r['variant']=sys.argv[2]; print(json.dumps(r))" \
      "$out/$name.jsonl" "$name" >>"$results"
  else
    echo "{\"config\": \"hf_native_fsdp2_ep\", \"variant\": \"$name\", \"layers\": $layers, \"status\": \"error\", \"error\": \"exit $rc (124: timeout), see $name.log\"}" >>"$results"
  fi
  rm -f "$out/$name.jsonl"
}
ours() {  # ours NAME LAYERS DIR LIMIT TRAIN_ARGS
  local name=$1 layers=$2 dir=$3 limit=$4 train_args=$5
  checkpoint "$layers" "$dir" || return
  local t; t=$(fits "$name" "$limit") || { echo "$t"; return; }
  local work=/tmp/full_size_work/$name
  rm -rf "$work"
  echo "== $(date +%T) $name (timeout $t s): train_fsdp2.py $train_args"
  python3 bench/bench_fsdp1.py run --script train_fsdp2.py --dir "$dir" --layers "$layers" --gpus "$gpus" $batch $dims \
    --train_args "$train_args" --name "$name" --skip_export --timeout "$((t - 40))" --work "$work" --out "$results" \
    >"$out/$name.log" 2>&1
  grep -E '^  |Error|error' "$out/$name.log" | tail -n 12 | cut -c1-400
  { echo "---- launch.log"; cat "$work/launch.log"; } >>"$out/$name.log" 2>/dev/null
  rm -rf "$work"  # the run's output (a partial export too)
  sleep 3  # the killed ranks release their GPUs
}

for v in $variants; do
  case $v in
    hf)        peer hf "$full" "$ckpt" 240 $HF ;;
    ours_sel)  ours ours_sel "$full" "$ckpt" 300 "$OURS_SEL" ;;
    ours_full) ours ours_full "$full" "$ckpt" 300 "$OURS_FULL" ;;
    ours_part) ours ours_part "$full" "$ckpt" 300 "$OURS_PART" ;;
    ours_none) ours ours_none "$full" "$ckpt" 300 "$OURS_NONE" ;;
    emul16)    ours emul16 "$half" "$ckpt_half" 240 "$EMUL16" ;;
    hf_emul16) peer hf_emul16 "$half" "$ckpt_half" 200 $HF --gpu_memory_gib "$EMUL_GIB" ;;
    *) echo "unknown variant $v; choose from hf ours_sel ours_full ours_part ours_none emul16 hf_emul16"; exit 2 ;;
  esac
done

echo "== $(date +%T) done in $SECONDS s"
python3 bench/full_size_table.py "$results"
