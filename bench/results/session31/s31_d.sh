# 31st session, call D (one H200): Qwen3 shape, 12 layers, chat records at the defaults (varlen, CUDA graphs, empty
# document slots), one launch as usual and one with every unwritten tensor NaN (bench/results/session31/nanfill): the
# losses must stay finite and alike. Carry .whl.
source bench/device_env.sh || exit 1
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --chat_steps 10 --run_timeout 150 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=400 AB_LAUNCH_S=200
ab_run plain $PWD 1 ours_chat
NAN_FILL=1 CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=$PWD/bench/results/session31/nanfill${PYTHONPATH:+:$PYTHONPATH} ab_run nan $PWD 1 ours_chat
ab_records; ab_pack
