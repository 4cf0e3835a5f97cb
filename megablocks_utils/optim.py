"""The optimizer and its precision, chosen by one setting ``optim`` (placeholder until the optim branch lands)."""

import torch

OPTIMIZERS = ("adamw_torch",)


def param_dtype(optim: str) -> torch.dtype:
    return torch.float32


def build_optimizer(optim, param_groups, *, lr, betas, eps, weight_decay, device_type):
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim={optim!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                             fused=True if device_type == "cuda" else None)
