# 29th session, call M (one H200): the done rule's 1-GPU half for .cand at its head (4870cf9: main +
# in-run-placement + varlen-slots + swiglu-recompute with its auto switch): tests/gpu/lanes.sh, its five pytest processes on the one GPU. Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
cd .cand || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LANE_S=${LANE_S:-400} bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes
