"""Whether a run takes the segments' CUDA graphs (``cuda_graphs`` segments, or auto at ep = world size > 1): the decision
alone, apart from the graphs themselves (``segment_graphs.py``), so that what imports it stays light: the scripts
check their settings with it before loading anything, and the fit check's command line (``tools/memory.py``) plans the
run the script would make without importing transformers."""

import torch
from torch import nn

from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import decoder_layers
from megablocks_utils.train.cuda_graph import CAPTURABLE_ATTENTION

# transformers' decoder layers whose forward is exactly ``_dense_segment`` -> mlp -> residual: pre-norm attention with a
# residual, then the MLP (here the MoE block) with a residual (tests/test_segment_graphs.py holds each to it). Granite's
# layers scale their residuals and are not among them.
SEGMENT_LAYERS = frozenset({"MixtralDecoderLayer", "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer", "DeepseekV2DecoderLayer",
                            "DeepseekV3DecoderLayer", "GptOssDecoderLayer", "OlmoeDecoderLayer", "Glm4MoeDecoderLayer"})
# Whether cuda_graphs "auto" takes the segments at ep = world size > 1 on one node (where they can run): on since 4 x H200 measured
# them ahead of FSDP's whole-model unit (BENCHMARKS.md, "Several GPUs").
SEGMENTS_IN_AUTO = True


def segment_blocker(*, device_type: str, world_size: int, ep_size: int, moe_backend: str, attention: str | None,
                    activation_checkpointing: str, checkpoint_experts: bool, lora: bool, dtype: torch.dtype,
                    weights: torch.dtype, fsdp_wrap: str, model: nn.Module | None = None) -> str | None:
    """Why the dense segments cannot be CUDA graphs in this run, or None when they can. ``dtype``: the compute dtype;
    ``weights``: the dtype the optimizer keeps the weights in; ``attention`` None: not yet chosen; ``fsdp_wrap`` "auto"
    counts as "none" (the script resolves it so where segments are planned); ``model`` None: not yet built."""
    if device_type != "cuda":
        return "CUDA graphs need a GPU"
    if world_size == 1:
        return "one GPU: whole micro-steps are graphs there (cuda_graphs auto or true)"
    if ep_size != world_size:
        return f"{world_size} ranks at ep {ep_size}: FSDP shards the experts over dp; segments need ep = world size ({world_size})"
    if fsdp_wrap not in ("none", "auto"):
        return f"fsdp_wrap {fsdp_wrap}: FSDP moves the dense weights each step; segments need --fsdp_wrap none (or auto)"
    if dtype != torch.bfloat16:
        return f"{str(dtype).removeprefix('torch.')} compute: segments are run in bf16 only"
    if weights != dtype:
        return (f"{str(weights).removeprefix('torch.')} weights, which FSDP casts at every forward; segments need the weights "
                "whole in bf16 on every rank: --optim adamw_bf16")
    if moe_backend != "native":
        return f"moe_backend {moe_backend!r}: segments are run with the native MoE layer only"
    if attention is not None and attention not in CAPTURABLE_ATTENTION:
        return f"attention {attention!r} builds or checks its mask on the host; segments take {' or '.join(CAPTURABLE_ATTENTION)}"
    if activation_checkpointing != "none" or checkpoint_experts:
        return "activation checkpointing would replay a segment over the outputs its backward still needs"
    if lora:
        return "LoRA: segments have run full fine-tunes only (whole micro-steps under LoRA have run on one GPU)"
    if model is not None:
        other = sorted({type(layer).__name__ for layer in decoder_layers(model)} - SEGMENT_LAYERS)
        if other:
            return f"{', '.join(other)}: not a decoder layer the segments are cut from (train/segment_plan.SEGMENT_LAYERS)"
    return None


def resolve_segment_graphs(setting, blocker: str | None, single_node: bool = True) -> tuple[bool, str]:
    """(on, the line the script prints) for the ``cuda_graphs`` setting: "segments" where the segments cannot run raises
    InputError saying why; "auto" takes them where ``SEGMENTS_IN_AUTO``, nothing blocks them and the ranks are on one node
    (where they were measured: across nodes the replicated dense weights' all-reduce crosses the network); else off ("")."""
    setting = str(setting).lower()
    if setting == "segments":
        if blocker is not None:
            raise InputError(f"cuda_graphs segments: {blocker}; run with --cuda_graphs auto or false")
        return True, ("cuda_graphs segments: each decoder layer's norms and attention replayed from CUDA graphs after the "
                      "warm-up steps, its MoE block launched from Python")
    if setting == "auto" and SEGMENTS_IN_AUTO and blocker is None and single_node:
        return True, ("cuda_graphs auto: segments (ep = world size: each decoder layer's norms and attention replayed from "
                      "CUDA graphs after the warm-up steps, its MoE block launched from Python)")
    return False, ""
