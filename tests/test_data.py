"""Alpaca formatting, prompt masking and batching."""

import json
import os

import pytest
from conftest import ROOT
from transformers import AutoTokenizer

from megablocks_utils.data import (
    PROMPT_NO_INPUT,
    DataError,
    GlobalBatches,
    build_dataset,
    format_prompt,
    read_alpaca,
    tokenize_record,
)
from megablocks_utils.loss import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("record", [
    {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "2 + 3 = 5."},
    {"instruction": "Which day comes after Monday?", "input": "", "output": "Tuesday comes after Monday."},
])
def test_labels_mask_exactly_the_prompt(tokenizer, record):
    sample = tokenize_record(record, tokenizer, max_length=512)
    ids, labels = sample["input_ids"], sample["labels"]
    prompt_len = 1 + len(tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"])
    assert labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert IGNORE_INDEX not in labels[prompt_len:]
    assert labels[prompt_len:] == ids[prompt_len:]
    assert tokenizer.decode(ids[prompt_len:-1]) == record["output"]
    assert ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(ids[1:prompt_len]) == format_prompt(record)
    if not record["input"]:
        assert format_prompt(record) == PROMPT_NO_INPUT.format(instruction=record["instruction"])


def test_truncation_keeps_labels_aligned(tokenizer):
    record = {"instruction": "Say something long.", "input": "", "output": "word " * 200}
    sample = tokenize_record(record, tokenizer, max_length=64)
    assert len(sample["input_ids"]) == len(sample["labels"]) == 64


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"instruction": "x"}', "holds an object, not a list"),
    ('[{"instruction": "x"}]', "record 0 has no 'output' field"),
    ('[{"instruction": "x", "output": 3}]', "record 0 field 'output' is a number, not a string"),
    ("[]", "holds no records"),
])
def test_bad_data_files_are_named(tmp_path, content, message):
    path = tmp_path / "data.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_alpaca(str(path))


def test_all_samples_too_long_is_an_error(tmp_path, tokenizer):
    path = tmp_path / "data.json"
    path.write_text(json.dumps([{"instruction": "Explain the sky.", "input": "", "output": "Blue."}]))
    with pytest.raises(DataError, match="raise max_length"):
        build_dataset(str(path), tokenizer, max_length=8)


def test_fewer_samples_than_one_step_is_an_error():
    with pytest.raises(DataError, match=r"the dataset has 3 samples but one optimizer step needs micro_batch 2 x "
                       r"grad_accum 2 x 2 ranks = 8; lower per_device_train_batch_size"):
        GlobalBatches([{}] * 3, 2, 2, 2, 0, seed=1)


def test_global_batch_does_not_depend_on_world_size(tiny_model_dir, tokenizer):
    dataset, _ = build_dataset(os.path.join(ROOT, "data.json"), tokenizer, 256)
    one = GlobalBatches(dataset, 4, 2, 1, 0, seed=1)
    two = [GlobalBatches(dataset, 2, 2, 2, r, seed=1) for r in range(2)]
    for step in (0, 1, one.steps_per_epoch + 1):
        mine, tokens = one.micro_batches(step)
        parts = [b.micro_batches(step) for b in two]
        assert all(t == tokens for _, t in parts)
        for m in range(2):
            assert sorted(mine[m]) == sorted(parts[0][0][m] + parts[1][0][m])
