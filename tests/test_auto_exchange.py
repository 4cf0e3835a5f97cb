"""``ep_capacity_factor`` -1 (auto, train/auto_exchange.py): the static exchange with whole micro-steps as CUDA graphs
where that ran (ep 2 and 4 = world size on one GPU node), the exact exchange elsewhere with the reason; a factor given is
kept; ``drop_static_exchange`` puts every layer back on the exact exchange."""

from types import SimpleNamespace

import pytest
import torch

from megablocks_utils.train.auto_exchange import AUTO, AUTO_FACTORS, resolve_capacity_factor, resolve_wrap_and_factor

# An ep 2 run on one node of 2 GPUs, full fine-tuning at the defaults auto is measured with.
EP2 = dict(device_type="cuda", world_size=2, ep_size=2, local_world_size=2, moe_backend="native", expert_bias=False, lora=False,
           activation_checkpointing="none", checkpoint_experts=False, dtype=torch.bfloat16, optim="adamw_bf16",
           cuda_graphs="auto", fsdp_wrap="auto")


def test_auto_takes_the_measured_factor_at_ep_2_on_one_node():
    factor, note = resolve_capacity_factor(AUTO, **EP2)
    assert factor == AUTO_FACTORS[2] == 2.0 and "ep_capacity_factor auto: 2" in note
    assert resolve_capacity_factor(AUTO, **{**EP2, "cuda_graphs": "true", "fsdp_wrap": "none"})[0] == 2.0


def test_auto_takes_3_at_ep_4_on_one_node():
    factor, note = resolve_capacity_factor(AUTO, **{**EP2, "world_size": 4, "ep_size": 4, "local_world_size": 4})
    assert factor == AUTO_FACTORS[4] == 3.0 and "ep_capacity_factor auto: 3 (ep 4 = world size on one node" in note


@pytest.mark.parametrize("change, why", [
    ({"world_size": 4}, "ep = world size"),
    ({"world_size": 8, "ep_size": 8, "local_world_size": 8}, "ep 8: measured at ep 2, 4 only"),
    ({"world_size": 8, "ep_size": 4, "local_world_size": 8}, "ep = world size"),
    ({"local_world_size": 1}, "spans nodes"),
    ({"moe_backend": "megablocks"}, "megablocks"),
    ({"expert_bias": True}, "bias"),
    ({"lora": True}, "LoRA"),
    ({"activation_checkpointing": "full"}, "checkpointing"),
    ({"checkpoint_experts": True}, "checkpointing"),
    ({"dtype": torch.float32}, "float32 compute"),
    ({"optim": "adamw_torch"}, "--optim adamw_bf16"),
    ({"cuda_graphs": "segments"}, "cuda_graphs segments"),
    ({"cuda_graphs": "false"}, "cuda_graphs false"),
    ({"fsdp_wrap": "layer"}, "fsdp_wrap layer"),
    ({"whole_graphs": False}, "no CUDA graphs"),
])
def test_auto_keeps_the_exact_exchange_elsewhere_and_says_why(change, why):
    factor, note = resolve_capacity_factor(AUTO, **{**EP2, **change})
    assert factor == 0.0 and note.startswith("ep_capacity_factor auto: 0, the exact exchange") and why in note, note


def test_on_cpu_and_one_gpu_auto_is_the_exact_exchange_without_a_word():
    assert resolve_capacity_factor(AUTO, **{**EP2, "device_type": "cpu"}) == (0.0, "")
    assert resolve_capacity_factor(AUTO, **{**EP2, "world_size": 1, "ep_size": 1, "local_world_size": 1}) == (0.0, "")


def test_a_factor_given_is_kept():
    assert resolve_capacity_factor(0.0, **EP2) == (0.0, "")
    assert resolve_capacity_factor(3.0, **{**EP2, "device_type": "cpu"}) == (3.0, "")


def test_dropping_the_static_exchange_puts_every_layer_back_on_the_exact_one():
    from types import SimpleNamespace

    from megablocks_utils.moe.exchange_mode import ExchangeMode, drop_static_exchange, exchange_mode
    from megablocks_utils.moe.layer import ExpertParallelExperts, ExpertParallelMoE

    mesh = SimpleNamespace(ep_size=2)
    model = torch.nn.ModuleList([ExpertParallelMoE(8, 4, 2, True, mesh, "silu") for _ in range(2)])
    mode = ExchangeMode(2.0, "gathered")
    for block in model:
        assert isinstance(block.experts, ExpertParallelExperts)
        block.experts.exchange_mode = mode
    drop_static_exchange(model)
    assert exchange_mode(model) is None and all(block.experts.exchange_mode is None for block in model)


def estimates(totals_gib: dict):
    """A fit check's ``plan_for`` that answers each (fsdp_wrap, factor) with the given total, GiB."""
    return lambda *, fsdp_wrap, ep_capacity_factor: SimpleNamespace(total=totals_gib[fsdp_wrap, ep_capacity_factor] * 2**30)


# Full Qwen3-30B-A3B at ep 4 on 4 x H200 (the fit check's own estimates, GiB): with auto's factor 3 neither whole weights
# nor FSDP's whole-model unit fit within 90% of 139.8 GiB; without it both do.
QWEN3_EP4 = {("none", 3.0): 131.1, ("model", 3.0): 131.4, ("layer", 3.0): 128.0,
             ("none", 0.0): 106.9, ("model", 0.0): 107.2, ("layer", 0.0): 104.0}
H200 = 139.8 * 2**30


def test_auto_factor_that_does_not_fit_leaves_the_units_of_a_run_without_it():
    """The 23rd session's full Qwen3 at ep 4: the factor dropped, and the dense weights whole on every rank (the
    segments' graphs), as without the factor, not FSDP's per-layer units."""
    wrap, factor, note = resolve_wrap_and_factor("auto", estimates(QWEN3_EP4), H200, 4, 4, factor=3.0, factor_auto=True,
                                                 segments_planned=True)
    assert (wrap, factor) == ("none", 0.0)
    assert note.startswith("ep_capacity_factor auto: 0, the exact exchange") and "fsdp_wrap auto: none" in note
    # no segments planned: the whole-model unit, as auto picks without the factor
    assert resolve_wrap_and_factor("auto", estimates(QWEN3_EP4), H200, 4, 4, factor=3.0, factor_auto=True,
                                   segments_planned=False)[:2] == ("model", 0.0)


def test_auto_factor_that_fits_keeps_whole_weights_and_a_given_factor_is_kept():
    fits = {**QWEN3_EP4, ("none", 3.0): 100.0}
    assert resolve_wrap_and_factor("auto", estimates(fits), H200, 4, 4, factor=3.0, factor_auto=True,
                                   segments_planned=False) == ("none", 3.0, "")
    # a factor the user gave stays whatever the units (the fit check judges it after)
    assert resolve_wrap_and_factor("auto", estimates(QWEN3_EP4), H200, 4, 4, factor=3.0, factor_auto=False,
                                   segments_planned=False) == ("layer", 3.0, "")
    assert resolve_wrap_and_factor("none", estimates(QWEN3_EP4), H200, 4, 4, factor=3.0, factor_auto=True,
                                   segments_planned=False) == ("none", 3.0, "")
