"""LoRA over a quantized base (``quantize_base``): which frozen weights are held quantized, checked before loading.

- "fp8": every expert projection and every linear layer of the decoder layers held quantized (``moe/quantized.py``):
  bf16 weights in FP8 (block-scaled e4m3), quantized as each layer's local experts are read, so no rank ever holds its
  bf16 experts whole. The embeddings, lm_head, routers and norms stay in the compute dtype.
- "none": the base in the compute dtype, as a full fine-tune loads it.
Adapters are trained as over a bf16 base; ``final/`` is the same PEFT adapter of the original model, and the merged
export dequantizes first (``dequantize_base``).

A checkpoint released quantized keeps its format: FP8 block-scaled weights (``weight_scale_inv``) load as they are, and
gpt-oss's MXFP4 experts stay MXFP4 (``loading.load_local_quantized_experts``); only bf16 weights are quantized.

Where it runs: one GPU of sm89 or newer (float8), and CPU ranks (the tests). Several GPUs, and MXFP4 on any GPU, have
not run it: refused there until they have (``QUANTIZED_BASE_RAN_ON_GPUS``, ``RAN_ON_GPUS``).
"""

import json
import os

import torch
from torch import nn

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import decoder_layers, spec_for
from megablocks_utils.moe.quantized import EXPERT_GEMMS, QuantizedLinear, QuantizedWeight, dequantizes_first

QUANTIZE_BASE = ("none", "fp8")
# The most GPUs a run with a quantized base has run on (tests/gpu, one H200). Raise it where tests/gpu passed above it.
QUANTIZED_BASE_RAN_ON_GPUS = 1


# Released formats whose GEMMs have run on a GPU (tests/gpu/test_quantized_base.py, one H200): gpt-oss's MXFP4 experts
# are dequantized before their grouped GEMM, equal to transformers' own dequantization (CPU) and to bf16 experts holding
# their values (GPU).
RAN_ON_GPUS = ("fp8", "mxfp4")


def check_quantize_base(quantize_base: str, *, finetuning: str, device_type: str, world_size: int,
                        released: str | None = None) -> None:
    """Refuse a quantized base where it cannot run, before anything loads: a full fine-tune (the base must train), a GPU
    without float8 (before sm89), more GPUs than it has run on, and a released format (``released``:
    ``loading.checkpoint_quantization``) that has not run on GPUs."""
    if quantize_base == "none":
        return
    if quantize_base not in QUANTIZE_BASE:
        raise InputError(f"--quantize_base {quantize_base!r}: choose one of {', '.join(QUANTIZE_BASE)}")
    if finetuning != "lora":
        raise InputError(f"--quantize_base {quantize_base} holds frozen weights quantized, which only --finetuning lora has; "
                         "add --finetuning lora, or drop --quantize_base")
    if device_type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        if (major, minor) < (8, 9):
            raise InputError(f"--quantize_base fp8 needs float8, which this GPU ({torch.cuda.get_device_name()}, sm{major}{minor}) "
                             "lacks (sm89 and newer: L4, L40, H100, H200, B200); drop --quantize_base")
        if released is not None and released not in RAN_ON_GPUS:
            raise InputError(f"the checkpoint's {released} experts have not run on a GPU yet (their CPU path is tested); "
                             "dequantize it to bf16 and train with --quantize_base fp8, which quantizes it at load")
        if world_size > QUANTIZED_BASE_RAN_ON_GPUS:
            raise InputError(f"--quantize_base {quantize_base} has run on {QUANTIZED_BASE_RAN_ON_GPUS} GPU so far, not yet on "
                             f"{world_size}: train on one GPU, or drop --quantize_base")


def released_format(model_dir: str) -> str | None:
    """How the checkpoint in ``model_dir`` is quantized as released: from its weights' names, or where there are no
    weights (a config directory: the fit check) from config.json's ``quantization_config`` ("mxfp4" as gpt-oss, "fp8"
    as Qwen3's and GLM-4.5's FP8 releases). None: bf16, or nothing there yet."""
    from megablocks_utils.model.loading import INDEX_NAME, SINGLE_NAME, checkpoint_quantization, weight_map

    if any(os.path.isfile(os.path.join(model_dir, name)) for name in (INDEX_NAME, SINGLE_NAME)):
        return checkpoint_quantization(list(weight_map(model_dir)))
    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(config_path):
        return None  # the default model before it is made
    with open(config_path) as f:
        method = (json.load(f).get("quantization_config") or {}).get("quant_method")
    return method if method in ("mxfp4", "fp8") else None


def dense_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of the decoder layers that ``fp8`` quantizes (attention, shared experts, dense MLPs), by full
    name: not a shared expert's one-output gate (it is a router), nothing outside the layers (embeddings, lm_head)."""
    spec = spec_for(model.config)
    prefix = "model.layers."
    found = {}
    for i, layer in enumerate(decoder_layers(model)):
        for name, module in layer.named_modules():
            if type(module) is nn.Linear and not (spec.shared_gate_attr and name.endswith(spec.shared_gate_attr)):
                found[f"{prefix}{i}.{name}"] = module
    return found


def quantize_linears(model: nn.Module, released: dict | None = None) -> int:
    """Every ``dense_linears`` layer swapped for its FP8 ``QuantizedLinear`` (frozen): quantized from its weight, or
    from ``released`` {module name: (fp8 data, block scales)} as the checkpoint holds it. Returns how many."""
    modules = dict(model.named_modules())
    linears = dense_linears(model)
    released = dict(released or {})
    for name, linear in linears.items():
        parent, _, leaf = name.rpartition(".")
        if name in released:
            bias = nn.Parameter(linear.bias.detach(), requires_grad=False) if linear.bias is not None else None
            quantized = QuantizedLinear(QuantizedWeight("fp8", *released.pop(name)), bias)
        else:
            quantized = QuantizedLinear.from_linear(linear)
        setattr(modules[parent], leaf, quantized)
    if released:
        raise ValueError(f"FP8 weights of modules that are not the decoder layers' linear layers: {sorted(released)[:3]}; "
                         "this suite keeps embeddings, lm_head and routers in the compute dtype (dequantize them in the checkpoint)")
    return len(linears)


@torch.no_grad()
def dequantize_base(model: nn.Module, dtype: torch.dtype) -> None:
    """Every quantized weight back to a frozen parameter in ``dtype``, adapters kept: before ``merge_adapters`` (the merged
    export is in the compute dtype). The bf16 model must then fit where the quantized one was."""
    from megablocks_utils.moe.layer import ExpertParallelExperts

    for name, module in list(model.named_modules()):
        if isinstance(module, QuantizedLinear):
            parent, _, leaf = name.rpartition(".")
            plain = module.to_linear(dtype)
            for attr in ("lora_A", "lora_B", "lora_dropout", "lora_scaling"):  # the adapters move to the plain layer
                if hasattr(module, attr):
                    setattr(plain, attr, getattr(module, attr))
            if hasattr(module, "lora_hook"):
                from megablocks_utils.model.lora import reattach_hook

                reattach_hook(module, plain)
            setattr(model.get_submodule(parent) if parent else model, leaf, plain)
        elif isinstance(module, ExpertParallelExperts):
            module.dequantize_weights(dtype)


def set_expert_gemm(model: nn.Module, gemm: str) -> int:
    """How the FP8 experts' grouped GEMMs run on a GPU (``moe/quantized.py``'s ``EXPERT_GEMMS``); returns how many
    weights it set. For measuring: the scripts keep "auto"."""
    if gemm not in EXPERT_GEMMS:
        raise InputError(f"expert gemm {gemm!r}: choose one of {', '.join(EXPERT_GEMMS)}")
    found = [m for name, m in model.named_modules() if isinstance(m, QuantizedWeight) and m.fmt == "fp8" and ".experts." in name]
    for weight in found:
        weight.gemm = gemm
    return len(found)


def describe_base(model: nn.Module, tokens: int = 0) -> str:
    """One line for the run's start: which frozen weights are held in which format, and their bytes on this rank; on a
    GPU, with ``tokens`` a micro-step, which way the FP8 experts' grouped GEMMs take (``moe/quantized.py``)."""
    formats: dict[str, int] = {}
    fp8_experts = []
    for name, m in model.named_modules():
        if isinstance(m, QuantizedWeight):
            kind = "experts" if ".experts." in name else "linear layers"
            formats[f"{kind} in {m.fmt}"] = formats.get(f"{kind} in {m.fmt}", 0) + m.nbytes()
            if kind == "experts" and m.fmt == "fp8":
                fp8_experts.append(m)
    if not formats:
        return ""
    size = lambda n: f"{n / 2**30:.2f} GiB" if n >= 2**30 / 10 else f"{n / 2**20:.2f} MiB"  # noqa: E731
    parts = ", ".join(f"{what} ({size(n)})" for what, n in sorted(formats.items()))  # experts first
    line = f"frozen base: {parts}; embeddings, lm_head, routers and norms in the compute dtype"
    if tokens and fp8_experts and fp8_experts[0].device.type == "cuda":
        weight = fp8_experts[0]
        rows = tokens * getattr(model.config, spec_for(model.config).top_k_attr)
        per_expert = rows // weight.data.shape[0]
        line += ("; the experts' GEMMs write each layer's bf16 weight first" if dequantizes_first(weight.gemm, rows, weight.data.shape[0])
                 else "; the experts' GEMMs dequantize in registers") + f" ({per_expert:,} rows per expert a micro-step)"
    return line
