# Prepared in the 31st session for the next 2 x H200 (nvidia-h200-x2) call: the done rule's 2-GPU half for main's
# 4e1c7ac (one rank's varlen slots), f230d94 (recompute_swiglu, guarded to ep 1) and 1bcb473 (its check at ep 2 in
# test_activation_checkpointing.py, set past the guard). If every lane passes, raise moe/experts.py
# RECOMPUTE_SWIGLU_RAN_AT_EP to 2 and commit. From the repo root; carry .whl.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
LANE_S=540 bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
(cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes)
