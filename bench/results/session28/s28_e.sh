# 28th session, call E (one H200): varlen's documents padded to 8 slots on one rank (this checkout) against 64 (.docs64 =
# git archive of 92eabae^{tree}+, main before it), chat records at the defaults, ABBA launches; then the 1-GPU graph
# and packed-row tests on this checkout. Carry .whl .calls .docs64.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 16 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=330 AB_LAUNCH_S=125
ab_run docs64_a $PWD/.docs64 1 ours_chat; ab_run docs8_a $PWD 1 ours_chat
ab_run docs8_b $PWD 1 ours_chat; ab_run docs64_b $PWD/.docs64 1 ours_chat
ab_records; grep -h "cuda_graphs: captured" $OUT/docs8_a.txt | head -3
export PYTHONPATH=$PWD:$PYTHONPATH
left=$(( 580 - ($(date +%s) - AB_T0) ))
timeout $left python -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_cuda_graphs.py tests/gpu/test_packed_rows.py \
  > $OUT/gpu_tests.log 2>&1; echo "tests rc=$? $(( $(date +%s) - AB_T0 ))s"; tail -3 $OUT/gpu_tests.log
ab_pack
