# 26th session, call D (1 x H200, nvidia-h200): the whole GPU suite on a 1-GPU machine (the done rule), as two pytest
# processes over disjoint halves of tests/gpu at once (one process takes past a call's 10 min); the 2- and 4-GPU tests
# skip here.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); G=tests/gpu; mkdir -p $OUT/one
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
half() { local name=$1; shift; timeout ${HALF_S:-540} python -m pytest -q -rfEs --durations=8 -p no:cacheprovider "$@" > $OUT/one/$name.log 2>&1
  local rc=$?; echo "half $name rc=$rc after $(( $(date +%s) - T0 )) s: $(grep -E '(passed|failed|error)' $OUT/one/$name.log | tail -n 1)"; return $rc; }
half x $G/test_memory_estimate.py $G/test_packed_rows.py $G/test_grad_norm.py $G/test_gather_kernels.py $G/test_megablocks.py \
  $G/test_activation_checkpointing.py $G/test_optimizers.py $G/test_four_gpus.py $G/test_step_no_sync.py & x=$!
half y $G/test_cuda_graphs.py $G/test_moe_layer.py $G/test_chunked_loss.py $G/test_gpt_oss_layer.py $G/test_adamw_bf16_kernel.py \
  $G/test_train_parity.py $G/test_fsdp1_vs_fsdp2.py $G/test_graphs_ep.py $G/test_pull_exchange.py & y=$!
wait $x; a=$?; wait $y; b=$?; echo "halves rc=$a,$b $(( $(date +%s) - T0 ))s"
grep -h "^FAILED\|^ERROR" $OUT/one/*.log
cd $OUT && tar -czf one.tgz one && rm -rf one
