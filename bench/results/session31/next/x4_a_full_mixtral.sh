# Prepared in the 31st session for a 4 x H200 (nvidia-h200-x4) call: recompute_swiglu's check at ep 4
# (test_activation_checkpointing.py's 4-GPU case), then full Mixtral-8x7B (32 layers, ep 4) without checkpointing, its
# SwiGLU output made again (134.6 GiB estimated; without it 143.8 does not fit), against 16 of 32 layers checkpointed
# (24th session: 4.512 s, 1.36x transformers, 30.4% MFU) and transformers if time is left. The guard raised to 4 in
# this call's copy only. Carry .whl.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
sed -i 's/^RECOMPUTE_SWIGLU_RAN_AT_EP = 1$/RECOMPUTE_SWIGLU_RAN_AT_EP = 4/' megablocks_utils/moe/experts.py
T0=$(date +%s)
timeout 150 python -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_activation_checkpointing.py -k 4gpus > $OUT/ac_4gpus.log 2>&1
echo "ac 4gpus rc=$? $(( $(date +%s) - T0 ))s"; tail -2 $OUT/ac_4gpus.log
python bench/run.py full_size --gpus 4 --layers 32 --runs ours_none_swiglu_again,ours_part,hf --budget_s $(( 570 - ($(date +%s) - T0) )) \
  --out $OUT/mixtral32.jsonl > $OUT/mixtral32.txt 2>&1
echo "full_size rc=$? $(( $(date +%s) - T0 ))s"; grep -v "^  " $OUT/mixtral32.txt | tail -12
