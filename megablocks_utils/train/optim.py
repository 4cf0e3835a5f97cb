"""The ``optim`` setting: which AdamW, and in what precision its parameters and state are kept.

The names are transformers' ``TrainingArguments.optim`` names. Bytes per parameter on each rank's
shard (parameter + gradient + AdamW's two moments):

  adamw_torch       fp32 params, fp32 moments: 4 + 4 + 8 = 16 B. torch.optim.AdamW (fused on CUDA).
  adamw_bf16        bf16 params, bf16 moments: 2 + 2 + 4 = 8 B. ``adamw_bf16.AdamWBF16`` (torchao's
                    ``_AdamW`` update, one Triton launch for all tensors) computes the update in fp32 and
                    rounds it to bf16 stochastically, so updates far below a bf16 ulp still move the
                    weight on average (plain bf16 rounding would drop them).
  adamw_torch_8bit  fp32 params, 8-bit moments: 4 + 4 + 2 + 1/32 = 10.03 B. torchao's ``AdamW8bit``:
                    blockwise-quantised moments (uint8 codes, one fp32 scale per 256 values). Like
                    bitsandbytes, a tensor whose local shard has fewer than 4096 values or a size not
                    divisible by 256 keeps fp32 moments (norms, routers: a negligible share).

The model must be built with ``param_dtype(optim)`` parameters (``load_model(..., dtype=...)``);
``build_optimizer`` refuses parameters of another dtype instead of silently training in it.

adamw_torch_8bit needs fp32 parameters when they are DTensors (FSDP2 shards or expert shards, in any
grouping). With bf16 DTensor parameters torchao 0.18 fails in its compiled step with "OptimState8bit
dispatch: attempting to run unimplemented operator/function: func=aten.view.dtype" (seen on CPU; it
happens in torch.compile's tracing, before any kernel runs, so it is not CPU-specific; not yet
run on a GPU). ``DTensor.from_local`` wraps the state in
a ``view_as``, torchao's ``aten.view.default`` handler returns an OptimState8bit that has lost the bf16
"appearance" dtype (fp32), and torch.compile's fake-tensor conversion of that view calls
``base.view(torch.float32)``, which OptimState8bit does not implement (pytorch/ao PR #4216, open).
Plain bf16 tensors and fp32 DTensors work.

torchao's AdamW8bit ``torch.compile``s one step function per parameter shape (a C++ compiler on CPU):
the first step takes seconds to a minute longer; later steps do not. Its ``lr`` is a tensor in each
param group (LR schedulers fill it in place; ``get_last_lr()`` returns tensors). That compile runs with one kernel config
per kernel, chosen by rule (``_compiled_alike``): by default each process times candidate configs and keeps the fastest,
and ranks that pick differently update the same weights an fp32 ulp apart (tests/gpu/test_optimizers.py: the experts'
replicas at ep 1 x dp 2 apart after step 1 in 5 of 9 runs; a probe on 4 x H200 (bench/reports/probes_retired_2026-12-02.md), 4 fresh
processes on the same inputs: 4 different results by default, 1 with one config per kernel).
"""

import functools

import torch

from megablocks_utils.parallel.grads import scale_grads_
from megablocks_utils.train.adamw_bf16 import AdamWBF16
from megablocks_utils.train.memory_counts import OPTIM_BYTES, PARAM_DTYPE

OPTIMIZERS = ("adamw_torch", "adamw_bf16", "adamw_torch_8bit")
TORCHAO_VERSION = "0.18.0"  # the version these notes were checked with (CPU: torch 2.13; the GPU wheel is the same)

BLOCK_SIZE_8BIT = 256  # AdamW8bit's default: values per fp32 scale
MIN_NUMEL_8BIT = 4096  # torchao keeps fp32 moments for a local shard below this


def check_optim(optim: str) -> None:
    if optim not in OPTIMIZERS:
        raise ValueError(f"optim={optim!r} is unknown; choose one of {', '.join(OPTIMIZERS)}")


def param_dtype(optim: str) -> torch.dtype:
    """The dtype the model's parameters must have for ``optim``."""
    check_optim(optim)
    return PARAM_DTYPE[optim]


def state_bytes_per_param(optim: str) -> float:
    """Bytes of optimizer state (both moments) per parameter, for tensors large enough to be quantised (see above):
    the fit check's table (memory_counts.OPTIM_BYTES), the one place these numbers live."""
    check_optim(optim)
    return float(OPTIM_BYTES[optim][2])


def bytes_per_param(optim: str) -> float:
    """Parameter + gradient (both in ``param_dtype``) + optimizer state, bytes per parameter."""
    return 2 * param_dtype(optim).itemsize + state_bytes_per_param(optim)


def _torchao_optim():
    try:
        import torchao.optim
    except ImportError as e:
        raise ImportError(f"this optim needs torchao: pip install torchao=={TORCHAO_VERSION}") from e
    return torchao.optim


# Trainer's rule (transformers 5.23, ``Trainer.get_decay_parameter_names``): no weight decay for biases, norm
# weights and anything inside an nn.LayerNorm, so both scripts decay the same parameters
# (tests/test_optim.py compares the two lists on every architecture).
NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """The names of the parameters that weight decay applies to (Trainer's rule)."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [torch.nn.LayerNorm], NO_DECAY_NAME_PATTERNS))


def parameter_groups(model: torch.nn.Module, expert_params: set, weight_decay: float) -> list[dict]:
    """The optimizer's groups: one per mesh (dense FSDP shards, expert shards), and with ``weight_decay`` > 0
    each split into decayed and not decayed parameters (Trainer's rule, ``decay_parameter_names``). Frozen parameters
    (LoRA's base weights) are left out."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    by_mesh = [[(n, p) for n, p in named if p not in expert_params], [(n, p) for n, p in named if p in expert_params]]
    if weight_decay == 0:  # two groups, as checkpoints written without weight decay hold them
        return [{"params": [p for _, p in params]} for params in by_mesh]
    decay = decay_parameter_names(model)
    groups = []
    for params in by_mesh:
        groups.append({"params": [p for n, p in params if n in decay]})
        groups.append({"params": [p for n, p in params if n not in decay], "weight_decay": 0.0})
    return [g for g in groups if g["params"]]


def build_optimizer(
    optim: str,
    param_groups: list[dict],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    device_type: str = "cpu",
) -> torch.optim.Optimizer:
    """The optimizer ``optim`` names, over ``param_groups``.

    Keep one group per mesh (dense FSDP shards, expert shards): foreach and fused kernels cannot mix
    DTensors of different meshes in one call. Every parameter must already be ``param_dtype(optim)``.
    """
    check_optim(optim)
    want = param_dtype(optim)
    wrong = {p.dtype for group in param_groups for p in group["params"] if p.dtype != want}
    if wrong:
        raise ValueError(
            f"optim={optim!r} needs {want} parameters but the model has {', '.join(sorted(map(str, wrong)))} ones; "
            f"build the model with dtype=param_dtype({optim!r})"
        )
    if optim == "adamw_torch":
        # fused on GPU: 7-8% faster steps at Mixtral width; the default foreach on CPU
        # (bench/reports/parity_throughput_megablocks_h100-h200_2026-11-20-21.md).
        return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                 fused=True if device_type == "cuda" else None)
    if optim == "adamw_bf16":
        return AdamWBF16(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ao = _torchao_optim()
    return _compiled_alike(ao.AdamW8bit)(param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                         block_size=BLOCK_SIZE_8BIT)


# Inductor settings under which every process compiles the same kernels: its deterministic mode (reductions' configs
# picked by rule) and no timing of pointwise kernels' configs either (the retired probe's "single_config").
SAME_KERNELS_EVERYWHERE = {"deterministic": True, "triton.autotune_pointwise": False}


@functools.cache  # one subclass per optimizer class, whatever the number of optimizers built
def _compiled_alike(optimizer_class: type) -> type:
    """``optimizer_class`` (one whose step compiles its update with torch.compile) with that compile under
    ``SAME_KERNELS_EVERYWHERE``, so that every rank computes the same bits from the same inputs (weights replicated over
    ranks stay equal, and DCP, which keeps one copy of them, restores every rank's)."""
    import torch._inductor.config as inductor_config  # where torch keeps these switches

    class CompiledAlike(optimizer_class):
        def step(self, closure=None):
            with inductor_config.patch(SAME_KERNELS_EVERYWHERE):
                return super().step(closure)

    CompiledAlike.__name__ = CompiledAlike.__qualname__ = optimizer_class.__name__
    return CompiledAlike


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its local shards), for summary.json's bytes_per_param."""
    return sum(_tensor_bytes(v) for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def _tensor_bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # a tensor subclass (torchao's 8-bit state)
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def prepare_step(optimizer: torch.optim.Optimizer, clip_coef: torch.Tensor | None):
    """The host's part of the next ``clipped_step``, done ahead (``AdamWBF16.prepare``: its launch built while the GPU
    still runs the micro-steps, before the host waits at the step's check); None for the other optimizers, whose
    step does its host work when it runs."""
    if isinstance(optimizer, AdamWBF16):
        return optimizer.prepare(clip_coef)
    return None


def clipped_step(optimizer: torch.optim.Optimizer, clip_coef: torch.Tensor | None, prepared=None) -> None:
    """``optimizer.step()`` on its gradients multiplied by ``clip_coef`` (``grad_norm_and_clip_coef``'s; None: as they are).

    ``AdamWBF16`` (adamw_bf16) multiplies each gradient as its update reads it, which saves a pass over all gradients
    (a read and a write of each); the other optimizers get their gradients scaled in place first (``scale_grads_``).
    Either way the update sees the same numbers: the product rounded to the gradient's dtype (adamw_bf16.py).
    ``prepared``: ``prepare_step``'s result for this step and ``clip_coef``.
    """
    if isinstance(optimizer, AdamWBF16):
        optimizer.step(clip_coef=clip_coef, prepared=prepared)
        return
    if clip_coef is not None:
        scale_grads_([p for group in optimizer.param_groups for p in group["params"]], clip_coef)
    optimizer.step()
