# Prepared in the 31st session for a 2 x H200 call after x2_a_lanes.sh passed: recompute_swiglu at ep 2 (its guard
# raised to 2 in this call's copy of the tree), Qwen3 shape, 12 layers, defaults: SwiGLU's output kept against made
# again, alternating launches (kept, again, again, kept), synthetic rows. Carry .whl.
source bench/device_env.sh || exit 1
sed -i 's/^RECOMPUTE_SWIGLU_RAN_AT_EP = 1$/RECOMPUTE_SWIGLU_RAN_AT_EP = 2/' megablocks_utils/moe/experts.py
grep -n "^RECOMPUTE_SWIGLU_RAN_AT_EP" megablocks_utils/moe/experts.py
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 12 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=440 AB_LAUNCH_S=140
ab_run kept_a $PWD 2 ours_synthetic; ab_run again_a $PWD 2 ours_synthetic_swiglu_again
ab_run again_b $PWD 2 ours_synthetic_swiglu_again; ab_run kept_b $PWD 2 ours_synthetic
ab_records; ab_pack
