"""The model table: where each supported architecture keeps its MoE block, router and expert weights.

One row per architecture. Everything else (the MoE layer, the loader, the exporter) reads this table
instead of knowing model names, so adding a model means adding a row here.
"""

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class MoESpec:
    model_type: str  # config.model_type
    block_attr: str  # attribute of a decoder layer that holds the MoE block (transformers 5 name)
    router_attr: str  # attribute of the MoE block that holds the router (weight [E, H])
    experts_attr: str  # attribute of the MoE block that holds the experts
    hub_block_name: str  # name of the MoE block in hub checkpoints (model.layers.{l}.<name>.*)
    hub_gate: str  # hub name of the per-expert gate projection  [I, H]
    hub_up: str  # hub name of the per-expert up projection    [I, H]
    hub_down: str  # hub name of the per-expert down projection  [H, I]
    num_experts_attr: str  # config field: number of experts
    top_k_attr: str  # config field: experts per token
    aux_coef_attr: str  # config field: load-balancing loss coefficient
    renormalize: bool | str  # renormalise the top-k weights (True/False, or a config field name)
    intermediate_attr: str = "intermediate_size"  # config field: expert hidden width


MOE_SPECS = {
    "mixtral": MoESpec(
        model_type="mixtral",
        block_attr="mlp",
        router_attr="gate",
        experts_attr="experts",
        hub_block_name="block_sparse_moe",
        hub_gate="w1",
        hub_up="w3",
        hub_down="w2",
        num_experts_attr="num_local_experts",
        top_k_attr="num_experts_per_tok",
        aux_coef_attr="router_aux_loss_coef",
        renormalize=True,
    ),
}


def spec_for(config) -> MoESpec:
    """The table row for a config, or an error listing what is supported."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_SPECS:
        raise ValueError(
            f"model_type={model_type!r} is not a supported MoE architecture; supported: "
            f"{sorted(MOE_SPECS)}. Add a row to megablocks_utils/models.py:MOE_SPECS to support it."
        )
    return MOE_SPECS[model_type]


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (``model.model.layers`` in every supported family)."""
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `model.layers` ModuleList; cannot find decoder layers")
    return layers
