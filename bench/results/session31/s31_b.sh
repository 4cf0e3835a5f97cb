# 31st session, call B (one H200): tests/gpu/test_activation_checkpointing.py with recompute_swiglu's new mode (bf16:
# no checkpointing's loss and gradients within the noise bound; the same backward GEMMs; the path taken). Carry .whl .calls.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
timeout 400 python -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_activation_checkpointing.py > $OUT/activation_checkpointing.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; tail -5 $OUT/activation_checkpointing.log
