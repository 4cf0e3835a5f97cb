# 31st session, call E (one H200): recompute_swiglu on the chat records at the defaults (call A measured synthetic
# rows): Qwen3 shape, 12 layers, ours_chat against ours_chat_swiglu_again, one launch each. Carry .whl.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 10 --run_timeout 150 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=420 AB_LAUNCH_S=200
ab_run kept_chat $PWD 1 ours_chat; ab_run again_chat $PWD 1 ours_chat_swiglu_again
ab_records; ab_pack
