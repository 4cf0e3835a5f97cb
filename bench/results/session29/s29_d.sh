# 29th session, call D (2 x H200): ep 2, Qwen3 shape, 12 layers, defaults: main against .cand (ranks' varlen slots) on
# the chat records and synthetic rows, alternating launches; then .cand's expert_placement first_step on chat. Carry
# .whl .calls .cand.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 16 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=470 AB_LAUNCH_S=130
ab_run main_a $PWD 2 ours_chat; ab_run cand_a $PWD/.cand 2 ours_chat
ab_run cand_b $PWD/.cand 2 ours_chat; ab_run main_b $PWD 2 ours_chat
ab_run cand_place $PWD/.cand 2 ours_chat_first_step
ab_records; grep -h "cuda_graphs: captured\|experts" $OUT/cand_a.txt | head -5
ab_pack
