"""Expert-parallel MoE for transformers models in plain PyTorch (DeviceMesh, DTensor, FSDP2)."""

from .aux_loss import RouterStats, router_stats
from .grads import clip_grad_norm_, sync_expert_grads
from .loss import IGNORE_INDEX, causal_lm_loss_sum, count_label_tokens
from .mesh import MoEMesh, build_mesh
from .models import MOE_SPECS, MoESpec, decoder_layers, spec_for
from .moe_layer import ExpertParallelExperts, ExpertParallelMoE, TopKRouter, reuse_expert_casts
from .shard import expert_parameters, load_model, moe_blocks, shard_moe

__all__ = [
    "IGNORE_INDEX",
    "MOE_SPECS",
    "ExpertParallelExperts",
    "ExpertParallelMoE",
    "MoEMesh",
    "MoESpec",
    "RouterStats",
    "TopKRouter",
    "build_mesh",
    "causal_lm_loss_sum",
    "clip_grad_norm_",
    "count_label_tokens",
    "decoder_layers",
    "expert_parameters",
    "load_model",
    "moe_blocks",
    "reuse_expert_casts",
    "router_stats",
    "shard_moe",
    "spec_for",
    "sync_expert_grads",
]
