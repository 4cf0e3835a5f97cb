# 29th session, call B (one H200): the weight-gradient kernel's tilings at Mixtral-8x7B's width (the profile of call A:
# 472 TFLOPS adding, against torch's grouped GEMM ~615 on the same step), ep 1 (8 experts) and one rank of ep 4 (2).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s)
CFG=128x128x64x8x3,128x256x64x8x3,256x128x64x8x3,256x128x64x8x4,128x256x64x8x4,128x256x128x8x2,128x128x128x4x3,128x128x64x4x4,256x128x32x8x4,128x256x32x8x4,64x256x64x4x4,256x64x64x4x4
for ep in 1 4; do
  timeout 250 python bench/weight_grad_bench.py --shapes mixtral --ep $ep --configs $CFG --out $OUT/wg_mixtral_ep$ep.jsonl > $OUT/wg_mixtral_ep$ep.txt 2>&1
  echo "ep $ep rc=$? $(( $(date +%s) - T0 ))s"
done
python - <<'PY'
import json, glob, os
for path in sorted(glob.glob(os.environ["OUT"] + "/wg_mixtral_ep*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        flops = 2 * r["rows"] * r["m"] * r["n"]
        print(f"ep {r['ep']} {r['proj']} E {r['experts']} rows {r['rows']} m {r['m']} n {r['n']}: forward {r['forward_ms']:.3f} ms "
              f"({flops / r['forward_ms'] / 1e9:.0f} TF), torch dW {r['torch_dw_ms']:.3f} ({r['torch_dw_tflops']:.0f} TF), add {r['add_ms']:.3f}, "
              f"torch fwd+bwd {r['torch_fwd_bwd_ms']:.3f}, ours fwd+bwd {r['ours_fwd_bwd_ms']:.3f}")
        for k, v in r.items():
            if k.startswith("ours_acc_ms["):
                cfg = k[len("ours_acc_ms["):-1]
                print(f"   {cfg:>16}: adding {v:.3f} ms ({flops / v / 1e9:.0f} TF), fresh {r['ours_fresh_ms[' + cfg + ']']:.3f}, equal {r['ours_equal_default[' + cfg + ']']}")
PY
