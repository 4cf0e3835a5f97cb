"""Expert-parallel MoE for transformers models in plain PyTorch (DeviceMesh, DTensor, FSDP2).

The names below are imported from their modules on first use, so a script can import the light
modules (``settings``, ``inputs``, ``data``, ``loading``) and check its inputs within a second,
before transformers and the distributed stack are loaded.
"""

import importlib

from .quiet import drop_known_startup_noise

drop_known_startup_noise()  # before transformers imports torchao: see quiet.py

_MODULE_OF = {
    "RouterStats": "moe.aux_loss",
    "router_stats": "moe.aux_loss",
    "compile_dense_parts": "parallel.compile_dense",
    "clip_grad_norm_": "parallel.grads",
    "clipped_step": "train.optim",
    "grad_norm_and_clip_coef": "parallel.grads",
    "average_replicated_grads": "parallel.grads",
    "sync_expert_grads": "parallel.grads",
    "IGNORE_INDEX": "data.records",
    "causal_lm_loss_sum": "train.loss",
    "count_label_tokens": "train.loss",
    "forward_with_loss": "train.loss",
    "install_loss_head": "train.loss",
    "MoEMesh": "mesh",
    "build_mesh": "mesh",
    "MOE_SPECS": "model.architectures",
    "MoESpec": "model.architectures",
    "decoder_layers": "model.architectures",
    "spec_for": "model.architectures",
    "ExpertParallelExperts": "moe.layer",
    "ExpertParallelMoE": "moe.layer",
    "TopKRouter": "moe.router",
    "expert_parameters": "moe.blocks",
    "load_model": "model.build",
    "moe_blocks": "moe.blocks",
    "shard_moe": "model.build",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
