"""Aux-loss-free load balancing: the routing bias moves the choice of experts only, is the same on every
rank, evens the expert load, and is kept by training checkpoints but not exported for a model that has
no such tensor."""

import json
import os

import torch
import torch.distributed as dist
from conftest import run_ranks

from megablocks_utils import TopKRouter

COEFF = 0.003  # per step; 0.01 overshoots on the tiny model (the load oscillates), 0.003 settles
STEPS = 15


def test_bias_moves_the_choice_not_the_weights():
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    modes = [("softmax_topk", {}), ("topk_softmax", {}), ("sigmoid_group_topk", dict(num_groups=2, topk_groups=2, scaling=2.0)),
             ("softmax_group_topk", dict(num_groups=2, topk_groups=2, scaling=2.0))]
    for mode, options in modes:
        router = TopKRouter(16, 4, 2, renormalize=False, mode=mode, **options)
        torch.nn.init.normal_(router.weight, std=0.1)
        probs, top_w, _ = router(x)
        router.add_score_bias(TopKRouter.ADDED_BIAS)
        router.routing_bias.copy_(torch.tensor([5.0, 5.0, 0.0, 0.0]))  # experts 0 and 1 win every choice
        biased_probs, biased_w, biased_i = router(x)
        assert (biased_i.sort(dim=-1).values == torch.tensor([0, 1])).all(), mode
        torch.testing.assert_close(biased_probs, probs, rtol=0, atol=0)  # what the aux loss sees is unchanged
        if mode == "softmax_topk":
            torch.testing.assert_close(biased_w, probs.gather(1, biased_i))
        elif mode == "topk_softmax":
            logits = torch.nn.functional.linear(x, router.weight)
            torch.testing.assert_close(biased_w, torch.softmax(logits.gather(1, biased_i), dim=-1))
        elif mode == "softmax_group_topk":
            torch.testing.assert_close(biased_w, 2.0 * probs.gather(1, biased_i))
        else:
            scores = torch.sigmoid(torch.nn.functional.linear(x, router.weight))
            torch.testing.assert_close(biased_w, 2.0 * scores.gather(1, biased_i))
        assert not torch.equal(biased_w, top_w), mode  # the bias did change the choice here


def _imbalance(tokens_per_expert: torch.Tensor) -> float:
    """max / mean tokens per expert, averaged over layers."""
    return float((tokens_per_expert.max(dim=1).values / tokens_per_expert.mean(dim=1)).mean())


def _train(model_dir, coeff, rank, world):
    """STEPS steps of the tiny Mixtral on random tokens (ep 2, FSDP2), the bias updated after each optimizer
    step as train_fsdp2.py does; returns the model, its optimizer and the imbalance of the last 5 steps' load."""
    from megablocks_utils import (
        build_mesh,
        causal_lm_loss_sum,
        count_label_tokens,
        load_model,
        router_stats,
    )
    from megablocks_utils.moe.blocks import moe_blocks
    from megablocks_utils.moe.balance import add_routing_bias, update_routing_bias
    from megablocks_utils.parallel.parallelize import parallelize

    model, mesh = load_model(model_dir, build_mesh(2, "cpu"), device="cpu")
    parallelize(model, mesh, param_dtype=torch.float32, device="cpu")
    assert add_routing_bias(model) == len(moe_blocks(model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    last = 0
    for step in range(STEPS):
        ids = torch.randint(3, model.config.vocab_size, (8, 64), generator=g)
        out = model(ids)
        stats = router_stats(model, None, mesh.world.get_group())
        (world * causal_lm_loss_sum(out.logits, ids) / (count_label_tokens(ids) * world)).backward()
        optimizer.step()
        optimizer.zero_grad()
        before = [b.top_k_router.routing_bias.clone() for b in moe_blocks(model)]
        update_routing_bias(model, stats.tokens_per_expert, coeff)
        for b, old, load in zip(moe_blocks(model), before, stats.tokens_per_expert.float()):  # the DeepSeek-V3 rule
            torch.testing.assert_close(b.top_k_router.routing_bias, old + coeff * torch.sign(load.mean() - load))
        if step >= STEPS - 5:
            last = last + stats.tokens_per_expert
    return model, mesh, optimizer, _imbalance(last)


def check_balancing(rank, world, model_dir, root):
    from megablocks_utils import build_mesh, load_model
    from megablocks_utils.moe.blocks import moe_blocks
    from megablocks_utils.model.export import export_hf
    from megablocks_utils.moe.balance import add_routing_bias, routing_bias_exported
    from megablocks_utils.parallel.parallelize import parallelize
    from megablocks_utils.train.checkpoint import load_checkpoint, save_checkpoint
    from megablocks_utils.train.checkpoint_export import export_from_checkpoint

    _, _, _, without = _train(model_dir, 0.0, rank, world)
    model, mesh, optimizer, balanced = _train(model_dir, COEFF, rank, world)
    assert balanced < 0.9 * without, (balanced, without)

    biases = torch.stack([b.top_k_router.routing_bias for b in moe_blocks(model)])
    assert biases.abs().sum() > 0
    gathered = [torch.empty_like(biases) for _ in range(world)]
    dist.all_gather(gathered, biases)
    assert all(torch.equal(g, biases) for g in gathered), "the routing bias differs between ranks"

    # A training checkpoint keeps the bias; a fresh model with a zero bias gets it back.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = save_checkpoint(os.path.join(root, "checkpoints"), STEPS, model, optimizer, scheduler, {}, 1, model_dir)
    fresh, fresh_mesh = load_model(model_dir, build_mesh(2, "cpu"), device="cpu")
    parallelize(fresh, fresh_mesh, param_dtype=torch.float32, device="cpu")
    add_routing_bias(fresh)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    load_checkpoint(path, fresh, fresh_optimizer, torch.optim.lr_scheduler.LambdaLR(fresh_optimizer, lambda step: 1.0))
    torch.testing.assert_close(torch.stack([b.top_k_router.routing_bias for b in moe_blocks(fresh)]), biases, rtol=0, atol=0)

    # Mixtral's checkpoint format has no place for it: neither export writes it.
    assert not routing_bias_exported(model)
    export_hf(model, mesh, os.path.join(root, "final"))
    if rank == 0:
        export_from_checkpoint(path, os.path.join(root, "from_checkpoint"))
        for out in ("final", "from_checkpoint"):
            with open(os.path.join(root, out, "model.safetensors.index.json")) as f:
                names = json.load(f)["weight_map"]
            assert not [n for n in names if TopKRouter.ADDED_BIAS in n], out
    dist.barrier()


def test_routing_bias_balances_the_load_and_is_the_same_on_every_rank(tiny_model_dir, tmp_path):
    """2 gloo ranks (ep 2): coeff 0 against COEFF on the embedded tiny Mixtral, then a checkpoint and the exports."""
    run_ranks(check_balancing, 2, tiny_model_dir, str(tmp_path))
