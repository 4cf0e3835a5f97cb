"""Which modules of a model are our MoE blocks (``ExpertParallelMoE``), and their expert weights.

It lives in ``moe/``, beside the layer it finds, and not in ``model/build``, which swaps the blocks in
(``shard_moe`` records them here with ``remember_moe_blocks``): ``model/`` is built from this room's layers, so the
pieces here that walk a model's blocks (``aux_loss``, ``balance``) must not need ``model/``.
"""

import weakref

from torch import nn

from megablocks_utils.moe.layer import ExpertParallelMoE

# shard_moe's blocks per model: the same objects under every later wrapper (checkpointing, compile, FSDP), read at every
# forward (the router's recording hook, router_stats), where walking the whole module tree twice per micro-batch cost
# host time the GPU waited for.
_SHARDED_BLOCKS: "weakref.WeakKeyDictionary[nn.Module, list[ExpertParallelMoE]]" = weakref.WeakKeyDictionary()


def remember_moe_blocks(model: nn.Module) -> None:
    """Record ``model``'s MoE blocks once they are all swapped in (``model/build.shard_moe``), so that ``moe_blocks``
    reads them without walking the module tree."""
    _SHARDED_BLOCKS[model] = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def moe_blocks(model: nn.Module) -> list[ExpertParallelMoE]:
    if model in _SHARDED_BLOCKS:
        return _SHARDED_BLOCKS[model]
    return [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The expert weights: DTensors on the ep mesh (and, where FSDP shards them, on the whole expert mesh)."""
    return [p for block in moe_blocks(model) for p in block.experts.parameters()]
