"""The attention kernel: auto's choice, fixed-shape rows, and packed = unpacked for every kernel auto can pick.

The CUDA-only varlen kernel runs on CPU here through a per-document reference (sdpa on each document alone), so
the plumbing is proven (rows laid end to end, cumulative lengths, grouped-query heads, transformers passing the
keyword arguments to every layer); tests/gpu/test_packed_rows.py compares the kernel itself on a GPU.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, tiny_moe_config
from test_packing import per_token_losses
from transformers import AutoModelForCausalLM

from megablocks_utils.data.batches import GlobalBatches, collate, load_training_data
from megablocks_utils.data.packing import pack_dataset, varlen_inputs
from megablocks_utils.errors import AttentionChoiceError
from megablocks_utils.model import attention
from megablocks_utils.model.attention import choose_attention
from megablocks_utils.train.loss import IGNORE_INDEX


@pytest.mark.parametrize("model_type, device, masked, expected", [
    ("mixtral", "cuda", True, "varlen"),
    ("qwen3_moe", "cuda", True, "varlen"),
    ("mixtral", "cuda", False, "sdpa_causal"),  # full rows of one document: only the causal triangle
    ("gpt_oss", "cuda", True, "flex_attention"),  # sinks: not in the varlen kernel
    ("gpt_oss", "cuda", False, "flex_attention"),  # sinks: no sdpa kernel
    ("mixtral", "cpu", True, "sdpa"),
    ("gpt_oss", "cpu", True, "eager"),  # sinks: no sdpa, and flex has no CPU backward
])
def test_auto_picks_an_exact_kernel_for_model_device_and_rows(model_type, device, masked, expected):
    kernel, why = choose_attention("auto", tiny_moe_config(model_type), device, masked=masked)
    assert kernel == expected and why.startswith(f"auto: {expected}")


def test_auto_leaves_varlen_for_attention_dropout():
    assert choose_attention("auto", tiny_moe_config("mixtral", attention_dropout=0.1), "cuda")[0] == "flex_attention"


def test_fp32_on_a_gpu_gets_no_varlen():
    """The flash varlen kernel refuses fp32 (found by tests/gpu, 2026-11-24): auto leaves it, an explicit ask is an error."""
    config = tiny_moe_config("mixtral")
    assert choose_attention("auto", config, "cuda", dtype=torch.float32)[0] == "flex_attention"
    assert choose_attention("auto", config, "cuda", masked=False, dtype=torch.float32)[0] == "sdpa_causal"
    assert choose_attention("auto", config, "cuda", dtype=torch.bfloat16)[0] == "varlen"
    with pytest.raises(AttentionChoiceError, match="runs in bf16 or fp16, not float32"):
        choose_attention("varlen", config, "cuda", dtype=torch.float32)


@pytest.mark.parametrize("model_type, kernel, device, message", [
    ("mixtral", "varlen", "cpu", "needs a GPU"),
    ("gpt_oss", "varlen", "cuda", "attention sinks are not in the varlen kernel"),
    ("gpt_oss", "sdpa", "cuda", "gpt_oss has no sdpa attention"),
    ("gpt_oss", "flex_attention", "cpu", "sinks need flex_attention on a GPU"),
])
def test_an_explicit_kernel_that_cannot_run_is_a_clear_error(model_type, kernel, device, message):
    with pytest.raises(AttentionChoiceError, match=message):
        choose_attention(kernel, tiny_moe_config(model_type), device)


def test_explicit_kernels_that_can_run_are_kept():
    for kernel in ("sdpa", "eager", "flex_attention"):
        assert choose_attention(kernel, tiny_moe_config("mixtral"), "cpu")[0] == kernel
    assert choose_attention("varlen", tiny_moe_config("mixtral"), "cuda")[0] == "varlen"


def test_varlen_inputs_mark_every_document_of_every_row():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]])
    inputs = varlen_inputs(positions)
    assert inputs["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 10, 12] and inputs["cu_seq_lens_q"].dtype == torch.int32
    assert inputs["max_length_q"] == 6




@pytest.mark.parametrize("packing", [True, False])
def test_every_training_batch_has_the_same_shape(tokenizer, packing):
    """Fixed shapes, the cause of no recompiles: every micro-batch of an epoch is [micro_batch, max_length], the
    short last rows (packed) and short samples (unpacked) included, and padding carries no labels."""
    data = load_training_data(os.path.join(ROOT, "data.json"), tokenizer, 256, packing=packing, seed=0)
    batches = GlobalBatches(data.train, 4, 2, 1, 0, 0)
    assert min(len(ids) for ids in data.train["input_ids"]) < 256  # there are short rows to pad
    for step in range(batches.steps_per_epoch):
        for indices in batches.micro_batches(step)[0]:
            batch = collate([data.train[i] for i in indices], tokenizer.pad_token_id, "cpu", 256)
            assert batch["input_ids"].shape == (4, 256)
            assert (batch["labels"][batch["real"] == 0] == IGNORE_INDEX).all()
            model_inputs = batch["model_inputs"]
            assert (model_inputs["attention_mask"] is None) == packing and model_inputs["use_cache"] is False
    assert data.needs_mask


def _documents_alone(query, key, value, cu_seqlens, max_len, scale, window):
    """The varlen kernel's contract on CPU: causal attention within each [cu[i], cu[i+1]) span, nothing across."""
    assert window == -1 and value.shape[-1] == query.shape[-1]  # flash's varlen kernel takes one head width
    out = torch.empty_like(query)
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [heads, tokens, dim]
        k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        v = v.repeat_interleave(q.shape[0] // v.shape[0], dim=0)
        out[start:end] = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(0, 1)
    return out


def test_varlen_takes_value_heads_narrower_than_query_heads(monkeypatch):
    """DeepSeek's MLA (q/k heads 192 wide, v 128): the values are padded to the kernel's one width and the output cut
    back, the same as attention over each document with the narrow values."""
    monkeypatch.setattr(attention, "_varlen_kernel", _documents_alone)
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, 4, 12, d, generator=g) for d in (24, 24, 16))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4]])
    out, _ = attention.varlen_attention(None, query, key, value, None, scaling=0.3, **varlen_inputs(positions))
    assert out.shape == (2, 12, 4, 16)
    for row in range(2):
        starts = (positions[row] == 0).nonzero().flatten().tolist() + [12]
        for a, b in zip(starts[:-1], starts[1:]):
            expected = F.scaled_dot_product_attention(query[row, :, a:b], key[row, :, a:b], value[row, :, a:b], is_causal=True,
                                                      scale=0.3)
            torch.testing.assert_close(out[row, a:b], expected.transpose(0, 1))


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex_attention", "varlen"])
def test_packed_fixed_length_rows_give_the_unpacked_losses_for_every_kernel(tiny_model_dir, samples, tokenizer, monkeypatch,
                                                                            kernel):
    """Two rows of max_length tokens, each several documents and a padding document, against every document alone:
    the same losses (fp32, 1e-5) and, where the kernel has a CPU backward (all but flex), the same gradients. flex's
    documents alone run through sdpa (the same weights): on CPU flex compiles once per document length (~40 s)."""
    if kernel == "varlen":
        monkeypatch.setattr(attention, "_varlen_kernel", _documents_alone)
        attention.register_varlen()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=kernel)
    alone_kernel = "sdpa" if kernel == "flex_attention" else kernel
    alone_model = model if alone_kernel == kernel else AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation=alone_kernel)
    chosen = samples.select(range(8))
    length = max(len(ids) for ids in chosen["input_ids"]) * 3
    packed = pack_dataset(chosen, length, seed=0)
    rows = [packed[0], packed[1]]
    assert all(len(r["samples"]) > 1 and len(r["input_ids"]) < length for r in rows)  # each ends in a padding document
    backward = kernel != "flex_attention"

    alone, alone_grads = [], None
    for row in rows:
        for i in row["samples"]:
            model.zero_grad()
            with torch.set_grad_enabled(backward):
                loss, mask = per_token_losses(alone_model, collate([samples[i]], tokenizer.pad_token_id, "cpu",
                                                                   attention=alone_kernel))
            alone.append(loss[mask])
            if backward:
                loss[mask].sum().backward()
                grads = [p.grad.clone() for p in model.parameters()]
                alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]

    model.zero_grad()
    batch = collate([rows[0], rows[1]], tokenizer.pad_token_id, "cpu", length, kernel)
    assert batch["input_ids"].shape == (2, length)
    with torch.set_grad_enabled(backward):
        loss, mask = per_token_losses(model, batch)
    torch.testing.assert_close(loss[mask], torch.cat(alone), rtol=1e-5, atol=1e-6)
    if backward:
        loss[mask].sum().backward()
        for p, g in zip(model.parameters(), alone_grads):
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_varlen_check_can_fail(tiny_model_dir, samples, tokenizer, monkeypatch):
    """The reference kernel keeps documents apart only through the cumulative lengths: one span over the whole
    batch (documents mixed) gives other losses, so the test above would see a wrong boundary."""
    monkeypatch.setattr(attention, "_varlen_kernel", _documents_alone)
    attention.register_varlen()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="varlen")
    row = pack_dataset(samples.select(range(4)), 1024, seed=0)[0]
    batch = collate([row], tokenizer.pad_token_id, "cpu", 1024, "varlen")
    right, mask = per_token_losses(model, batch)
    batch["model_inputs"]["cu_seq_lens_q"] = torch.tensor([0, 1024], dtype=torch.int32)
    wrong, _ = per_token_losses(model, batch)
    assert not torch.allclose(right[mask], wrong[mask], rtol=1e-3)


@pytest.mark.parametrize("packing", [True, False])
def test_only_rows_with_padding_or_several_documents_need_a_mask(tokenizer, tmp_path, packing):
    """What auto's sdpa-or-not choice reads: records longer than max_length fill every row with one document
    (nothing to mask); one short record among them does not."""
    import json

    long_text = " ".join(r["output"] for r in json.load(open(os.path.join(ROOT, "data.json"))))
    full = [{"text": long_text[i * 50:]} for i in range(6)]
    for records, expected in ((full, False), (full + [{"text": "short"}], True)):
        path = tmp_path / "text.json"
        path.write_text(json.dumps(records))
        data = load_training_data(str(path), tokenizer, 64, packing=packing, seed=0, eval_split=0.0)
        assert data.needs_mask is expected


def test_a_row_longer_than_the_fixed_length_is_refused(samples, tokenizer):
    with pytest.raises(ValueError, match="does not fit the collator's length 8"):
        collate([samples[0]], tokenizer.pad_token_id, "cpu", 8)


def test_sdpa_causal_gives_sdpas_losses_and_gradients_on_whole_rows_and_refuses_a_mask(tiny_model_dir, samples, tokenizer):
    """auto's kernel for rows that are each one whole document: transformers' sdpa with no mask built, the same numbers
    as sdpa (which builds none either there, but checks the positions with a host sync first); a row that needs a mask
    is an error, not a silently wrong attention."""
    attention.register_sdpa_causal()
    length = min(len(samples[i]["input_ids"]) for i in (0, 1))  # both cut to one length: whole rows, no padding
    rows = [collate([{k: samples[i][k][:length] for k in ("input_ids", "labels")}], tokenizer.pad_token_id, "cpu", length)
            for i in (0, 1)]
    assert length > 8 and all(r["attention_mask"].all() for r in rows)
    results = []
    for kernel in ("sdpa", "sdpa_causal"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=kernel)
        losses = []
        for row in rows:
            loss, mask = per_token_losses(model, dict(row, model_inputs={**row["model_inputs"], "attention_mask": None}))
            loss[mask].sum().backward()
            losses.append(loss[mask].detach())
        results.append((torch.cat(losses), [p.grad.clone() for p in model.parameters()]))
    (a, grads_a), (b, grads_b) = results
    torch.testing.assert_close(b, a, rtol=0, atol=0)
    for x, y in zip(grads_b, grads_a):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    # transformers drops a mask it has no mask function for, so the collator refuses the rows instead
    packed = pack_dataset(samples.select(range(4)), 1024, seed=0)[0]
    for batch in ([packed], [samples[0], samples[1]]):  # several documents; padding
        with pytest.raises(ValueError, match="padding or several documents"):
            collate(batch, tokenizer.pad_token_id, "cpu", 1024, "sdpa_causal")
