# Prepared in the 31st session for a 4 x H200 call: full Qwen3-30B-A3B (48 layers, ep 4) at the defaults with
# --recompute_swiglu true (the guard raised to 4 in this call's copy): the fit check then lets auto take the token pull
# at factor 3 with whole micro-steps as graphs (124.0 GiB estimated, within 90% of 139.8), against the defaults (the
# exact exchange and segment graphs: 24th session 1.860 s, 7,359 tokens/s per GPU; target 12,040). Carry .whl.
source bench/device_env.sh || exit 1
sed -i 's/^RECOMPUTE_SWIGLU_RAN_AT_EP = 1$/RECOMPUTE_SWIGLU_RAN_AT_EP = 4/' megablocks_utils/moe/experts.py
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 48 --warmup 2 --steps 5 --chat_steps 5 --run_timeout 270 --dir /tmp/qwen3_30b_a3b-L48"
AB_SKIP_AFTER_S=330 AB_LAUNCH_S=300  # the first launch writes the 61 GB checkpoint (~100 s)
ab_run again48 $PWD 4 ours_synthetic_swiglu_again; ab_run kept48 $PWD 4 ours_synthetic
ab_records; grep -h "ep_capacity_factor auto\|cuda_graphs\|recompute_swiglu" $OUT/again48.txt | head -4; ab_pack
