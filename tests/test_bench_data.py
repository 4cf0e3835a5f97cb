"""bench/bench_fsdp1.py's synthetic data: every sample fills max_length exactly (no padding), nearly all labels."""

import json
import os
import sys

from conftest import ROOT
from transformers import AutoTokenizer

from megablocks_utils.data.batches import collate
from megablocks_utils.data.records import build_dataset

sys.path.insert(0, os.path.join(ROOT, "bench"))
from bench_fsdp1 import synthetic_alpaca  # noqa: E402


def test_synthetic_samples_are_exactly_seq_tokens_after_truncation(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seq = 512
    records = synthetic_alpaca(tokenizer, seq, 6, os.path.join(ROOT, "data.json"))
    (tmp_path / "data.json").write_text(json.dumps(records))
    dataset, dropped, _ = build_dataset(str(tmp_path / "data.json"), tokenizer, seq)  # what train_fsdp1.py does
    assert dropped == 0 and len(dataset) == 6
    assert len({tuple(s["input_ids"]) for s in dataset}) == 6  # distinct samples
    batch = collate([dataset[i] for i in range(6)], tokenizer.pad_token_id, "cpu")
    assert batch["input_ids"].shape == (6, seq) and bool(batch["attention_mask"].all())  # no padding
    assert all(seq - 64 < s["num_label_tokens"] < seq for s in dataset)  # the prompt is short, the response is cut
