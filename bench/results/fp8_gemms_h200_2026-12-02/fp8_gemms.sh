# One H200: the FP8 x FP8 experts' kernel (activations rounded to e4m3 per 128 inputs): its GPU tests, its GEMMs against
# torch's bf16 grouped GEMM and the dequantizing kernel, the fwd+bwd table against torchao's FP8 training GEMMs, then
# LoRA on Qwen3-30B-A3B 48 layers with graphs over the bf16 base against the FP8 base with the FP8 x FP8 GEMMs.
source bench/device_env.sh || exit 1
T0=$(date +%s)
timeout 170 python -m pytest -q -rfEs -p no:cacheprovider tests/gpu/test_quantized_base.py > $OUT/test_quantized_base.log 2>&1
echo "tests rc=$? after $(( $(date +%s) - T0 )) s: $(tail -n 1 $OUT/test_quantized_base.log)"; grep -h "^FAILED\|^ERROR\|assert" $OUT/test_quantized_base.log | head -8 | cut -c1-600
timeout 110 python bench/fp8_gemm_bench.py --shapes qwen3,mixtral > $OUT/kernels.jsonl 2> $OUT/kernels.err
echo "kernels rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 3 $OUT/kernels.err | cut -c1-300
timeout 100 python bench/fp8_gemm_bench.py --table --shapes qwen3,mixtral > $OUT/table.jsonl 2> $OUT/table.err
echo "table rc=$? after $(( $(date +%s) - T0 )) s"; tail -n 3 $OUT/table.err | cut -c1-300
python - <<'PY'
import json, os
for f in ("kernels.jsonl", "table.jsonl"):
    for line in open(os.path.join(os.environ["OUT"], f)):
        r = json.loads(line)
        keys = ("shape", "gemm", "way", "path", "ms", "tflops", "rel_err_rms", "rel_err_max", "error", "fastest", "total_ms")
        print(" ".join(f"{k}={r[k]:.3f}" if isinstance(r.get(k), float) else f"{k}={r[k]}" for k in keys if k in r)[:300])
PY
B="torchrun --nproc_per_node=1 bench/lora_peft.py --variant ours --layers 48 --grad_accum 4 --steps 4 --warmup 3 --checkpoint_experts --adapter_dtype bf16 --cuda_graphs --out $OUT/lora48.jsonl"
left=$(( 580 - ($(date +%s) - T0) )); [ $left -gt 200 ] && left=130
[ $left -gt 80 ] && timeout $left $B --quantize_base fp8 --quantized_gemm fp8 > $OUT/lora_fp8_gemm.log 2>&1; echo "fp8 base, fp8 gemm rc=$? after $(( $(date +%s) - T0 )) s"
left=$(( 580 - ($(date +%s) - T0) ))
[ $left -gt 80 ] && timeout $left $B > $OUT/lora_bf16.log 2>&1; echo "bf16 base rc=$? after $(( $(date +%s) - T0 )) s"
python - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "lora48.jsonl")
for line in open(p) if os.path.exists(p) else []:
    r = json.loads(line)
    print(r.get("quantize_base"), r.get("quantized_gemm"), r.get("status"), r.get("step_time_s"), r.get("tokens_per_s"), r.get("peak_allocated_gib"), r.get("peak_reserved_gib"), r.get("losses"), r.get("error"))
PY
