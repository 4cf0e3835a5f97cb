"""Alpaca formatting, prompt masking and batching."""

import copy
import json
import os

import pytest
from conftest import ROOT

from megablocks_utils.data.batches import GlobalBatches
from megablocks_utils.data.records import (
    PROMPT_NO_INPUT,
    build_dataset,
    format_prompt,
    read_alpaca,
    read_records,
    split_eval,
    tokenize_chat,
    tokenize_prompt_completion,
    tokenize_record,
    tokenize_text,
)
from megablocks_utils.errors import DataError
from megablocks_utils.train.loss import IGNORE_INDEX


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


def test_a_sample_without_labels_among_good_ones_is_dropped_alone(tmp_path, tokenizer):
    """A record whose answer lies wholly past max_length (its prompt fills the row) trains nothing: it is dropped and
    counted, and the others are kept in order, each as it tokenizes alone."""
    good = [{"instruction": "Name a color.", "input": "", "output": "Blue."},
            {"instruction": "Say hi.", "input": "", "output": "Hi there."}]
    long = {"instruction": "Explain " + "the sky and the sea " * 40, "input": "", "output": "Because."}
    path = tmp_path / "data.json"
    path.write_text(json.dumps([good[0], long, good[1]]))
    dataset, dropped, _ = build_dataset(str(path), tokenizer, max_length=48)
    assert dropped == 1 and len(dataset) == 2
    assert [r["input_ids"] for r in dataset] == [tokenize_record(r, tokenizer, 48)["input_ids"] for r in good]
    assert tokenize_record(long, tokenizer, 48)["num_label_tokens"] == 0 and all(r["num_label_tokens"] > 0 for r in dataset)


def test_fewer_samples_than_one_step_is_an_error():
    with pytest.raises(DataError, match=r"the dataset has 3 samples but one optimizer step needs micro_batch 2 x "
                       r"grad_accum 2 x 2 ranks = 8; lower per_device_train_batch_size"):
        GlobalBatches([{}] * 3, 2, 2, 2, 0, seed=1)


def test_global_batch_does_not_depend_on_world_size(tiny_model_dir, tokenizer):
    dataset = build_dataset(os.path.join(ROOT, "data.json"), tokenizer, 256)[0]
    one = GlobalBatches(dataset, 4, 2, 1, 0, seed=1)
    two = [GlobalBatches(dataset, 2, 2, 2, r, seed=1) for r in range(2)]
    for step in (0, 1, one.steps_per_epoch + 1):
        mine, tokens = one.micro_batches(step)
        parts = [b.micro_batches(step) for b in two]
        assert all(t == tokens for _, t in parts)
        for m in range(2):
            assert sorted(mine[m]) == sorted(parts[0][0][m] + parts[1][0][m])


# ----------------------------------------------------------------------------- formats and file kinds
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                     {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
                     {"role": "assistant", "content": "Six."}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("record, fmt", [
    ({"instruction": "a", "output": "b"}, "alpaca"),
    (CHAT, "chat"),
    ({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, "prompt_completion"),
    ({"text": "Plain text to learn."}, "text"),
])
def test_format_is_detected_from_the_records(tmp_path, record, fmt):
    assert read_records(write_jsonl(tmp_path / "d.jsonl", [record, record]))[1] == fmt


def test_chat_labels_are_the_assistant_turns_only(tokenizer):
    sample = tokenize_chat(CHAT, tokenizer, 512)
    trained = tokenizer.decode([t for t in sample["labels"] if t != IGNORE_INDEX])
    assert trained == "It is 4.<|im_end|></s>\nSix.<|im_end|></s>\n"
    assert sample["labels"][0] == IGNORE_INDEX and "What is 2+2?" not in trained


def test_chat_without_generation_markers_locates_the_same_turns(tokenizer):
    """Templates without {% generation %} (Mixtral's own) go through the prefix rendering: same labels."""
    marked = tokenize_chat(CHAT, tokenizer, 512)
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = tokenizer.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    assert tokenize_chat(CHAT, plain, 512) == marked


def test_prompt_completion_and_text_masks(tokenizer):
    pc = tokenize_prompt_completion({"prompt": "Q: 2+2?\nA:", "completion": " 4"}, tokenizer, 512)
    assert tokenizer.decode([t for t in pc["labels"] if t != IGNORE_INDEX]) == " 4</s>"
    text = tokenize_text({"text": "Plain text."}, tokenizer, 512)
    assert text["labels"][1:] == text["input_ids"][1:] and text["input_ids"][-1] == tokenizer.eos_token_id


def test_chat_data_needs_a_chat_template(tmp_path, tokenizer):
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        build_dataset(write_jsonl(tmp_path / "c.jsonl", [CHAT]), plain, 256, source="my-model")


def test_an_unknown_chat_role_names_the_record_and_the_role(tmp_path, tokenizer):
    """A typo in a role stops the run (it used to train silently); system, user, assistant, tool and the roles the
    template itself names load."""
    tool = {"messages": [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "Sunny."},
                         {"role": "assistant", "content": "It is sunny."}]}
    bot = {"messages": [{"role": "bot", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]}
    assert len(build_dataset(write_jsonl(tmp_path / "ok.jsonl", [CHAT, tool]), tokenizer, 256)[0]) == 2
    with pytest.raises(DataError, match=r"bad\.jsonl: record 2 message 0 has role 'bot'; roles are system, user, "
                       r"assistant, tool, or one the chat template of my-model names; fix the record"):
        build_dataset(write_jsonl(tmp_path / "bad.jsonl", [CHAT, tool, bot]), tokenizer, 256, source="my-model")

    own = copy.deepcopy(tokenizer)  # a template with a role of its own, as Llama 3.1's 'ipython'
    own.chat_template = tokenizer.chat_template.replace("{% else %}", "{% elif message['role'] == 'ipython' %}"
                                                        "{{ message['content'] }}<|im_end|>\n{% else %}")
    ipython = {"messages": [{"role": "ipython", "content": "42"}, {"role": "assistant", "content": "42."}]}
    assert len(build_dataset(write_jsonl(tmp_path / "own.jsonl", [ipython]), own, 256)[0]) == 1
    typo = {"messages": [{"role": "User", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]}
    with pytest.raises(DataError, match=r"record 0 message 0 has role 'User' \(did you mean 'user'\?\)"):
        build_dataset(write_jsonl(tmp_path / "typo.jsonl", [typo]), own, 256)


def test_json_jsonl_parquet_and_save_to_disk_give_the_same_samples(tmp_path, tokenizer):
    from datasets import Dataset, DatasetDict

    records = [{"prompt": f"Q{i}:", "completion": f" answer {i}"} for i in range(6)]
    (tmp_path / "d.json").write_text(json.dumps(records))
    write_jsonl(tmp_path / "d.jsonl", records)
    Dataset.from_list(records).to_parquet(str(tmp_path / "d.parquet"))
    Dataset.from_list(records).save_to_disk(str(tmp_path / "saved"))
    DatasetDict({"train": Dataset.from_list(records)}).save_to_disk(str(tmp_path / "dict"))
    paths = ["d.json", "d.jsonl", "d.parquet", "saved", "dict"]
    got = [build_dataset(str(tmp_path / p), tokenizer, 64)[0]["input_ids"] for p in paths]
    assert all(g == got[0] for g in got) and len(got[0]) == 6


@pytest.mark.parametrize("content, message", [
    ('[{"messages": []}]', "record 0 field 'messages' is a list, not a non-empty list"),
    ('[{"messages": [{"role": "user", "content": "hi"}]}]', "record 0 has no assistant message"),
    ('[{"messages": [{"role": "user"}]}]', "record 0 message 0 is not an object with string 'role' and 'content'"),
    ('[{"prompt": "a", "completion": "b"}, {"prompt": "c"}]', "record 1 has no 'completion' field"),
    ('[{"text": 5}]', "record 0 field 'text' is a number, not a string"),
    ('[{"question": "a"}]', "record 0 has none of the fields of a known format"),
    ('{"text": "a"}\n{"text": "b"}\n{"text": \n', "line 3 is not valid JSON"),
])
def test_bad_records_of_every_format_are_named(tmp_path, content, message):
    path = tmp_path / "data.json"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_records(str(path))


def test_a_datasetdict_without_train_split_is_named(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict({"test": Dataset.from_list([{"text": "a"}])}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match="without a 'train' split"):
        read_records(str(tmp_path / "dict"))


def test_eval_split_is_fixed_and_disjoint():
    records = [{"text": str(i)} for i in range(50)]
    train, held = split_eval(records, 0.1, seed=3)
    assert len(held) == 5 and len(train) == 45 and not {r["text"] for r in held} & {r["text"] for r in train}
    assert split_eval(records, 0.1, seed=3) == (train, held)
    with pytest.raises(DataError, match="leaves no training records"):
        split_eval(records[:2], 0.9, seed=3)


def test_a_data_file_is_read_once_per_process_until_it_changes(tmp_path, monkeypatch):
    """The scripts check the data before anything heavy and read it again to tokenize: the second read of an
    unchanged file (or directory) is the first one's, for train and eval data alike; a changed file is read anew."""
    import time

    import megablocks_utils.data.records as data

    loads = []
    real_json, real_datasets = data._load_json, data._load_with_datasets
    monkeypatch.setattr(data, "_load_json", lambda path: loads.append(path) or real_json(path))
    monkeypatch.setattr(data, "_load_with_datasets", lambda path: loads.append(path) or real_datasets(path))
    train, held = tmp_path / "train.json", tmp_path / "eval.jsonl"
    train.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}]))
    held.write_text(json.dumps({"text": "c"}) + "\n")
    for _ in range(2):  # check, then load: train and eval each
        assert data.read_records(str(train)) == ([{"instruction": "a", "input": "", "output": "b"}], "alpaca")
        assert data.read_records(str(held)) == ([{"text": "c"}], "text")
    assert loads == [str(train), str(held)]
    time.sleep(0.01)
    train.write_text(json.dumps([{"prompt": "p", "completion": "q"}]))
    assert data.read_records(str(train)) == ([{"prompt": "p", "completion": "q"}], "prompt_completion")
    assert loads == [str(train), str(held), str(train)]
