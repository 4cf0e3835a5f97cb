"""The Switch/Mixtral load-balancing loss over the global token set, and tokens-per-expert counts.

transformers' formula (``load_balancing_loss_func``) over all layers L and tokens T (padding masked):
    aux = E * sum_e f_e * P_e,  f_e = (top-k choices of e) / (L T),  P_e = (sum of p_e) / (L T)
Here f_e and the row count are summed over every rank (no gradient flows through them). P_e is a
sum of per-rank parts, so each rank returns ``local`` = its part of aux: summed over ranks it is the
global aux, and its gradient is exactly this rank's share of the global aux's gradient.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megablocks_utils.moe.blocks import moe_blocks


@dataclass
class RouterStats:
    local: torch.Tensor  # this rank's part of the global aux loss (differentiable)
    value: torch.Tensor  # the global aux loss (same on every rank, detached)
    tokens_per_expert: torch.Tensor  # [L, E] global count of top-k choices per layer and expert


def router_stats(model: nn.Module, attention_mask: torch.Tensor | None, group: dist.ProcessGroup | None) -> RouterStats:
    """Collect the routing of the last forward (and stop recording until the next one)."""
    blocks = moe_blocks(model)
    if not blocks or any(b.router_probs is None for b in blocks):
        raise RuntimeError("router_stats needs a forward of the sharded model first (nothing was recorded)")
    probs0 = blocks[0].router_probs
    num_experts = probs0.shape[-1]
    mask = torch.ones(probs0.shape[0], device=probs0.device) if attention_mask is None else attention_mask
    mask = mask.reshape(-1).to(probs0.device, torch.float32)
    counts, prob_sum = [], torch.zeros(num_experts, device=probs0.device)
    for block in blocks:
        probs, choices = block.router_probs, block.router_choices
        block.router_probs = block.router_choices = None
        block.record_router = False
        top_k = choices.shape[-1]
        weight = mask.repeat_interleave(top_k).to(torch.float64)
        counts.append(torch.zeros(num_experts, dtype=torch.float64, device=mask.device).scatter_add_(0, choices.reshape(-1), weight))
        prob_sum = prob_sum + (probs * mask.unsqueeze(-1)).sum(0)
    counts = torch.stack(counts)
    # One rank has nothing to sum with (and a collective would be one more launch, also inside a CUDA graph).
    reduce = group is not None and dist.get_world_size(group) > 1
    totals = torch.cat([counts.reshape(-1), mask.sum().to(torch.float64).reshape(1) * len(blocks)])
    if reduce:
        dist.all_reduce(totals, group=group)
    counts, rows = totals[:-1].view_as(counts), totals[-1]
    rows = rows.clamp(min=1.0)
    fraction = (counts.sum(0) / rows).to(torch.float32)
    local = num_experts * (fraction * prob_sum / rows.to(torch.float32)).sum()
    value = local.detach().clone()
    if reduce:
        dist.all_reduce(value, group=group)
    return RouterStats(local=local, value=value, tokens_per_expert=counts)
