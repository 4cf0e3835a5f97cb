"""The chunked loss (megablocks_utils/train/loss.py): computed inside lm_head over chunks of rows, it equals the loss from
the full logits, ``causal_lm_loss_sum(lm_head(h), labels)``, in fp32 (the loss and the gradients of the hidden states
and of lm_head's weight), whatever the chunk size, with ignored labels, in the transformers model (tied embeddings
included) and under FSDP2 on 2 ranks; in bf16 its logits are lm_head's and its gradients as close to the fp32 truth
as the plain path's. It reads nothing on the host. Models that change lm_head's output (Granite) and an lm_head with
a LoRA adapter keep the full logits; a model that changes it unannounced stops with a message."""

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import run_ranks, tiny_moe_config
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from megablocks_utils import IGNORE_INDEX, build_mesh
from megablocks_utils.model.lora import LoraSettings, add_lora
from megablocks_utils.parallel.parallelize import parallelize
from megablocks_utils.train.loss import (
    LossHead,
    causal_lm_loss_sum,
    chunked_loss_sum,
    forward_with_loss,
    install_loss_head,
    loss_chunk_rows,
    next_token_targets,
)

TOL = 1e-6


def rel_err(a, b) -> float:
    a, b = (torch.as_tensor(t).detach().double() for t in (a, b))
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make_labels(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Random labels with ignored stretches: a prompt at the start of row 0, one position inside row 1, and the whole
    of the last row's second half."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, : seq // 3] = IGNORE_INDEX
    labels[1 % batch, seq // 2] = IGNORE_INDEX
    labels[-1, seq // 2 :] = IGNORE_INDEX
    return labels


def grads_of(fn, hidden: torch.Tensor, weight: torch.Tensor, scale: float = 0.37):
    """(loss, d hidden, d weight) of ``scale * fn(hidden, weight)``, on fresh leaves."""
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = fn(h, w)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def plain(labels):
    return lambda h, w: causal_lm_loss_sum(F.linear(h, w), labels)


def chunked(labels, chunk_rows):
    return lambda h, w: chunked_loss_sum(h.reshape(-1, h.shape[-1]), w, next_token_targets(labels), chunk_rows)


# ----------------------------------------------------------------------------- the function
@pytest.mark.parametrize("chunk_rows", [1, 7, 8, 13, 24, 1000], ids=lambda c: f"rows{c}")
def test_fp32_loss_and_grads_equal_the_full_logits_path(chunk_rows):
    """3 rows x 8 positions = 24 rows: chunks of 7 and 13 end short, 8 and 24 divide them, 1000 is one chunk."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 8, 16), torch.randn(50, 16) * 0.3
    labels = make_labels(3, 8, 50)
    ref = grads_of(plain(labels), hidden, weight)
    got = grads_of(chunked(labels, chunk_rows), hidden, weight)
    for name, a, b in zip(("loss", "hidden grad", "weight grad"), got, ref):
        assert rel_err(a, b) <= TOL, (name, rel_err(a, b))


def test_ignored_rows_contribute_nothing():
    """A chunk of ignored rows only: no loss, zero gradient rows; every label ignored: a zero loss and zero gradients."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 6, 8), torch.randn(20, 8)
    labels = make_labels(2, 6, 20)
    labels[0] = IGNORE_INDEX  # rows 0-5 ignored (row 5 targets row 1's first label: none, the row's end)
    loss, dh, dw = grads_of(chunked(labels, 3), hidden, weight)
    assert rel_err(loss, grads_of(plain(labels), hidden, weight)[0]) <= TOL
    assert dh[0].abs().max() == 0 and dh[1].abs().max() > 0
    loss, dh, dw = grads_of(chunked(torch.full((2, 6), IGNORE_INDEX), 4), hidden, weight)
    assert loss == 0 and dh.abs().max() == 0 and dw.abs().max() == 0


def test_bf16_logits_are_lm_heads_and_grads_as_close_to_fp32_as_the_plain_path():
    """bf16: each chunk's logits are lm_head's bf16 GEMM, so the loss is the plain path's (to fp32's rounding of the
    sum, 40x closer than to the loss of unrounded logits); the gradients differ from
    the plain path's by rounding only (scaled after the GEMMs, the weight's summed over chunks in bf16): compared with
    the fp32 computation on the same bf16 inputs, within 1.5x the plain path's error."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(4, 64, 32).bfloat16(), (torch.randn(500, 32) * 0.3).bfloat16()
    labels = make_labels(4, 64, 500)
    truth = grads_of(plain(labels), hidden.float(), weight.float(), scale=1 / 300)
    ref = grads_of(plain(labels), hidden, weight, scale=1 / 300)
    got = grads_of(chunked(labels, 100), hidden, weight, scale=1 / 300)
    assert rel_err(got[0], ref[0]) <= TOL and 10 * rel_err(got[0], ref[0]) < rel_err(got[0], truth[0])
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for a, b, t in zip(got[1:], ref[1:], truth[1:]):
        assert rel_err(a, t) <= 1.5 * rel_err(b, t), (rel_err(a, t), rel_err(b, t))


def test_without_grad_only_the_loss_and_a_frozen_weight_gets_none():
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8), torch.randn(30, 8)
    labels = make_labels(2, 5, 30)
    targets = next_token_targets(labels)
    ref = causal_lm_loss_sum(F.linear(hidden, weight), labels)
    with torch.no_grad():
        assert rel_err(chunked_loss_sum(hidden.reshape(-1, 8), weight, targets, 3), ref) <= TOL
    h = hidden.clone().requires_grad_()
    chunked_loss_sum(h.reshape(-1, 8), weight, targets, 3).backward()  # weight frozen, as lm_head under LoRA
    assert rel_err(h.grad, grads_of(plain(labels), hidden, weight, scale=1.0)[1]) <= TOL


def test_the_loss_reads_nothing_on_the_host():
    """No .item(), int(), bool() or data-dependent shape in the forward or backward (each would wait for the GPU):
    none of the ops that do so is dispatched."""
    host_reads = {"_local_scalar_dense", "nonzero", "item", "masked_select", "unique"}
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    h, w = torch.randn(2, 9, 8, requires_grad=True), torch.randn(40, 8, requires_grad=True)
    targets = next_token_targets(make_labels(2, 9, 40))
    with Ops():
        chunked_loss_sum(h.reshape(-1, 8), w, targets, 4).backward()
        with torch.no_grad():
            chunked_loss_sum(h.reshape(-1, 8), w, targets, 4)
    assert "mm" in seen and not host_reads & set(seen), sorted(set(seen))


def test_chunks_are_as_few_and_as_even_as_the_logits_budget_allows():
    assert loss_chunk_rows(4096, 151936) == 2048  # Qwen3: at most 3533 rows a chunk, so 2 chunks
    assert loss_chunk_rows(4096, 201088) == 2048  # gpt-oss: at most 2669
    assert loss_chunk_rows(8192, 151936) == 2731  # 3 chunks, the last one a row shorter
    assert loss_chunk_rows(4096, 32000) == 4096  # Mixtral: one chunk
    assert loss_chunk_rows(3, 2**40) == 1


# ----------------------------------------------------------------------------- inside the model
def model_and_batch(model_type: str, tied: bool = False, **config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(model_type, tie_word_embeddings=tied, output_router_logits=False, **config))
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(1, model.config.vocab_size, (3, 10), generator=g)
    labels = input_ids.clone()
    labels[0, :4] = IGNORE_INDEX
    labels[2, 7:] = IGNORE_INDEX
    return model, {"input_ids": input_ids}, labels


def loss_and_grads(model, inputs, labels):
    """(loss, output, gradients by name) of forward_with_loss; the loss as returned (for ``out.logits is loss``)."""
    loss, out = forward_with_loss(model, inputs, labels)
    loss.backward()
    return loss, out, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_loss_head_equals_the_model_with_full_logits(model_type, tied):
    """Same parameters under the same names (lm_head.weight, tied to embed_tokens.weight where the config says so),
    the same loss and every parameter's gradient, 30 rows in chunks of 7; outside forward_with_loss, logits."""
    reference, inputs, labels = model_and_batch(model_type, tied)
    model = copy.deepcopy(reference)
    assert install_loss_head(model) == ""
    model.lm_head.chunk_rows = 7
    assert isinstance(model.lm_head, LossHead)
    assert list(model.state_dict()) == list(reference.state_dict())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ref_loss, ref_out, ref_grads = loss_and_grads(reference, inputs, labels)
    loss, out, grads = loss_and_grads(model, inputs, labels)
    assert out.logits is loss  # the loss where the logits were (forward_with_loss's contract)
    assert rel_err(loss.detach(), causal_lm_loss_sum(ref_out.logits, labels).detach()) <= TOL
    assert rel_err(ref_loss.detach(), loss.detach()) <= TOL
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) <= TOL, (name, rel_err(grad, ref_grads[name]))
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, reference(**inputs).logits)  # generation, PEFT: lm_head as before


def test_autocast_runs_lm_heads_gemm_in_the_autocast_dtype():
    """Trainer's bf16 (train_fsdp1.py): fp32 weights under autocast; the chunks' logits are bf16 as lm_head's are."""
    reference, inputs, labels = model_and_batch("mixtral")
    model = copy.deepcopy(reference)
    install_loss_head(model)
    model.lm_head.chunk_rows = 7
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = forward_with_loss(model, inputs, labels)
        ref = causal_lm_loss_sum(reference(**inputs).logits, labels)
    loss.backward()
    assert rel_err(loss.detach(), ref.detach()) <= 1e-2
    assert model.lm_head.weight.grad.dtype == torch.float32 and model.lm_head.weight.grad.abs().max() > 0


def test_models_that_change_the_logits_keep_them_and_say_why():
    """Granite divides lm_head's output by logits_scaling: no LossHead, the loss from its logits; a LossHead forced on
    it stops with a message instead of returning the divided loss."""
    model, inputs, labels = model_and_batch("granitemoe")
    note = install_loss_head(model)
    assert "logits_scaling" in note and not isinstance(model.lm_head, LossHead)
    loss, out = forward_with_loss(model, inputs, labels)
    assert out.logits.shape[-1] == model.config.vocab_size and rel_err(loss, causal_lm_loss_sum(out.logits, labels)) == 0
    model.set_output_embeddings(LossHead(model.lm_head.weight, fuse=False, chunk_rows=7))
    with pytest.raises(RuntimeError, match="changed lm_head's output.*--chunked_loss false"):
        forward_with_loss(model, inputs, labels)


def test_an_lm_head_with_a_lora_adapter_keeps_the_full_logits():
    reference, inputs, labels = model_and_batch("mixtral")
    add_lora(reference, None, LoraSettings(r=2, alpha=4, dropout=0.0, targets=("lm_head", "q_proj")), torch.float32)
    with torch.no_grad():
        reference.lm_head.lora_B.weight.normal_()  # a non-zero adapter: its logits differ from the base weight's
    model = copy.deepcopy(reference)
    assert "LoRA" in install_loss_head(model) and not isinstance(model.lm_head, LossHead)
    ref_loss, _, ref_grads = loss_and_grads(reference, inputs, labels)
    loss, _, grads = loss_and_grads(model, inputs, labels)
    assert loss == ref_loss and torch.equal(grads["lm_head.lora_B.weight"], ref_grads["lm_head.lora_B.weight"])


# ----------------------------------------------------------------------------- under FSDP2
def check_fsdp2_dp2_tied(rank, world):
    """lm_head.weight (tied to the embedding) lives in FSDP2's root, gathered in its forward and resharded after it:
    each rank's chunked loss and the reduced gradients equal one process's plain computation over both ranks' rows."""
    reference, inputs, labels = model_and_batch("qwen3_moe", tied=True)
    model = copy.deepcopy(reference)
    install_loss_head(model)
    model.lm_head.chunk_rows = 4
    parallelize(model, build_mesh(1, "cpu"), param_dtype=torch.float32, device="cpu")
    rows = slice(rank, rank + 2)  # rank 0: rows 0-1, rank 1: rows 1-2 (row 1 on both)
    ref = sum(causal_lm_loss_sum(reference(input_ids=inputs["input_ids"][r]).logits, labels[r]) for r in (slice(0, 2), slice(1, 3)))
    (ref / world).backward()
    loss, _ = forward_with_loss(model, {"input_ids": inputs["input_ids"][rows]}, labels[rows])
    loss.backward()  # FSDP averages the ranks' gradients: the mean of the two losses' gradients
    assert rel_err(loss, causal_lm_loss_sum(reference(input_ids=inputs["input_ids"][rows]).logits, labels[rows])) <= TOL
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor()
        assert rel_err(grad, ref_grads[name].grad) <= 1e-5, (name, rel_err(grad, ref_grads[name].grad))


def test_fsdp2_with_tied_embeddings_on_two_ranks():
    run_ranks(check_fsdp2_dp2_tied, 2)
