#!/usr/bin/env bash
# Build megablocks 0.10.0 with stanford-stk 0.7.1 and grouped_gemm 0.3.0 from their source
# distributions on a GPU machine without internet (torch 2.11+cu130, CUDA 13 nvcc, sm_90), install
# them into /tmp/site-*, then smoke-test them and check moe_backend="megablocks" (tests/gpu/test_megablocks.py).
#
#   export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1; bash bench/megablocks_build.sh .whl-mb
#
# $1 holds megablocks-0.10.0.tar.gz, stanford_stk-0.7.1.tar.gz, grouped_gemm-0.3.0.tar.gz and the
# nvidia_cuda_cccl_cu12-12.9.27 wheel (CCCL 2.8 headers). Written to $OUT (default /tmp/mb_out):
# build.log (phases, summaries, error excerpts, checks), one full log per compiled build, and the
# three wheels that worked (install them on the same image with `pip install --no-deps --target DIR`
# instead of building again).
#
# PREBUILT=DIR (a folder of those three wheels, e.g. .whl-mb/built-h100-cu130) installs them instead of
# building: phases 1-2 are skipped, the smoke tests and checks run as usual.
#
# Why two megablocks builds: its csrc/cumsum.h calls cub::DeviceScan::{Exclusive,Inclusive}Sum with
# the `debug_synchronous` argument, which CUB 3 (CCCL 3, in the CUDA 13 toolkit) removed (6 errors).
#   A: unmodified source, CCCL 2.8's cub/thrust/libcu++ headers first on nvcc's include path
#      (NVCC_PREPEND_FLAGS=-I...), so megablocks compiles against the CUB it was written for;
#   B: the toolkit's CCCL 3, with the two calls patched to drop that argument (it defaulted to false,
#      so the patched calls do exactly what the original ones did).
# grouped_gemm (default build: cuBLAS per expert, CUTLASS headers parsed but its CUTLASS kernels not
# compiled) is built against the toolkit and, as a fallback, against CCCL 2.8 too. All builds run at
# once (each is one or two nvcc processes); A and grouped_gemm-toolkit are preferred when they work.
set -uo pipefail
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-530}))  # the whole script stays under 9 minutes unless BUDGET_S says otherwise
REPO=$(cd "$(dirname "$0")/.." && pwd)
SRC=$(cd "${1:-.whl-mb}" && pwd) || { echo "no source folder ${1:-.whl-mb}"; exit 2; }
OUT=${OUT:-/tmp/mb_out}
WORK=/tmp/mb
BUILD_TIMEOUT=${BUILD_TIMEOUT:-330}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/build.log") 2>&1
export PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

phase() { echo; echo "=== [$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] $*"; }
left() { echo $((DEADLINE - $(date +%s))); }
budget() { local s=$(($(left) - $1)); [ "$s" -lt 10 ] && s=10; echo "$s"; }  # seconds for a step, keeping $1 in reserve
log_of() { [ "$1" = stk ] && echo "$WORK/build_stk.log" || echo "$OUT/build_$1.log"; }  # stk's log stays here: $OUT returns 8 files at most
stop() { phase "STOP: $*"; exit 1; }

phase "0. environment"
nvidia-smi -L || stop "no GPU"
NGPU=$(nvidia-smi -L | wc -l)
python3 - <<'EOF'
import importlib.metadata as md, sys, torch
from torch.utils.cpp_extension import CUDA_HOME
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda, "| CUDA_HOME", CUDA_HOME)
for name in ("triton", "transformers", "setuptools", "wheel", "ninja", "numpy", "packaging", "pip"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} MISSING")
EOF
if ! command -v nvcc >/dev/null; then
  for d in /usr/local/cuda /usr/local/cuda-13* /opt/cuda $(python3 -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))' 2>/dev/null)/nvidia/cu13; do
    [ -x "$d/bin/nvcc" ] && { export CUDA_HOME=$d PATH=$d/bin:$PATH; break; }
  done
fi
command -v nvcc && nvcc --version | tail -2 || stop "nvcc not found"
CUDA_HOME=${CUDA_HOME:-$(python3 -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)')}
echo "CUDA_HOME=$CUDA_HOME; cub/version.cuh found at:"
find "$CUDA_HOME/include" -maxdepth 3 -name version.cuh -path '*cub*' 2>/dev/null
grep -h "define CUB_VERSION " $(find "$CUDA_HOME/include" -maxdepth 3 -name version.cuh -path '*cub*' 2>/dev/null) 2>/dev/null
gcc --version | head -1; echo "cores: $(nproc), GPUs: $NGPU"
ls -la "$SRC"

if [ -n "${PREBUILT:-}" ]; then
  phase "1-2. install the prebuilt wheels from $PREBUILT (no build)"
  PRE=$(cd "$REPO" && cd "$PREBUILT" && pwd) || stop "no folder $PREBUILT"
  rm -rf "$WORK" && mkdir -p "$WORK"
  ok=()
  for pair in stk:stanford_stk gg_tk:grouped_gemm mb_A:megablocks; do
    name=${pair%%:*}; whl=$(ls "$PRE/${pair#*:}"-*.whl 2>/dev/null | head -1)
    [ -n "$whl" ] || stop "no ${pair#*:} wheel in $PRE"
    mkdir -p "$WORK/wheels/$name" && cp "$whl" "$WORK/wheels/$name/"
    python3 -m pip install -q --no-deps --no-index --no-compile --target "$WORK/site-$name" "$whl" && ok+=("$name")
  done
  echo "installed: ${ok[*]}"
else
  phase "1. unpack"
  rm -rf "$WORK" && mkdir -p "$WORK/src"
  cd "$WORK/src" || exit 1
  tar xzf "$SRC/stanford_stk-0.7.1.tar.gz" && tar xzf "$SRC/grouped_gemm-0.3.0.tar.gz" && tar xzf "$SRC/megablocks-0.10.0.tar.gz" || stop "unpacking the sdists failed"
  mv stanford_stk-0.7.1 stk && mv grouped_gemm-0.3.0 gg_tk && cp -r gg_tk gg_cccl2
  mv megablocks-0.10.0 mb_A && cp -r mb_A mb_B
  python3 -m zipfile -e "$SRC"/nvidia_cuda_cccl_cu12-12.9.27-*.whl "$WORK/cccl2" || stop "unpacking the CCCL wheel failed"
  CCCL2=$WORK/cccl2/nvidia/cuda_cccl/include
  grep -h "define CUB_VERSION " "$CCCL2/cub/version.cuh"
  perl -0pi -e 's/stream,\s*debug_synchronous\)\)/stream))/g' mb_B/csrc/cumsum.h
  echo "route B patch: $(grep -c debug_synchronous\)\) mb_B/csrc/cumsum.h) calls still pass debug_synchronous (want 0)"
  diff -u mb_A/csrc/cumsum.h mb_B/csrc/cumsum.h

  phase "2. build (in parallel, ${BUILD_TIMEOUT}s limit each): stk, grouped_gemm x2, megablocks A and B"
  CCCL2_FLAGS="-I$CCCL2 -DCUB_IGNORE_DEPRECATED_API -DTHRUST_IGNORE_DEPRECATED_API -DCCCL_IGNORE_DEPRECATED_API"
  build() {  # name target [VAR=value ...]: pip-build $WORK/src/<name> into $WORK/site-<target>
    local name=$1 target=$2; shift 2
    local start=$(date +%s)
    (cd "$WORK/src/$name" && env "$@" TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 timeout "$BUILD_TIMEOUT" \
       python3 -m pip wheel -v --no-deps --no-build-isolation --no-index --no-cache-dir -w "$WORK/wheels/$name" . &&
     python3 -m pip install --no-deps --no-index --no-compile --target "$WORK/site-$target" "$WORK/wheels/$name"/*.whl) \
      >"$(log_of "$name")" 2>&1
    local rc=$?
    echo "$rc $(($(date +%s) - start))" >"$WORK/rc_$name"
  }
  pids=()
  build stk stk & pids+=($!)
  build gg_tk gg_tk & pids+=($!)
  build gg_cccl2 gg_cccl2 "NVCC_PREPEND_FLAGS=$CCCL2_FLAGS" & pids+=($!)
  build mb_A mb_A "NVCC_PREPEND_FLAGS=$CCCL2_FLAGS" & pids+=($!)
  build mb_B mb_B & pids+=($!)
  wait "${pids[@]}"  # (a bare `wait` would also wait for the tee of this script's log)
  ok=()
  for name in stk gg_tk gg_cccl2 mb_A mb_B; do
    log=$(log_of "$name")
    read -r rc secs <"$WORK/rc_$name"
    echo "--- $name: exit $rc after ${secs}s (log: $log, $(grep -c 'ptxas info' "$log") ptxas info lines, $(grep -c -i 'warning' "$log") lines with 'warning')"
    if [ "$rc" = 0 ]; then
      ok+=("$name")
    else
      [ "$rc" = 124 ] && echo "    TIMED OUT"
      grep -n -i -E "error|fatal" "$log" | grep -v -E "Werror|error_|_error|errors\.h" | head -25 | cut -c1-400
      echo "    ... last lines:"; tail -15 "$log" | cut -c1-400
    fi
  done
  echo "built: ${ok[*]:-nothing}"
  [[ " ${ok[*]:-} " == *" stk "* ]] || stop "stanford-stk (pure Python) did not install"
fi

phase "3. smoke: megablocks_ops (each built route) and grouped_gemm (each build) against torch"
smoke_ops() {  # site dir: exit 0 if megablocks_ops' sort/histogram/cumsum/replicate match torch
  PYTHONPATH=$1 timeout 120 python3 - <<'EOF'
import torch, megablocks_ops as ops
torch.manual_seed(0)
x = torch.randint(0, 8, (5000,), device="cuda", dtype=torch.int32)
v, i = torch.empty_like(x), torch.empty_like(x)
ops.sort(x, 3, v, i)
ref_v, ref_i = torch.sort(x, stable=True)
assert torch.equal(v, ref_v) and torch.equal(x[i.long()], ref_v), "sort"
h = ops.histogram(x, 8)
assert torch.equal(h.long().cpu(), torch.bincount(x.long(), minlength=8).cpu()), "histogram"
for dt in (torch.int16, torch.int32, torch.int64):
    c = torch.randint(0, 100, (3, 37), device="cuda", dtype=dt)
    out = torch.empty_like(c); ops.inclusive_cumsum(c, 1, out)
    assert torch.equal(out.long(), c.long().cumsum(1)), f"inclusive_cumsum {dt}"
    ops.exclusive_cumsum(c, 1, out)
    assert torch.equal(out.long(), c.long().cumsum(1) - c.long()), f"exclusive_cumsum {dt}"
counts = torch.tensor([3, 0, 5, 1], device="cuda", dtype=torch.int32)
bins = counts.cumsum(0).int()
src = torch.arange(4, device="cuda", dtype=torch.int32).view(1, 4)
rep = torch.empty(1, int(counts.sum()), device="cuda", dtype=torch.int32)
ops.replicate_forward(src, bins, rep)
assert torch.equal(rep.long().cpu(), torch.repeat_interleave(torch.arange(4), counts.long().cpu()).view(1, -1)), "replicate"
print("megablocks_ops: sort, histogram, inclusive/exclusive cumsum (int16/32/64), replicate match torch")
EOF
}
smoke_gg() {  # site dir: exit 0 if grouped_gemm's gmm (fwd, bwd, empty groups) matches torch
  PYTHONPATH=$1 timeout 120 python3 - <<'EOF'
import torch
from grouped_gemm.ops import gmm
torch.manual_seed(0)
sizes = [0, 700, 3, 0, 150, 1, 146, 0]
a = torch.randn(sum(sizes), 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(8, 384, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
out = gmm(a, b, torch.tensor(sizes), trans_b=True)
g = torch.randn_like(out); out.backward(g)
af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
ref = torch.cat([r @ bf[e].T for e, r in enumerate(torch.split(af, sizes))]); ref.backward(g.float())
rel = lambda x, y: float((x.float() - y).abs().max() / y.abs().max())
errs = (rel(out, ref), rel(a.grad, af.grad), rel(b.grad, bf.grad))
print("grouped_gemm gmm (bf16, trans_b, empty groups) vs fp32 torch: out %.1e, a grad %.1e, b grad %.1e" % errs)
assert max(errs) < 2e-2
if b.grad[[0, 3, 7]].abs().max() != 0:  # cuBLAS with k = 0 into torch.empty: tests/gpu/test_megablocks.py will show it
    print("WARNING: grouped_gemm left a nonzero gradient for experts with no rows")
EOF
}
MB=""; GG=""
for r in A B; do
  if [[ " ${ok[*]:-} " == *" mb_$r "* ]]; then
    echo "--- megablocks route $r:"; if smoke_ops "$WORK/site-mb_$r"; then [ -z "$MB" ] && MB=$r; else echo "    route $r FAILED its smoke test"; fi
  fi
done
for r in tk cccl2; do
  if [[ " ${ok[*]:-} " == *" gg_$r "* ]]; then
    echo "--- grouped_gemm ($r):"; if smoke_gg "$WORK/site-gg_$r"; then [ -z "$GG" ] && GG=$r; else echo "    grouped_gemm ($r) FAILED its smoke test"; fi
  fi
done
echo "using: megablocks route ${MB:-none}, grouped_gemm build ${GG:-none}"
[ -n "$MB" ] || stop "no megablocks build works (see the errors above and build_mb_*.log)"
[ -n "$GG" ] || stop "no grouped_gemm build works (see build_gg_*.log)"
export PYTHONPATH=$WORK/site-stk:$WORK/site-gg_$GG:$WORK/site-mb_$MB:$REPO${PYTHONPATH:+:$PYTHONPATH}
echo "export PYTHONPATH=$PYTHONPATH"
cp "$WORK/wheels/stk/"*.whl "$WORK/wheels/gg_$GG/"*.whl "$WORK/wheels/mb_$MB/"*.whl "$OUT/" && ls -la "$OUT"/*.whl

phase "4. import megablocks, and our backend's own check"
cd "$REPO" || exit 1
timeout 120 python3 -c "
import megablocks, stk, grouped_gemm
from megablocks.layers.dmoe import dMoE, ParallelDroplessMLP
from megablocks_utils.model.build import check_backend
check_backend('megablocks', 'cuda')
print('imports ok:', megablocks.__file__)
" || stop "megablocks does not import"

# megablocks' own dMoE, the experts alone and the equivalence test on 1 GPU (and on 2 where there are 2: megablocks'
# all-to-all over our ep group, and ep=1, dp=2), train_fsdp2.py native vs megablocks (needs pytest on the machine)
phase "5. python -m pytest tests/gpu/test_megablocks.py ($(left)s left)"
timeout "$(budget 15)" python3 -m pytest -q -rs tests/gpu/test_megablocks.py 2>&1 | tee "$WORK/check.log" | tail -n 40
echo "exit ${PIPESTATUS[0]}"

if [ "$(left)" -gt 150 ]; then
  phase "6. first look at benchmark (e): bench/run.py megablocks, Mixtral width, 2 layers, native (ep) then megablocks, $NGPU GPU(s)"
  timeout $(($(budget 10))) python3 bench/run.py megablocks --layers 2 --out "$WORK/bench.jsonl" --budget_s $(($(left) - 20)) 2>&1 | tail -8
fi
phase "done: megablocks route $MB, grouped_gemm $GG; PYTHONPATH for later runs: $PYTHONPATH"
