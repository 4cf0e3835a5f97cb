# 22nd session, call D (2 x H200): the weight-gradient kernel's arguments at ep 2 and on one GPU (shapes, strides,
# dtypes, alignment), three steps of train_fsdp2.py at the defaults on synthetic rows. Code: d7c7ae4.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
D=/tmp/qwen3_30b_a3b-L12; mkdir -p /tmp/wg
(cd bench && python -c "
from real_data import write_checkpoint, data_file
write_checkpoint('$D', 'qwen3_30b_a3b', 12); print(data_file('ours_synthetic', '/tmp/wg', '$D', 24))")
ARGS="--model_name_or_path $D --data_path /tmp/wg/synthetic.json --output_dir /tmp/wg/run --overwrite_output_dir true --max_length 4096 --per_device_train_batch_size 1 --gradient_accumulation_steps 4 --optim adamw_bf16 --learning_rate 1e-5 --max_steps 3"
timeout 200 torchrun --nproc_per_node=2 .calls/wg_log.py $ARGS --ep_size 2 > $OUT/ep2.txt 2>&1; el ep2 $?
CUDA_VISIBLE_DEVICES=0 timeout 200 torchrun --nproc_per_node=1 .calls/wg_log.py $ARGS > $OUT/ep1.txt 2>&1; el ep1 $?
grep -h "^WG\|Error" $OUT/ep2.txt $OUT/ep1.txt | cut -c1-400
