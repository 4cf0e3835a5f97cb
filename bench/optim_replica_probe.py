"""Does one process's first AdamW8bit step (torchao, compiled per parameter shape) give the same bits as another's on the
same inputs? tests/gpu/test_optimizers.py finds the experts' replicas at ep 1 x dp 2 one fp32 ulp apart after step 1
(5 of 9 sessions) though both ranks hold the same parameters and the same averaged gradients; the suspect is Inductor's
autotuning, which times its candidate kernel configs in each process and may pick different ones.

One process: a Mixtral test model's two expert weight shapes, fp32, one seed, ``--steps`` steps of
torchao's AdamW8bit (build_optimizer's settings) with fixed gradients; one JSON line (sha256 of the parameters after
each step) appended to ``--out``. Run it in several fresh processes (each with its own ``TORCHINDUCTOR_CACHE_DIR``, so each
autotunes) and compare the lines; ``--mode`` picks the Inductor settings (``MODES``). On 4 x H100 (2026-11-28), 8
processes beside the GPU suite, all under Inductor's deterministic mode (build_optimizer's wrapper then; the probe's
"default" added nothing to it): 7 alike, one with the second weight apart. On 4 x H200 (2026-11-28), 4 processes a mode
beside test_graphs_ep, the wrapper gone: default 4 different results, single_config 4 alike:
what train/optim.py's adamw_torch_8bit now compiles under (``SAME_KERNELS_EVERYWHERE``). The probe builds torchao's
AdamW8bit itself (as build_optimizer did before), so that its modes are the only settings.

    for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g TORCHINDUCTOR_CACHE_DIR=/tmp/ind$g \
        python bench/optim_replica_probe.py --out x.jsonl --mode single_config & done
"""

import argparse
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch._inductor.config as inductor_config  # noqa: E402

from megablocks_utils.train.optim import BLOCK_SIZE_8BIT  # noqa: E402

# default: Inductor's own (candidate configs timed in each process); deterministic: its deterministic mode (reductions'
# configs filtered to one by rule); single_config: that and pointwise kernels' configs not timed either (one config per
# kernel, nothing timed).
MODES = {"default": {}, "deterministic": {"deterministic": True},
         "single_config": {"deterministic": True, "triton.autotune_pointwise": False}}


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mode", default="default", choices=sorted(MODES), help="Inductor settings the steps compile under")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 2048, 512), (8, 512, 1024)]  # gate_up and down of tests/gpu/test_optimizers.py's Mixtral
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-4).to(device) for s in shapes] for _ in range(args.steps)]
    from torchao.optim import AdamW8bit

    optimizer = AdamW8bit([{"params": params}], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01, block_size=BLOCK_SIZE_8BIT)
    found = []
    for step in range(args.steps):
        for param, grad in zip(params, grads[step]):
            param.grad = grad.clone()
        with inductor_config.patch(**MODES[args.mode]):
            optimizer.step()
        found.append([digest([q]) for q in params])
    record = {"mode": args.mode, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "params": found}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
