# 31st session, call A (one H200): the done rule's one-GPU half for f230d94 (recompute_swiglu, guarded to ep 1):
# tests/gpu/lanes.sh on main; then one launch each of the Qwen3 shape, 12 layers, defaults, synthetic rows, SwiGLU's
# output kept (the default) and made again (--recompute_swiglu true): peak and step. Carry .whl .calls.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
LANE_S=330 bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
(cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes)
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=$(( 560 - ($(date +%s) - T0) - 100 )) AB_LAUNCH_S=140
ab_run kept $PWD 1 ours_synthetic; ab_run again $PWD 1 ours_synthetic_swiglu_again
ab_records; grep -h "recompute_swiglu" $OUT/again.txt | head -2
ab_pack
