# 29th session, call K (one H200): what making SwiGLU's output again in the backward costs one layer and micro-step
# (bench/silu_mul_down_bench.py on .cand: Qwen3, DSV2, Mixtral widths, ep 1). Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
cd .cand || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
timeout 200 python bench/silu_mul_down_bench.py --out $OUT/silu_mul_down.jsonl 2>&1 | tail -5
