"""The optimizer step and the gradient clip alone, on a model's parameter shapes: GPU time per step of each AdamW.

    python bench/optim_step.py --shape qwen3_30b_a3b --layers 12 [--out bench/results/optim_step.jsonl]
    python bench/optim_step.py --variants adamw_bf16_clip,adamw_bf16_clip_folded  # the clip folded into adamw_bf16
    python bench/optim_step.py --variants adamw_bf16_per_tensor,adamw_bf16  # one launch per tensor, then one for all

Parameters (bf16, or fp32 for adamw_torch) and gradients of the shapes a ``--shape`` model with ``--layers`` layers has
(bench/real_data.py's SHAPES, built on the meta device), random; each variant runs ``--warmup`` steps, then ``--steps``
timed between CUDA events (GPU time, idle gaps included: a host-bound step shows as a long one). The bytes each step must
move (params, grads and both moments read, params and moments written) over the time give the bandwidth reached.
"""

import argparse
import json
import os
import sys
import time
from datetime import date

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(BENCH))
sys.path.insert(0, BENCH)


def shapes(shape: str, layers: int) -> list[tuple[int, ...]]:
    from real_data import SHAPES
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = SHAPES[shape]
    config = AutoConfig.for_model(model_type, **values, num_hidden_layers=layers)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [tuple(p.shape) for p in model.parameters()]


def timed(step, warmup: int, steps: int) -> tuple[float, float]:
    """(GPU ms per step, host ms per step)."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = time.perf_counter()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    host = (time.perf_counter() - host) * 1e3 / steps
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps, host


def adamw_bf16(params, variant: str):
    """AdamWBF16 as build_optimizer makes it; one launch per tensor for a ``*_per_tensor`` variant."""
    from megablocks_utils.train.adamw_bf16 import AdamWBF16
    from megablocks_utils.train.optim import build_optimizer

    if variant.endswith("_per_tensor"):
        return AdamWBF16([{"params": params}], lr=1e-5, betas=(0.9, 0.95), multi_tensor=False)
    return build_optimizer("adamw_bf16", [{"params": params}], lr=1e-5, betas=(0.9, 0.95), device_type="cuda")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="qwen3_30b_a3b")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--variants", default="torchao_sr,adamw_bf16_per_tensor,adamw_bf16,torch_fused_bf16,clip",
                   help="torchao_sr / torchao_nearest (torchao's _AdamW), adamw_bf16 (ours: AdamWBF16, one launch for "
                        "all tensors) / adamw_bf16_per_tensor (one launch per tensor: multi_tensor=False), "
                        "torch_fused_bf16, clip; "
                        "adamw_bf16_clip (clip_grad_norm_, then the step) / adamw_bf16_clip_folded (the norm, then the step "
                        "applying the clip's coefficient: clipped_step, as train_fsdp2.py), each with _per_tensor too")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default=os.path.join(BENCH, "results", "optim_step.jsonl"))
    args = p.parse_args()

    from megablocks_utils.parallel import grads
    from megablocks_utils.train.optim import clipped_step

    sizes = shapes(args.shape, args.layers)
    numel = sum(torch.Size(s).numel() for s in sizes)
    device = torch.device("cuda")
    records = []
    for variant in args.variants.split(","):
        dtype = torch.bfloat16
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=dtype) * 0.02) for s in sizes]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-3
        if variant == "clip":
            step = lambda params=params: grads.clip_grad_norm_(params, 1.0)  # noqa: E731
            moved = numel * dtype.itemsize * 3  # norm: read; scale: read + write
        elif variant.startswith("adamw_bf16_clip"):
            opt = adamw_bf16(params, variant)
            if variant.startswith("adamw_bf16_clip_folded"):
                step = lambda params=params, opt=opt: clipped_step(opt, grads.grad_norm_and_clip_coef(params, 1.0)[1])  # noqa: E731
                moved = numel * dtype.itemsize * 8  # the norm's read, then the step's 7
            else:
                step = lambda params=params, opt=opt: (grads.clip_grad_norm_(params, 1.0), opt.step())  # noqa: E731
                moved = numel * dtype.itemsize * 10  # the clip's 3 passes, then the step's 7
        else:
            if variant.startswith("adamw_bf16"):
                opt = adamw_bf16(params, variant)
            elif variant.startswith("torchao"):
                import torchao.optim

                opt = torchao.optim._AdamW(params, lr=1e-5, betas=(0.9, 0.95), bf16_stochastic_round=variant.endswith("_sr"))
            else:
                opt = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=True)
            step = opt.step
            moved = numel * dtype.itemsize * 7  # p, g, m, v read; p, m, v written (moments in the params' dtype)
        try:
            gpu, host = timed(step, args.warmup, args.steps)
            record = {"variant": variant, "status": "ok", "gpu_ms": round(gpu, 2), "host_ms": round(host, 2),
                      "tensors": len(params), "numel": numel, "gb_per_s": round(moved / gpu / 1e6, 1)}
        except Exception as e:  # noqa: BLE001  (a variant that cannot run is a row saying so)
            record = {"variant": variant, "status": "error", "error": str(e)[:300]}
        record.update(shape=args.shape, layers=args.layers, device=torch.cuda.get_device_name(), torch=torch.__version__,
                      date=date.today().isoformat())
        records.append(record)
        print(json.dumps(record), flush=True)
        del params, step
        if variant != "clip":
            del opt
        torch.cuda.empty_cache()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


if __name__ == "__main__":
    main()
