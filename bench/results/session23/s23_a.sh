# 23rd session, call A (4 x H200): at HEAD (2ee4fee, the reciprocal division), one call: ours on one GPU (synthetic, chat),
# then ep 4: the defaults (segments) and the token pull + whole-micro-step graphs at factor 3, synthetic and chat, beside
# transformers' FSDP2 + EP at 4 GPUs on the same rows.
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python bench/run.py ep_scaling --no_peer --counts 1 --runs ours_synthetic,ours_chat --warmup 3 --steps 8 --chat_steps 8 \
  --run_timeout 100 --out $OUT/one_gpu.jsonl --budget_s 200 > $OUT/one_gpu.txt 2>&1; el one $?
grep -v "^  " $OUT/one_gpu.txt | tail -5
python bench/run.py ep_scaling --counts 4 --static_factor 3 --runs ours_synthetic,ours_synthetic_graphs,ours_chat_graphs,ours_chat \
  --warmup 3 --steps 8 --chat_steps 8 --run_timeout 100 --out $OUT/ep4.jsonl --budget_s $(( 575 - ($(date +%s) - T0) )) \
  > $OUT/ep4.txt 2>&1; el ep4 $?
python - <<'PY'
import json, os, sys
sys.path.insert(0, "bench")
from run import ep_scaling_table
out = os.environ["OUT"]
recs = [json.loads(l) for f in ("one_gpu.jsonl", "ep4.jsonl") if os.path.exists(f"{out}/{f}") for l in open(f"{out}/{f}")]
print(ep_scaling_table(recs))
for r in recs:
    print(r.get("name"), r.get("run"), r.get("status"), r.get("median_step_s", r.get("step_time_s")), [round(x, 4) for x in r.get("losses", [])[:4]], r.get("peak_allocated_gib"), str(r.get("error", ""))[:200])
PY
tar -czf $OUT/logs.tgz -C /tmp bench_logs 2>/dev/null; el all 0
