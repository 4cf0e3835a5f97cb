# 29th session, call F (one H200): .cand = git archive of gpu-candidates at 7739215 (main + in-run-placement +
# varlen-slots + swiglu-recompute): the done rule's one-GPU half (tests/gpu/lanes.sh on the one GPU), then the peak and
# step of SwiGLU's output made again in the backward: main against .cand, Qwen3 shape, 12 layers, synthetic rows, defaults
# (one launch each; .cand's other changes do not touch these rows at one rank). Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
T0=$(date +%s)
(cd .cand && PYTHONPATH=$PWD:$PYTHONPATH LANE_S=330 bash tests/gpu/lanes.sh $OUT/lanes); echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
(cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes)
source bench/ab_launches.sh
AB_ARGS="--shape qwen3_30b_a3b --layers 12 --warmup 3 --steps 8 --run_timeout 110 --dir /tmp/qwen3_30b_a3b-L12"
AB_SKIP_AFTER_S=$(( 560 - ($(date +%s) - T0) - 90 )) AB_LAUNCH_S=150
ab_run main_a $PWD 1 ours_synthetic; ab_run cand_a $PWD/.cand 1 ours_synthetic
ab_records
ab_pack
