"""Does one process's first AdamW8bit step (torchao, compiled per parameter shape) give the same bits as another's on the
same inputs? tests/gpu/test_optimizers.py finds the experts' replicas at ep 1 x dp 2 one fp32 ulp apart after step 1
(5 of 9 sessions) though both ranks hold the same parameters and the same averaged gradients; the suspect is Inductor's
autotuning, which times its candidate kernel configs in each process and may pick different ones.

One process: a Mixtral test model's two expert weight shapes, fp32, one seed, ``--steps`` steps of
``build_optimizer("adamw_torch_8bit")`` with fixed gradients; one JSON line (sha256 of the parameters after each step)
appended to ``--out``. Run it in several fresh processes (each with its own ``TORCHINDUCTOR_CACHE_DIR``, so each
autotunes) and compare the lines; ``--deterministic`` compiles under ``torch._inductor.config.deterministic``.

    for g in 0 1 2 3; do CUDA_VISIBLE_DEVICES=$g TORCHINDUCTOR_CACHE_DIR=/tmp/ind$g python bench/optim_replica_probe.py --out x.jsonl & done
"""

import argparse
import hashlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.train.optim import build_optimizer  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--deterministic", action="store_true")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    shapes = [(8, 2048, 512), (8, 512, 1024)]  # gate_up and down of tests/gpu/test_optimizers.py's Mixtral
    params = [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(device)) for s in shapes]
    grads = [[(torch.randn(s, generator=g) * 1e-4).to(device) for s in shapes] for _ in range(args.steps)]
    optimizer = build_optimizer("adamw_torch_8bit", [{"params": params}], lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01,
                                device_type=device.type)
    found = []
    for step in range(args.steps):
        for param, grad in zip(params, grads[step]):
            param.grad = grad.clone()
        if args.deterministic:
            import torch._inductor.config as inductor_config

            with inductor_config.patch(deterministic=True):
                optimizer.step()
        else:
            optimizer.step()
        found.append([digest([q]) for q in params])
    record = {"deterministic": args.deterministic, "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "params": found}
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
