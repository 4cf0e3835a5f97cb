# One H200: LoRA at full depth over a quantized base on the models whose bf16 base does not fit one GPU:
# gpt-oss-120b from MXFP4 experts, Mixtral-8x7B capped at 80 GB (74.5 GiB), GLM-4.5-Air from its FP8 release.
source bench/device_env.sh || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
T0=$(date +%s)
B="torchrun --nproc_per_node=1 bench/lora_peft.py --variant ours --grad_accum 4 --steps 3 --warmup 2 --adapter_dtype bf16 --quantize_base fp8 --out $OUT/big.jsonl"
timeout 170 $B --model_config tests/configs/gpt-oss-120b --layers 36 --release mxfp4 --checkpoint_experts --attn flex_attention > $OUT/gpt_oss_120b.log 2>&1
echo "gpt-oss-120b rc=$? after $(( $(date +%s) - T0 )) s"; grep -v Warning $OUT/gpt_oss_120b.log | tail -n 4 | cut -c1-300
timeout 190 $B --model_config tests/configs/mixtral-8x7b --layers 32 --release bf16 --checkpoint_experts --gpu_memory_gib 74.5 > $OUT/mixtral_8x7b.log 2>&1
echo "mixtral-8x7b rc=$? after $(( $(date +%s) - T0 )) s"; grep -v Warning $OUT/mixtral_8x7b.log | tail -n 4 | cut -c1-300
left=$(( 575 - ($(date +%s) - T0) ))
timeout $left $B --model_config tests/configs/glm-4.5-air --layers 46 --release fp8 --ac full > $OUT/glm_4.5_air.log 2>&1
echo "glm-4.5-air rc=$? after $(( $(date +%s) - T0 )) s"; grep -v Warning $OUT/glm_4.5_air.log | tail -n 4 | cut -c1-300
python - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "big.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    print(r.get("model"), r.get("layers"), r.get("release"), r.get("status"), r.get("step_time_s"), r.get("tokens_per_s"), r.get("peak_allocated_gib"), r.get("peak_reserved_gib"), r.get("losses"), r.get("error"))
PY
