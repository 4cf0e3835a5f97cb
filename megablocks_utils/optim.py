"""The optimizer and its precision, chosen by one setting ``optim`` (TrainingArguments' names).

| optim              | weights | gradients | AdamW state              | bytes / param |
|--------------------|---------|-----------|--------------------------|---------------|
| adamw_torch        | fp32    | fp32      | fp32 (torch AdamW)       | 16            |
| adamw_bf16         | bf16    | bf16      | bf16, stochastic rounding of the update (torchao ``_AdamW``) | 8 |
| adamw_torch_8bit   | fp32    | fp32      | 8-bit, block-wise scales (torchao ``AdamW8bit``) | ~10 |

Stochastic rounding makes bf16 weights train like fp32 master weights on average: an update smaller
than half a bf16 step is not lost, it lands with the right probability.
"""

import torch

OPTIMIZERS = ("adamw_torch", "adamw_bf16", "adamw_torch_8bit")
TORCHAO = "torchao==0.18.0"


def param_dtype(optim: str) -> torch.dtype:
    """The dtype the model's weights must have for ``optim`` (the loader builds them in it)."""
    return torch.bfloat16 if optim == "adamw_bf16" else torch.float32


def _torchao_optim():
    try:
        import torchao.optim
    except ImportError as e:
        raise ImportError(f"this optim needs torchao: pip install {TORCHAO} ({e})") from None
    return torchao.optim


def build_optimizer(optim: str, param_groups, *, lr: float, betas, eps: float, weight_decay: float, device_type: str):
    """AdamW over ``param_groups`` (one group per mesh: foreach and fused kernels cannot mix meshes)."""
    if optim == "adamw_torch":
        # fused on GPU: 7-8% faster steps at Mixtral width (BENCHMARKS.md); foreach on CPU.
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=True if device_type == "cuda" else None)
    if optim == "adamw_bf16":
        for group in param_groups:
            for p in group["params"]:
                if p.dtype != torch.bfloat16:
                    raise ValueError(f"optim=adamw_bf16 needs bf16 weights, got {p.dtype}: load the model with "
                                     "dtype=param_dtype('adamw_bf16')")
        return _torchao_optim()._AdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                       bf16_stochastic_round=True)
    if optim == "adamw_torch_8bit":
        return _torchao_optim().AdamW8bit(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"optim={optim!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (local shards), for the bytes-per-parameter report."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += _tensor_bytes(local)
    return total


def _tensor_bytes(t: torch.Tensor) -> int:
    inner = getattr(t, "__tensor_flatten__", None)
    if inner is not None and type(t) is not torch.Tensor:  # a tensor subclass (torchao's 8-bit state)
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
