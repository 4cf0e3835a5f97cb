# The whole GPU suite in one device call on a machine of 2, 4 or more GPUs: five pytest processes at once, the test
# files split by the GPUs they need and by duration (4 x H200, 2026-11-27: 72 passed, 6 skipped in 276 s; one pytest
# over tests/gpu takes ~16 min on 2 GPUs). Lane a sees every GPU (the 4-GPU and the parity tests), lane b GPUs 2-3
# (the other 2-GPU tests), lanes c and d one GPU each (1-GPU tests), lane e GPUs 0-1 (the graphed ep 2 runs,
# ~100 s: lane a's 285 s left too little of a lane's time for them); the tiny models share GPUs easily.
# No timing is measured here. From the repo root: bash tests/gpu/lanes.sh [OUT_DIR]. Each lane's log lands in OUT_DIR;
# exit status non-zero if any lane failed. One GPU: the same five processes, all on it (or python -m pytest -q tests/gpu).
source bench/device_env.sh || exit 1
OUT_DIR=${1:-/tmp/gpu_lanes}; mkdir -p "$OUT_DIR"; G=tests/gpu; T0=$(date +%s)
found=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
# Which GPUs each lane sees: four or more GPUs as above; on two, every 2-GPU lane sees both, and test_optimizers moves
# from lane b (442 s on 4 x H200, the longest) to lane a, whose 4-GPU tests skip there.
OPTIM=$G/test_optimizers.py OPTIM_A= OPTIM_B=
if [ "$found" -ge 4 ]; then ALL=0,1,2,3 PAIR=2,3 FIRST_PAIR=0,1 ONE=0 OTHER=1 OPTIM_B=$OPTIM
elif [ "$found" -eq 2 ]; then ALL=0,1 PAIR=0,1 FIRST_PAIR=0,1 ONE=0 OTHER=1 OPTIM_A=$OPTIM
# One GPU: every lane on it (the 2- and 4-GPU tests skip): 60 passed in 153 s on one H200 (28th session,
# bench/results/varlen_slots_h200_2026-11-29/README.md), where two pytest processes took 320 s
elif [ "$found" -eq 1 ]; then ALL=0 PAIR=0 FIRST_PAIR=0 ONE=0 OTHER=0 OPTIM_A=$OPTIM
else echo "lanes.sh found no GPU"; exit 2; fi
lane() {
  local name=$1 visible=$2; shift 2
  CUDA_VISIBLE_DEVICES=$visible timeout "${LANE_S:-570}" python -m pytest -q -rfEs --durations=8 -p no:cacheprovider "$@" \
    > "$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "lane $name (GPUs $visible) rc=$rc after $(( $(date +%s) - T0 )) s: $(grep -E '(passed|failed|error|skipped)' "$OUT_DIR/$name.log" | tail -n 1)"
  return $rc
}
lane a $ALL $G/test_four_gpus.py $G/test_train_parity.py $G/test_step_no_sync.py $OPTIM_A & a=$!
lane b $PAIR $G/test_activation_checkpointing.py $OPTIM_B $G/test_fsdp1_vs_fsdp2.py & b=$!
lane c $ONE $G/test_memory_estimate.py $G/test_packed_rows.py $G/test_grad_norm.py $G/test_gather_kernels.py $G/test_megablocks.py $G/test_quantized_base.py & c=$!
lane d $OTHER $G/test_cuda_graphs.py $G/test_moe_layer.py $G/test_chunked_loss.py $G/test_gpt_oss_layer.py $G/test_adamw_bf16_kernel.py & d=$!
lane e $FIRST_PAIR $G/test_graphs_ep.py $G/test_pull_exchange.py $G/test_graphs_lora.py & e=$!
status=0
for pid in $a $b $c $d $e; do wait $pid || status=1; done
grep -h "^FAILED\|^ERROR" "$OUT_DIR"/*.log
exit $status
