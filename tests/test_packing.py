"""Packing: rows hold several samples, no token sees another document, and the loss is the unpacked one."""

import os

import pytest
import torch
from conftest import ROOT
from transformers import AutoModelForCausalLM

from megablocks_utils.data.batches import collate
from megablocks_utils.data.packing import fill, pack_dataset, pack_rows
from megablocks_utils.data.records import build_dataset
from megablocks_utils.train.loss import IGNORE_INDEX


def test_rows_hold_every_sample_once_and_fit(samples):
    lengths = [len(ids) for ids in samples["input_ids"]]
    rows = pack_rows(lengths, 512, seed=3)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 512 for row in rows)
    assert pack_rows(lengths, 512, seed=3) == rows  # deterministic


@pytest.mark.parametrize("max_length", [1024, 2048])
def test_alpaca_rows_are_as_few_as_possible(samples, max_length):
    packed = pack_dataset(samples, max_length, seed=0)
    total = sum(len(ids) for ids in samples["input_ids"])
    assert len(packed) == -(-total // max_length)  # no row more than the tokens need
    if max_length == 1024:  # 440 records fill 28 rows; at 2048 the 16th row holds what is left over
        assert fill(packed, max_length) >= 0.95
    assert sorted(i for row in packed["samples"] for i in row) == list(range(len(samples)))
    assert sum(packed["num_label_tokens"]) == sum(samples["num_label_tokens"])


def per_token_losses(model, batch):
    """Each position's next-token loss and whether it is a label, the model called as the scripts call it."""
    out = model(**batch["model_inputs"])  # no cache: with one transformers ignores position_ids for the document mask
    logits, labels = out.logits[:, :-1].float(), batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="none").view_as(labels)
    return loss, labels != IGNORE_INDEX


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_gives_the_unpacked_losses_and_gradients(tiny_model_dir, samples, tokenizer, attn):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation=attn)
    chosen = samples.select([0, 5, 9, 17])
    packed = pack_dataset(chosen, sum(len(ids) for ids in chosen["input_ids"]) + 7, seed=0)
    assert len(packed) == 1 and len(packed[0]["samples"]) == 4
    docs = [chosen[i] for i in packed[0]["samples"]]  # in the row's order

    # one by one: each document alone, padded batch of 1
    alone, alone_grads = [], None
    for d in docs:
        model.zero_grad()
        loss, mask = per_token_losses(model, collate([d], tokenizer.pad_token_id, "cpu"))
        alone.append(loss[mask])
        loss[mask].sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]

    # packed: the documents in one row (plus a pad document at the end)
    model.zero_grad()
    row = dict(packed[0])
    row["input_ids"] = row["input_ids"] + [tokenizer.pad_token_id] * 7
    row["labels"] = row["labels"] + [IGNORE_INDEX] * 7
    row["position_ids"] = row["position_ids"] + list(range(7))
    batch = collate([row], tokenizer.pad_token_id, "cpu")
    assert batch["attention_mask"] is None
    loss, mask = per_token_losses(model, batch)
    torch.testing.assert_close(loss[mask], torch.cat(alone), rtol=1e-5, atol=1e-6)
    loss[mask].sum().backward()
    for p, g in zip(model.parameters(), alone_grads):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


def test_without_position_ids_documents_would_mix(tiny_model_dir, samples, tokenizer):
    """The check above can fail: the same row with plain causal attention gives other losses."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    packed = pack_dataset(samples.select([0, 5]), 2048, seed=0)
    batch = collate([packed[0]], tokenizer.pad_token_id, "cpu")
    mixed = dict(batch, model_inputs={**batch["model_inputs"], "position_ids": None})
    a, mask = per_token_losses(model, batch)
    b, _ = per_token_losses(model, mixed)
    assert not torch.allclose(a[mask], b[mask], rtol=1e-3)


def test_collate_marks_real_tokens_and_restarts_positions(samples, tokenizer):
    packed = pack_dataset(samples.select([1, 2, 3]), 4096, seed=0)
    short = dict(packed[0])
    other = {k: short[k][: len(short["input_ids"]) // 2] if isinstance(short[k], list) else short[k] for k in short}
    batch = collate([short, other], tokenizer.pad_token_id, "cpu")
    n, m = len(short["input_ids"]), len(other["input_ids"])
    assert batch["real"][0].sum() == n and batch["real"][1].sum() == m
    assert batch["position_ids"][1, m:].tolist() == list(range(n - m))
    starts = (batch["position_ids"][0, :n] == 0).nonzero().flatten().tolist()
    assert len(starts) == 3 and all(batch["labels"][0, s] == IGNORE_INDEX for s in starts)


def test_packed_text_records_give_the_unpacked_loss(tiny_model_dir, tokenizer, tmp_path):
    """{"text"} records label every token, the first one too: packed, a document's first label would be predicted
    from the previous document, so packing must drop it. The packed row's summed loss and label count equal the
    documents' own, one by one."""
    import json

    records = [{"text": r["output"] + " " + r["instruction"]} for r in json.load(open(os.path.join(ROOT, "data.json")))[:6]]
    path = tmp_path / "text.json"
    path.write_text(json.dumps(records))
    docs = build_dataset(str(path), tokenizer, 1024)[0]
    assert all(d["labels"][0] != IGNORE_INDEX for d in docs)  # the format whose first label is a real token
    packed = pack_dataset(docs, 1024, seed=0)
    assert len(packed) == 1 and len(packed[0]["samples"]) == 6
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        alone = [per_token_losses(model, collate([docs[i]], tokenizer.pad_token_id, "cpu")) for i in packed[0]["samples"]]
        loss, mask = per_token_losses(model, collate([packed[0]], tokenizer.pad_token_id, "cpu", 1024))
    assert int(mask.sum()) == sum(int(m.sum()) for _, m in alone) == packed[0]["num_label_tokens"]
    torch.testing.assert_close(loss[mask].sum(), sum(l[m].sum() for l, m in alone), rtol=1e-5, atol=1e-5)
