"""bench/routing_skew.py: the skewed-routing option of the benchmarks reaches the asked load ratio on batches it
was not calibrated on, and routes ours exactly as transformers' model (the comparison it exists for)."""

import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, free_port

sys.path.insert(0, os.path.join(ROOT, "bench"))
from routing_skew import find_routers, load_ratio, skew_routing  # noqa: E402

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
