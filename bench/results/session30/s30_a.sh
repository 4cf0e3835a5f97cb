# 30th session, call A (one H200): tests/gpu on main with transformers 5.24.0, the newest requirements.txt allows
# (5.24 was tested on CPU only; the device image has 5.17, earlier calls carried 5.23). Carry .whl524 .calls.
mv .whl524 .whl && source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, transformers, accelerate, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
LANE_S=${LANE_S:-450} bash tests/gpu/lanes.sh $OUT/lanes; echo "lanes rc=$? $(( $(date +%s) - T0 ))s"
cd $OUT && tar -czf lanes.tgz lanes && rm -rf lanes
