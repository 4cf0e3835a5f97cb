"""The experts' weight gradients beside the all-to-all (``moe/weight_grad.py``, ``WEIGHT_GRADS_BESIDE_EXCHANGE``) give
the same gradients, to the bit, as the weight gradients queued before it.

One layer's experts at ep 2 on two GPUs (NCCL), grouped GEMMs in bf16, weights whose gradients the GEMMs write
themselves; two micro-steps (the first writes ``.grad``, the second adds into it), with the setting on and off on the
same inputs. Each rank compares its own expert blocks and its tokens' input gradient.
"""

import pytest
import torch

from .launch import gpus, run_on_gpus

pytestmark = gpus(2)


def measure(rank, world):
    from types import SimpleNamespace

    import torch.distributed as dist

    from megablocks_utils.moe import weight_grad
    from megablocks_utils.moe.layer import ExpertParallelExperts

    experts_total, hidden, inter, tokens, k = 16, 512, 256, 4096, 4
    mesh = SimpleNamespace(ep_size=world, ep_group=dist.group.WORLD)
    experts = ExpertParallelExperts(experts_total, mesh, "silu")
    gen = torch.Generator(device="cuda").manual_seed(rank)
    local = experts_total // world
    shapes = [(local, 2 * inter, hidden), (local, hidden, inter)]
    experts.set_weights(*(torch.nn.Parameter(0.05 * torch.randn(s, device="cuda", dtype=torch.bfloat16, generator=gen))
                          for s in shapes))
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    # skewed routing: some experts get many more rows than others (uneven splits both ways)
    top_i = (torch.rand(tokens, k, device="cuda", generator=gen).square() * experts_total).long()
    top_w = torch.rand(tokens, k, device="cuda", generator=gen).softmax(-1)

    def two_micro_steps(beside: bool):
        weight_grad.WEIGHT_GRADS_BESIDE_EXCHANGE = beside
        experts.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_(True)
        for _ in range(2):
            experts(leaf, top_i, top_w).float().square().sum().backward()
        torch.cuda.synchronize()
        return [experts.gate_up_proj.grad.clone(), experts.down_proj.grad.clone(), leaf.grad.clone()]

    two_micro_steps(False)  # warm-up: compiles the element-wise kernels
    off = two_micro_steps(False)
    streams_before = len(weight_grad._side_streams)
    on = two_micro_steps(True)
    return {
        "owns_grads": experts.owns_weight_grads(x, torch.zeros(local, device="cuda")),
        "side_stream_used": len(weight_grad._side_streams) > streams_before,
        "all_joined": not weight_grad._pending,
        "equal": [torch.equal(a, b) for a, b in zip(on, off)],
        "finite_nonzero": [bool(t.isfinite().all() and t.abs().sum() > 0) for t in on],
    }


@pytest.fixture(scope="module")
def results():
    return run_on_gpus(measure, 2)


def test_the_path_under_test_ran(results):
    for r in results:
        assert r["owns_grads"] and r["side_stream_used"] and r["all_joined"], r


def test_weight_grads_beside_the_exchange_equal_them_before_it(results):
    for r in results:
        assert r["finite_nonzero"] == [True, True, True], r
        assert r["equal"] == [True, True, True], r
