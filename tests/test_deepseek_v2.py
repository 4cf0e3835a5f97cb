"""DeepSeek-V2's router against transformers' own (greedy and group-limited top-k over softmax scores, scaled), and
its table row. The whole model on every mesh is in test_equivalence.py's every-architecture test (tiny config in
conftest.py: group-limited, V2-Lite's attention without the q low-rank path)."""

import pytest
import torch
from conftest import tiny_moe_config

from megablocks_utils.model.architectures import spec_for
from megablocks_utils.moe.router import TopKRouter

TOL = 1e-6


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_router_matches_transformers(method):
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2TopkRouter,
    )

    config = tiny_moe_config("deepseek_v2", topk_method=method, num_experts_per_tok=3, n_group=4, topk_group=2)
    spec = spec_for(config)
    options = spec.router_options(config)
    assert options.get("num_groups", 1) == (4 if method == "group_limited_greedy" else 1)
    torch.manual_seed(0)
    reference = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(reference.weight)
    ours = TopKRouter(config.hidden_size, 8, 3, False, spec.router, **options)
    ours.load_state_dict(reference.state_dict())
    x = torch.randn(64, config.hidden_size)
    logits, weights, indices = reference(x)
    probs, top_w, top_i = ours(x)
    # Both take top-k unsorted: compare each token's (expert, weight) pairs in expert order.
    order_ref, order_ours = indices.argsort(dim=-1), top_i.argsort(dim=-1)
    assert torch.equal(indices.gather(1, order_ref), top_i.gather(1, order_ours))
    torch.testing.assert_close(top_w.gather(1, order_ours), weights.gather(1, order_ref), rtol=TOL, atol=0)
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1), rtol=TOL, atol=0)
    assert float(top_w.detach().sum(dim=-1).max()) > 1.0  # routed_scaling_factor 2.5 applied (three probabilities, scaled)
    if method == "group_limited_greedy":  # every token's experts lie in its 2 best groups of 2 experts
        groups = top_i // 2
        best = probs.view(-1, 4, 2).amax(dim=-1).topk(2, dim=-1).indices
        assert all(set(g.tolist()) <= set(b.tolist()) for g, b in zip(groups, best))


def test_table_row():
    config = tiny_moe_config("deepseek_v2")
    spec = spec_for(config)
    assert spec.aux_loss_coef(config) == 0.0 and spec.score_bias is None and spec.renormalize is False
    assert spec.router_options(config) == dict(num_groups=2, topk_groups=1, scaling=2.5, score_bias=None)
