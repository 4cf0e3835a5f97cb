"""The experts' weight gradients beside the all-to-all (``moe/weight_grad.py``): the wiring on CPU, where no side stream
exists, with a stand-in that runs the queued work at once and records it. Which GEMMs queue their weight gradient
(inside ``weight_grads_beside_exchange`` only),
that the result is the same, and that ``dispatch.exchange``'s trip out joins in its backward after the experts' work
was queued, its trip back not. tests/gpu/test_weight_grads_beside.py runs the real side stream at ep 2 on two GPUs.
"""

import pytest
import torch
import torch.distributed as dist

from megablocks_utils.moe import dispatch, weight_grad
from megablocks_utils.moe.weight_grad import WeightGradInto, grouped_mm, grouped_mm_grad_into

from conftest import free_port


@pytest.fixture
def events(monkeypatch):
    """The setting on; side-stream work run at once and recorded as ("side", tensors read); joins recorded as ("join",)."""
    found = []

    def on_side_stream(work, *read):
        found.append(("side", len(read)))
        work()

    monkeypatch.setattr(weight_grad, "WEIGHT_GRADS_BESIDE_EXCHANGE", True)  # the setting on (off by default)
    monkeypatch.setattr(weight_grad, "_can_go_beside", lambda x: True)
    monkeypatch.setattr(weight_grad, "_on_side_stream", on_side_stream)
    monkeypatch.setattr(dispatch, "join_weight_grads", lambda: found.append(("join",)))
    return found


def one_gemm(inside: bool):
    """One grouped GEMM's forward and backward (fp32 on CPU), inside the context or not; its weight's gradient and the
    input's."""
    torch.manual_seed(0)
    offs = torch.cumsum(torch.tensor([8, 0, 24], dtype=torch.int32), 0, dtype=torch.int32)
    weight = torch.nn.Parameter(0.1 * torch.randn(3, 16, 32))
    x = torch.randn(32, 16).requires_grad_(True)
    grad = torch.randn(32, 32)
    if inside:
        with weight_grad.weight_grads_beside_exchange():
            out = grouped_mm_grad_into(x, weight.detach(), offs, WeightGradInto(weight, 1, False), False)
    else:
        out = grouped_mm_grad_into(x, weight.detach(), offs, WeightGradInto(weight, 1, False), False)
    out.backward(grad)
    reference = torch.nn.Parameter(weight.detach().clone())
    x_ref = x.detach().clone().requires_grad_(True)
    grouped_mm(x_ref, reference, offs).backward(grad)
    return weight.grad, reference.grad, x.grad, x_ref.grad


def test_a_gemm_inside_queues_its_weight_gradient_beside(events):
    w_grad, w_ref, x_grad, x_ref = one_gemm(inside=True)
    assert events == [("side", 3)]
    assert torch.allclose(w_grad, w_ref, rtol=1e-6, atol=1e-6) and torch.equal(x_grad, x_ref)


def test_a_gemm_outside_computes_it_in_place(events):
    w_grad, w_ref, _, _ = one_gemm(inside=False)
    assert events == [] and torch.allclose(w_grad, w_ref, rtol=1e-6, atol=1e-6)


def test_the_setting_off_keeps_every_gemm_in_place(events, monkeypatch):
    monkeypatch.setattr(weight_grad, "WEIGHT_GRADS_BESIDE_EXCHANGE", False)
    one_gemm(inside=True)
    assert events == []


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_the_exchange_joins_after_its_experts_in_the_backward(events, one_rank):
    """Rows through ``dispatch.exchange`` (one rank, two local experts) whose experts are one GEMM with the gradient
    queued beside: in the backward, the experts' weight gradient is queued, then the trip out's backward joins, once;
    the trip back's backward (before the experts in the backward) does not."""
    torch.manual_seed(1)
    weight = torch.nn.Parameter(0.1 * torch.randn(2, 16, 16))
    into = WeightGradInto(weight, 1, False)
    seen = []

    def compute(rows, counts, counts_host):
        seen.append(weight_grad._beside)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return grouped_mm_grad_into(rows, weight.detach(), offs, into, False)

    rows = torch.randn(12, 16, requires_grad=True)
    counts = torch.tensor([5, 7])
    out = dispatch.exchange([rows], [counts], 1, 2, one_rank, compute)[0]
    assert seen == [True] and not weight_grad._beside  # set during the experts' forward only
    out.square().sum().backward()
    assert events == [("side", 3), ("join",)]
    assert rows.grad is not None and weight.grad is not None
