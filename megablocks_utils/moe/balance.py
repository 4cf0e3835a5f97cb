"""Aux-loss-free load balancing (DeepSeek-V3): a per-expert bias on the routing scores, for the choice only.

After each optimizer step every MoE layer's bias moves a fixed step toward balance,
    bias_e += coeff * sign(mean_e(load) - load_e),
where ``load`` is the step's GLOBAL top-k count per expert (``router_stats``' ``tokens_per_expert``, already
summed over ranks, padding excluded). Every rank applies the same update to the same starting bias, so
the copies never diverge and the bias needs no communication of its own.

The bias only decides which experts a token goes to; the weights of the chosen experts are the router's
unbiased scores (``router.TopKRouter``), so no gradient flows through it and no loss term is added.
DeepSeek-V3 and GLM-4.5 carry the bias in their checkpoints (``e_score_correction_bias``), and training
updates that buffer. Other models get an extra buffer (``TopKRouter.ADDED_BIAS``): saved in training
checkpoints, but not exported, because their transformers model has no place for it; the exported model
routes without it.
"""

import torch
from torch import nn

from megablocks_utils.moe.blocks import moe_blocks
from megablocks_utils.moe.router import TopKRouter


def add_routing_bias(model: nn.Module) -> int:
    """Give each router that has no selection bias of its own a zero one; returns how many were added.

    Call it after ``load_model``/``shard_moe`` and before loading a training checkpoint (the checkpoint
    then restores it).
    """
    added = 0
    for block in moe_blocks(model):
        router = block.top_k_router
        if router.bias_name is None:
            router.add_score_bias(TopKRouter.ADDED_BIAS)
            added += 1
    return added


def routing_bias_exported(model: nn.Module) -> bool:
    """Whether ``export_hf`` writes the routers' selection bias (only the model's own buffer is)."""
    return all(block.top_k_router.bias_name != TopKRouter.ADDED_BIAS for block in moe_blocks(model))


def routing_bias_note(model: nn.Module, coeff: float) -> str | None:
    """The line both scripts print at the end when the routing bias that ``coeff`` trained is not in the export."""
    if coeff <= 0 or routing_bias_exported(model):
        return None
    return (f"note: {model.config.model_type} has no routing bias in its checkpoint format, so the bias of load_balance_coeff "
            "was not exported (the training checkpoints keep it); the exported model routes without it")


@torch.no_grad()
def update_routing_bias(model: nn.Module, tokens_per_expert: torch.Tensor, coeff: float) -> None:
    """One DeepSeek-V3 bias update from a step's global ``tokens_per_expert`` [layers, experts]."""
    if coeff <= 0:
        return
    blocks = moe_blocks(model)
    if tokens_per_expert.shape[0] != len(blocks):
        raise ValueError(
            f"tokens_per_expert has {tokens_per_expert.shape[0]} layers but the model {len(blocks)} MoE layers; "
            "pass the step's router_stats(...).tokens_per_expert (summed over its micro-steps)"
        )
    for block, load in zip(blocks, tokens_per_expert):
        bias = block.top_k_router.score_bias
        if bias is None:
            raise RuntimeError("this model's routers have no selection bias; call balance.add_routing_bias(model) first")
        load = load.to(bias.device, torch.float32)
        bias.add_(coeff * torch.sign(load.mean() - load))
