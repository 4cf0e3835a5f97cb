"""``reuse_expert_casts``: casting expert weights once per optimizer step changes no number."""

from contextlib import nullcontext

import torch
from conftest import run_ranks, tiny_moe_config

from megablocks_utils import moe_blocks, reuse_expert_casts, shard_moe


def micro_steps(model, block, inputs, reuse):
    """Two bf16 micro-steps through one layer's experts (fp32 weights), grads accumulated as in training."""
    model.zero_grad(set_to_none=True)
    outputs = []
    with reuse_expert_casts(model) if reuse else nullcontext():
        for x in inputs:
            _, top_w, top_i = block.top_k_router(x.float())
            out = block.experts(x, top_i, top_w)
            out.float().square().sum().backward()
            outputs.append(out.detach())
        cached = block.experts.cast_cache
    return outputs, [p.grad.to_local().clone() for p in block.experts.parameters()], cached


def check_reuse_equals_fresh_casts(rank, world):
    from transformers import AutoModelForCausalLM

    config = tiny_moe_config("mixtral")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    shard_moe(model, world, device="cpu")
    block = moe_blocks(model)[0]
    g = torch.Generator().manual_seed(rank)
    inputs = [torch.randn(14, config.hidden_size, generator=g).to(torch.bfloat16) for _ in range(2)]

    fresh_out, fresh_grads, fresh_cache = micro_steps(model, block, inputs, reuse=False)
    reused_out, reused_grads, reused_cache = micro_steps(model, block, inputs, reuse=True)
    assert fresh_cache is None and torch.bfloat16 in reused_cache, "the cache was not used"
    assert block.experts.cast_cache is None, "the cache outlived its block"
    assert len(fresh_out) == len(reused_out) == 2 and len(fresh_grads) == len(reused_grads) == 2
    for a, b in zip(fresh_out, reused_out):
        assert torch.equal(a, b)
    for a, b in zip(fresh_grads, reused_grads):
        assert a.dtype == torch.float32 and torch.equal(a, b)

    # A weight update between two blocks is seen: the next block casts the new weights.
    with torch.no_grad():
        for p in block.experts.parameters():
            p.to_local().mul_(2)
    updated_out, _, _ = micro_steps(model, block, inputs, reuse=True)
    expected, _, _ = micro_steps(model, block, inputs, reuse=False)
    assert not torch.equal(updated_out[0], reused_out[0])
    assert torch.equal(updated_out[0], expected[0])


def test_reused_casts_equal_fresh_casts_one_rank():
    run_ranks(check_reuse_equals_fresh_casts, 1)


def test_reused_casts_equal_fresh_casts_ep2():
    run_ranks(check_reuse_equals_fresh_casts, 2)
