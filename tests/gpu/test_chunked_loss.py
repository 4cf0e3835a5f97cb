"""The chunked loss (megablocks_utils/train/loss.py) on one GPU, in bf16, where its element-wise step is compiled.

Qwen3-30B-A3B's lm_head (hidden 2048, vocabulary 151,936) on 4096 rows (one micro-batch of the benchmarks: 2 chunks),
a tenth of the labels ignored, bf16 weights and hidden states as FSDP's mixed precision gives them to lm_head: the
chunked loss (compiled and eager) against the full-logits loss in bf16 and the fp32 truth on the same bf16 inputs; its
peak memory beside the full-logits path's; and no host sync in its forward or backward. One measuring process, one
test per claim.
"""

import pytest
import torch

from .launch import gpus, host_sync_error, run_on_gpus

pytestmark = gpus(1)
ROWS, HIDDEN, VOCAB = 4096, 2048, 151936


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure(rank, world):
    import torch.nn.functional as F

    from megablocks_utils.train.loss import (
        IGNORE_INDEX,
        causal_lm_loss_sum,
        chunked_loss_sum,
        loss_chunk_rows,
        next_token_targets,
    )

    torch.manual_seed(0)
    hidden = torch.randn(1, ROWS, HIDDEN, device="cuda").bfloat16()
    weight = (0.02 * torch.randn(VOCAB, HIDDEN, device="cuda")).bfloat16()
    labels = torch.randint(0, VOCAB, (1, ROWS), device="cuda")
    labels[:, ::10] = IGNORE_INDEX
    targets, scale = next_token_targets(labels), 1.0 / ROWS
    chunk_rows = loss_chunk_rows(ROWS, VOCAB)

    def run(fn, dtype=torch.bfloat16):
        h = hidden.to(dtype).detach().requires_grad_()
        w = weight.to(dtype).detach().requires_grad_()
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = fn(h, w)
        (scale * loss).backward()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - start) / 2**30
        return loss.detach(), h.grad, w.grad, peak

    def full(h, w):
        return causal_lm_loss_sum(F.linear(h, w), labels)

    def compiled(h, w):
        return chunked_loss_sum(h[0], w, targets, chunk_rows, fuse=True)

    def eager(h, w):
        return chunked_loss_sum(h[0], w, targets, chunk_rows, fuse=False)

    truth = run(full, torch.float32)
    plain = run(full)
    run(compiled)  # warm-up: compiles the element-wise steps
    ours, ours_eager = run(compiled), run(eager)
    uneven = run(lambda h, w: chunked_loss_sum(h[0], w, targets, 1500, fuse=True))  # a last chunk of 1096 rows: a second shape
    found = {"chunk_rows": chunk_rows, "loss_uneven_vs_plain": rel(uneven[0], plain[0]),
             "loss_vs_plain": rel(ours[0], plain[0]), "loss_eager_vs_plain": rel(ours_eager[0], plain[0]),
             "grad_vs_truth": {name: [rel(ours[i], truth[i]), rel(ours_eager[i], truth[i]), rel(plain[i], truth[i])]
                               for i, name in ((1, "hidden"), (2, "weight"))},
             "peak_gib": {"plain": plain[3], "chunked": ours[3], "chunked_eager": ours_eager[3]}}

    h = hidden.to(torch.bfloat16).detach().requires_grad_()
    w = weight.to(torch.bfloat16).detach().requires_grad_()
    with torch.no_grad():  # compiles the loss-only step first: compiling syncs, a training step does not
        chunked_loss_sum(h[0], w, targets, chunk_rows, fuse=True)

    def train_step_and_loss():
        (scale * chunked_loss_sum(h[0], w, targets, chunk_rows, fuse=True)).backward()
        with torch.no_grad():
            chunked_loss_sum(h[0], w, targets, chunk_rows, fuse=True)

    found["host_sync"] = host_sync_error(train_step_and_loss)
    return found


@pytest.fixture(scope="module")
def found():
    return run_on_gpus(measure, 1)[0]


def test_the_loss_is_the_full_logits_loss(found):
    """The chunks' logits are lm_head's bf16 GEMM rows: the loss equals the bf16 full-logits loss to fp32 sums taken in
    another order (compiled and eager, and compiled again for chunks of another row count)."""
    assert found["chunk_rows"] == ROWS // 2  # 2 chunks of 2048 rows
    assert max(found["loss_vs_plain"], found["loss_eager_vs_plain"], found["loss_uneven_vs_plain"]) <= 1e-5, found


def test_gradients_are_as_close_to_fp32_as_the_full_logits_path(found):
    """Against the fp32 computation on the same bf16 inputs: the hidden states' and the weight's gradients within
    1.5x the bf16 full-logits path's error, compiled and eager (2 chunks: the weight's 1.2x on CPU, train/loss.py)."""
    for name, (compiled, eager, plain) in found["grad_vs_truth"].items():
        assert compiled <= 1.5 * plain and eager <= 1.5 * plain, (name, compiled, eager, plain)


def test_peak_memory_is_a_fraction_of_the_full_logits_path(found):
    """Full logits: bf16 logits, their fp32 copy, the saved log-softmax and the fp32 gradient of 4096 x 151,936 entries
    (about 7 GiB above the inputs). Chunked: one chunk's bf16 logits and gradient (1.2 GiB) plus the weight's gradient
    (0.6 GiB): under a third of it."""
    peaks = found["peak_gib"]
    assert peaks["chunked"] <= peaks["plain"] / 3, peaks


def test_no_host_sync(found):
    assert found["host_sync"] == "", f"a host sync in the chunked loss: {found['host_sync']}"
