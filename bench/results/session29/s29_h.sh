# 29th/30th session, call H (4 x H200, nvidia-h200-x4): full Qwen3-30B-A3B (48 layers, ep 4) at the defaults, main against
# .cand (gpu-candidates: with the SwiGLU output made again in the backward the fit check lets auto take the token pull at
# factor 3 with whole micro-steps as graphs at 48 layers: 123.9 GiB estimated, against main's exact exchange + segments;
# 24th session: 1.860 s, 7,359 tokens/s per GPU; target 12,040). Synthetic first, then chat. Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 48 --warmup 2 --steps 5 --chat_steps 5 --run_timeout 270 --dir /tmp/qwen3_30b_a3b-L48"
AB_SKIP_AFTER_S=330 AB_LAUNCH_S=300  # the first launch writes the 61 GB checkpoint (~100 s)
ab_run cand48 $PWD/.cand 4 ours_synthetic; ab_run main48 $PWD 4 ours_synthetic
ab_run cand48_chat $PWD/.cand 4 ours_chat
ab_records; grep -h "ep_capacity_factor auto\|cuda_graphs" $OUT/cand48.txt | head -3; ab_pack
