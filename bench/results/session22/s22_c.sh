# 22nd session, call C (2 x H200): why the weight-gradient kernel takes 88-91 ms of an ep 2 step (52 on one GPU) when
# alone at the same row counts it takes less than on one GPU: one profiled step at ep 2 and one on one GPU with their
# chrome traces, each weight-gradient kernel's duration in order and what ran beside it on other streams; the step's
# per-expert rows (metrics.jsonl). Code: d7c7ae4 + bench tools (no library change).
source bench/device_env.sh || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH
T0=$(date +%s); el() { echo "$1 rc=$2 $(( $(date +%s) - T0 ))s"; }
mkdir -p $OUT/c
python bench/profile_steps.py --ep 2 --cuda_graphs auto --wait 5 --active 1 --work /tmp/ps2 --trace /tmp/ep2.json \
  --out $OUT/c/ep2.jsonl --top 60 > $OUT/c/ep2.txt 2>&1; el ep2 $?
CUDA_VISIBLE_DEVICES=0 python bench/profile_steps.py --cuda_graphs auto --wait 5 --active 1 --work /tmp/ps1 --trace /tmp/ep1.json \
  --out $OUT/c/ep1.jsonl --top 60 > $OUT/c/ep1.txt 2>&1 &
for r in 0 1; do python bench/trace_gaps.py /tmp/ep2.rank$r.json --beside _weight_grad_kernel > $OUT/c/gaps_ep2_rank$r.txt 2>&1; el gaps$r $?; done
wait; el ep1 $?
python bench/trace_gaps.py /tmp/ep1.json --beside _weight_grad_kernel > $OUT/c/gaps_ep1.txt 2>&1; el gaps_ep1 $?
python - <<'PY' > $OUT/c/grids.txt 2>&1
import json
for name in ("/tmp/ep1.json", "/tmp/ep2.rank0.json"):
    ev = json.load(open(name))["traceEvents"]
    seen = {}
    for e in ev:
        if e.get("cat") == "kernel" and e["name"].startswith("_weight_grad"):
            a = e.get("args", {})
            key = (str(a.get("grid")), str(a.get("block")), a.get("shared memory"), a.get("registers per thread"), a.get("stream"))
            seen.setdefault(key, []).append(e["dur"])
    for k, v in seen.items():
        print(name, k, len(v), round(sum(v) / len(v)))
PY
find /tmp/ps2 /tmp/ps1 -name metrics.jsonl -exec cp --parents {} $OUT/c/ \; 2>/dev/null
gzip -c /tmp/ep2.rank0.json > $OUT/ep2.rank0.json.gz
tar -czf $OUT/c.tgz -C $OUT c && rm -rf $OUT/c; el done 0
tar -xzf $OUT/c.tgz -O c/gaps_ep2_rank0.txt | tail -30; tar -xzf $OUT/c.tgz -O c/gaps_ep1.txt | tail -22; tar -xzf $OUT/c.tgz -O c/grids.txt
