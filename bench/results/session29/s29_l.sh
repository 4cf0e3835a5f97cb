# 29th session, call L (one H200): tests/gpu/test_moe_layer.py on .cand (gpu-candidates at 8c22f01: the recompute_swiglu
# switch, off by default; the layer's switch on against off over two micro-steps, to the bit). Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
cd .cand || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
timeout 300 python -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_moe_layer.py > $OUT/moe_layer.log 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; tail -4 $OUT/moe_layer.log
