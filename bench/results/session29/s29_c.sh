# 29th session, call C (2 x H200, nvidia-h200-x2): the done rule's 2-GPU half for what waits on it, in one lanes run:
# .cand = git archive of branch gpu-candidates = main (4e1c7ac: one rank's varlen slots) + in-run-placement
# (expert_placement first_step) + varlen-slots (ranks pad varlen to the busiest rank's count, no collective).
# Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
cd .cand || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LANE_S=${LANE_S:-540} bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes
