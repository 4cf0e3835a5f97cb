# 29th/30th session, call I (4 x H200): full Mixtral-8x7B (32 layers, ep 4) from .cand (the SwiGLU output made again in
# the backward: no checkpointing estimated at 134.5 GiB, fits 139.8) without checkpointing against 16 of 32 layers
# checkpointed (what ran so far: 24th session 4.512 s, 1.36x transformers, 30.4% MFU), then transformers beside them
# if time is left (ours_none_first_step: the experts placed by the first step; the random router loads the busiest
# ep-4 rank ~1.44x the mean at this width). Carry .whl .calls .cand.
source bench/device_env.sh || exit 1
cd .cand || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
python bench/run.py full_size --gpus 4 --layers 32 --runs ours_none,ours_none_first_step,ours_part,hf --budget_s 560 --out $OUT/mixtral32.jsonl > $OUT/mixtral32.txt 2>&1
echo "rc=$? $(( $(date +%s) - T0 ))s"; grep -v "^  " $OUT/mixtral32.txt | tail -12
