# 26th session, call C (2 x H200, nvidia-h200-x2): the whole GPU suite on a 2-GPU machine (the done rule for main's ep 4
# levers and the removal of WEIGHT_GRADS_BESIDE_EXCHANGE): lanes.sh's five pytest processes over every file of tests/gpu
# (one process over tests/gpu takes ~16 min, past a call's 10).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LANE_S=${LANE_S:-555} bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes
