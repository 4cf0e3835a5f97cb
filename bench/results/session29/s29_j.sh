# 29th session, call J (one H200): what making SwiGLU's output again in the backward costs a one-GPU step (no memory is
# short there): main against .cand (gpu-candidates; at one rank only the SwiGLU change acts on these rows), Qwen3
# shape, 12 layers, synthetic rows, defaults, ABBA launches. Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 10 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=400 AB_LAUNCH_S=140
ab_run main_a $PWD 1 ours_synthetic; ab_run cand_a $PWD/.cand 1 ours_synthetic
ab_run cand_b $PWD/.cand 1 ours_synthetic; ab_run main_b $PWD 1 ours_synthetic
ab_records; ab_pack
