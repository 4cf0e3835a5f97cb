"""One-off (22nd session): train_fsdp2.py with every distinct weight-gradient kernel call's shapes, strides, dtypes
and alignment printed once per rank."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import megablocks_utils.moe.weight_grad_kernel as k  # noqa: E402

orig, seen = k.grouped_weight_grad, set()


def logged(a, b, offs, out, **kw):
    key = (tuple(a.shape), a.stride(), str(a.dtype), tuple(b.shape), b.stride(), tuple(out.shape), out.stride(), str(out.dtype),
           kw.get("accumulate"), kw.get("divisor"), a.data_ptr() % 128, b.data_ptr() % 128, out.data_ptr() % 128, str(offs.dtype),
           a.is_contiguous(), b.is_contiguous(), out.is_contiguous())
    if key not in seen:
        seen.add(key)
        print("WG rank", os.environ.get("RANK"), key, flush=True)
    return orig(a, b, offs, out, **kw)


k.grouped_weight_grad = logged
sys.argv = ["train_fsdp2.py", *sys.argv[1:]]
runpy.run_path("train_fsdp2.py", run_name="__main__")
