"""bench/routing_skew.py: the skewed-routing option of the benchmarks reaches the asked load ratio on batches it
was not calibrated on, and routes ours exactly as transformers' model (the comparison it exists for); the balanced
option gives every expert exactly the same count, in every architecture, transformers' model and ours."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ARCHITECTURES, ROOT, free_port, tiny_moe_config

sys.path.insert(0, os.path.join(ROOT, "bench"))
from routing_skew import (  # noqa: E402
    RouterCounts,
    control_routing,
    dealt_experts,
    find_routers,
    group_keeping_order,
    load_ratio,
    parse_routing,
    skew_routing,
)

EXPERTS, TOP_K = 8, 2


def mixtral(seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=256)
    torch.manual_seed(seed)
    return MixtralForCausalLM(config).float().eval()


def routed_counts(model, ids) -> list[torch.Tensor]:
    """Each layer's top-k counts on ``ids``, read from the routers' own outputs (their chosen experts)."""
    counts = []

    def record(module, args, out):
        top_i = out[2]
        counts.append(torch.bincount(top_i.flatten(), minlength=EXPERTS))

    handles = [r.register_forward_hook(record) for r in find_routers(model, EXPERTS)]
    with torch.no_grad():
        model(input_ids=ids)
    for h in handles:
        h.remove()
    return counts


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("target", [2.4, 3.0])
def test_held_out_batches_get_the_asked_load_ratio(one_rank, target):
    model = mixtral()
    g = torch.Generator().manual_seed(1)
    before = [load_ratio(c) for c in routed_counts(model, torch.randint(0, 256, (8, 128), generator=g))]
    skew = skew_routing(model, target, EXPERTS, TOP_K)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 256, (8, 128), generator=g))  # calibration
    assert all(abs(r - target) < 0.05 for r in skew.ratios), skew.ratios
    after = [load_ratio(c) for c in routed_counts(model, torch.randint(0, 256, (8, 128), generator=g))]
    assert all(abs(r - target) < 0.2 * target for r in after), (after, target)
    assert max(before) < target - 0.3, before  # random weights alone route more evenly (tiny ones not uniformly)


def test_ours_routes_like_transformers_under_the_same_skew(one_rank):
    """The hooks sit on transformers' gate and on our TopKRouter alike: the offsets calibrated on transformers'
    model, applied to ours, choose the same experts for every token of another batch and give the same logits
    (fp32); ours calibrated on its own reaches the same ratio."""
    from megablocks_utils import shard_moe

    reference = mixtral()
    ours = copy.deepcopy(reference)
    shard_moe(ours, 1, device="cpu")
    g = torch.Generator().manual_seed(2)
    calibration, batch = torch.randint(0, 256, (4, 64), generator=g), torch.randint(0, 256, (4, 64), generator=g)
    reference_skew = skew_routing(reference, 2.0, EXPERTS, TOP_K)
    with torch.no_grad():
        reference(input_ids=calibration)
    skew = skew_routing(ours, 2.0, EXPERTS, TOP_K, offsets=reference_skew.offsets)

    choices = {}
    for name, m in (("reference", reference), ("ours", ours)):
        found = []
        hooks = [r.register_forward_hook(lambda mod, args, out, found=found: found.append(out[-1].sort(-1).values))
                 for r in find_routers(m, EXPERTS)]
        with torch.no_grad():
            choices[name] = (m(input_ids=batch).logits, found)
        for h in hooks:
            h.remove()
    assert all(torch.equal(a, b) for a, b in zip(choices["reference"][1], choices["ours"][1]))
    torch.testing.assert_close(choices["ours"][0], choices["reference"][0], rtol=1e-5, atol=1e-5)
    assert min(reference_skew.ratios) > 1.9
    skew.remove()
    own = skew_routing(ours, 2.0, EXPERTS, TOP_K)
    with torch.no_grad():
        ours(input_ids=calibration)
    assert all(abs(a - b) < 0.05 for a, b in zip(own.ratios, reference_skew.ratios)), (own.ratios, reference_skew.ratios)


@pytest.mark.parametrize("target", [0.5, 4.5])
def test_a_ratio_the_experts_cannot_reach_is_refused(target):
    with pytest.raises(ValueError, match="at least 1 and at most experts / top_k = 4"):
        skew_routing(mixtral(), target, EXPERTS, TOP_K)


def _model(model_type: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_moe_config(model_type, output_router_logits=False)
    return AutoModelForCausalLM.from_config(config).float().eval()


def _num_experts(model) -> int:
    from megablocks_utils.model.architectures import spec_for

    return getattr(model.config, spec_for(model.config).num_experts_attr)


@pytest.mark.parametrize("side", ["transformers", "ours"])
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_balanced_routing_gives_every_expert_the_same_count(one_rank, model_type, side):
    """Every architecture of the table, transformers' model and ours: each micro-batch's top-k copies are dealt
    evenly, busiest / mean exactly 1 in every layer, on batches of two token counts (the offsets are remade for the
    second); the routers' own choices say so. DeepSeek-V3, GLM-4.5 and DeepSeek-V2 route within expert groups
    (tiny: 2 groups of 4, one kept per token) and sigmoid (V3, GLM) or softmax scores: still exact."""
    from megablocks_utils import shard_moe

    model = _model(model_type)
    if side == "ours":
        shard_moe(model, 1, device="cpu")
    balance = control_routing(model, "balanced")
    counts = RouterCounts(model, _num_experts(model))
    g = torch.Generator().manual_seed(3)
    for shape in ((2, 32), (2, 32), (3, 20)):
        with torch.no_grad():
            model(input_ids=torch.randint(0, 96, shape, generator=g))
        assert counts.take() == [1.0] * len(balance.handles), (model_type, shape)


def test_balanced_routing_moves_the_logits_by_the_offsets_and_only_the_router_sees_them(one_rank):
    """transformers' Qwen3-MoE block: the router's logits are W x + b_t (b_t = +C/2 on the dealt experts, -C/2
    elsewhere; fp32), and the experts get the block's input unchanged."""
    model = _model("qwen3_moe")
    balance = control_routing(model, "balanced")
    block = model.model.layers[0].mlp
    seen = {}
    block.register_forward_pre_hook(lambda m, args: seen.update(block_in=args[0].reshape(-1, args[0].shape[-1]).clone()))
    block.experts.register_forward_pre_hook(lambda m, args: seen.update(experts_in=args[0].clone()))
    block.gate.register_forward_hook(lambda m, args, out: seen.update(logits=out[0]))
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(4)))
    assert torch.equal(seen["experts_in"], seen["block_in"])
    c = balance.scales[0]
    dealt = dealt_experts(64, 4, 2, balance.orders[0])
    b = torch.full((64, 4), -c / 2).scatter_(1, dealt, c / 2)
    torch.testing.assert_close(seen["logits"], seen["block_in"] @ block.gate.weight.T + b, rtol=1e-5, atol=1e-4)
    assert c > 10 * float((seen["block_in"] @ block.gate.weight.T).detach().std())


def test_dealt_experts_keep_each_token_in_one_group_and_every_expert_even():
    order = group_keeping_order(8, 2, torch.Generator().manual_seed(0))
    assert sorted((order[:4] // 4).tolist()) == [order[0].item() // 4] * 4  # groups move whole
    dealt = dealt_experts(16, 8, 3, order, num_groups=2)
    assert all(len({e // 4 for e in row.tolist()}) == 1 and len(set(row.tolist())) == 3 for row in dealt)
    dealt = dealt_experts(16, 8, 3, order)  # no groups: blocks of 3 across the 8
    assert torch.bincount(dealt.flatten(), minlength=8).tolist() == [6] * 8
    assert torch.bincount(dealt_experts(16, 8, 3, order, num_groups=2).flatten(), minlength=8).tolist() == [6] * 8


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_skew_from_the_routing_option_meets_its_target(one_rank, model_type):
    """control_routing("skew:R") is skew_routing on the model table's counts: the calibration batch gets R in every
    layer (gpt-oss: its router's bias counted), a held-out batch R within 20%."""
    model = _model(model_type, seed=1)
    skew = control_routing(model, "skew:2.0")
    counts = RouterCounts(model, _num_experts(model))
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (8, 64), generator=g))
    calibrated = counts.take()
    assert all(abs(r - 2.0) < 0.05 for r in skew.ratios), skew.ratios
    assert calibrated == pytest.approx(skew.ratios, abs=0.02)  # W (x + u) against W x + alpha g: rounding at a step
    with torch.no_grad():
        model(input_ids=torch.randint(0, 96, (8, 64), generator=g))
    assert all(abs(r - 2.0) < 0.4 for r in counts.take())


@pytest.mark.parametrize("text", ["skew", "skew:0.5", "skew:x", "uniform"])
def test_an_unknown_routing_is_refused(text):
    with pytest.raises(ValueError, match="give own, balanced or skew:R"):
        parse_routing(text)
