"""Expert-parallel MoE for transformers models in plain PyTorch (DeviceMesh, DTensor, FSDP2).

The names below are imported from their modules on first use, so a script can import the light
modules (``settings``, ``inputs``, ``data``, ``loading``) and check its inputs within a second,
before transformers and the distributed stack are loaded.
"""

import importlib

from .quiet import drop_known_startup_noise

drop_known_startup_noise()  # before transformers imports torchao: see quiet.py

_MODULE_OF = {
    "RouterStats": "aux_loss",
    "router_stats": "aux_loss",
    "compile_dense_parts": "compile_dense",
    "clip_grad_norm_": "grads",
    "sync_expert_grads": "grads",
    "IGNORE_INDEX": "loss",
    "causal_lm_loss_sum": "loss",
    "count_label_tokens": "loss",
    "MoEMesh": "mesh",
    "build_mesh": "mesh",
    "MOE_SPECS": "models",
    "MoESpec": "models",
    "decoder_layers": "models",
    "spec_for": "models",
    "ExpertParallelExperts": "moe_layer",
    "ExpertParallelMoE": "moe_layer",
    "TopKRouter": "moe_layer",
    "expert_parameters": "shard",
    "load_model": "shard",
    "moe_blocks": "shard",
    "shard_moe": "shard",
}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
