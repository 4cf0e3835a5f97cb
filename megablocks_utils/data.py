"""Alpaca data: validate, format with the standard prompt, tokenize with the prompt masked, batch by rank.

Every rank sees the same shuffled order; global micro-batch i is samples [i*B*W, (i+1)*B*W) of it
and rank r takes its r-th block of B. So the global batch of a step does not depend on how many
ranks share it, which is what lets a 2-rank run be compared with a 1-rank run exactly.
"""

import json
import os

import torch

from .inputs import InputError
from .loss import IGNORE_INDEX

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


class DataError(InputError):
    """A problem with the data file, stated with what to do about it."""


def _json_kind(value) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if value is None:
        return "null"
    kinds = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return kinds.get(type(value), type(value).__name__)


def read_alpaca(path: str) -> list[dict]:
    """Read and check an alpaca JSON file: a list of {instruction, input?, output} string records."""
    if not os.path.isfile(path):
        problem = "is a directory" if os.path.isdir(path) else "does not exist"
        raise DataError(f"data file {path!r} {problem}; set data_path to an alpaca-format JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            records = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON ({e}); it must be a JSON list of alpaca records") from e
    if not isinstance(records, list):
        raise DataError(f"{path} holds {_json_kind(records)}, not a list; wrap the records in [ ... ]")
    for i, record in enumerate(records):
        if not isinstance(record, dict):
            raise DataError(f"{path}: record {i} is {_json_kind(record)}, not an object with instruction and output")
        for key in ("instruction", "output"):
            if key not in record:
                raise DataError(f"{path}: record {i} has no {key!r} field; every record needs instruction and output")
        for key in ("instruction", "input", "output"):
            if key in record and not isinstance(record[key], str):
                raise DataError(
                    f"{path}: record {i} field {key!r} is {_json_kind(record[key])}, not a string; fix the record"
                )
    if not records:
        raise DataError(f"{path} holds no records; add alpaca records to train on")
    return records


def format_prompt(record: dict) -> str:
    template = PROMPT_WITH_INPUT if record.get("input") else PROMPT_NO_INPUT
    return template.format(instruction=record["instruction"], input=record.get("input", ""))


def tokenize_record(record: dict, tokenizer, max_length: int) -> dict:
    """input_ids = <bos> prompt response <eos>; labels are -100 on <bos> and the prompt.

    Prompt and response are tokenized separately so the boundary between them is exact.
    """
    prompt = tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]
    response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    input_ids = (bos + prompt + response)[:max_length]
    labels = ([IGNORE_INDEX] * (len(bos) + len(prompt)) + response)[:max_length]
    return {"input_ids": input_ids, "labels": labels, "num_label_tokens": sum(x != IGNORE_INDEX for x in labels[1:])}


def build_dataset(path: str, tokenizer, max_length: int):
    """Tokenized ``datasets.Dataset``; samples whose response is truncated away entirely are dropped."""
    from datasets import Dataset, disable_progress_bars

    disable_progress_bars()  # a few hundred samples tokenize in a blink; the bars only clutter the log
    records = read_alpaca(path)
    dataset = Dataset.from_list(
        [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in records]
    )
    dataset = dataset.map(lambda r: tokenize_record(r, tokenizer, max_length), remove_columns=dataset.column_names)
    kept = dataset.filter(lambda r: r["num_label_tokens"] > 0)
    if len(kept) == 0:
        shortest_prompt = min(len(tokenizer(format_prompt(r), add_special_tokens=False)["input_ids"]) for r in records)
        raise DataError(
            f"every sample of {path} is longer than max_length={max_length} before its response starts "
            f"(shortest prompt: {shortest_prompt} tokens); raise max_length"
        )
    return kept, len(dataset) - len(kept)


class GlobalBatches:
    """Which samples each rank gets for each micro-step: deterministic, seed- and epoch-dependent."""

    def __init__(self, dataset, micro_batch: int, grad_accum: int, world_size: int, rank: int, seed: int):
        self.dataset = dataset
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.per_step = micro_batch * grad_accum * world_size
        if len(dataset) < self.per_step:
            raise DataError(
                f"the dataset has {len(dataset)} samples but one optimizer step needs "
                f"micro_batch {micro_batch} x grad_accum {grad_accum} x {world_size} ranks = {self.per_step}; "
                "lower per_device_train_batch_size or gradient_accumulation_steps, or add data"
            )
        self.steps_per_epoch = len(dataset) // self.per_step

    def step_indices(self, step: int) -> list[int]:
        """Global sample indices of optimizer step ``step`` (0-based, counting across epochs)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(self.seed + epoch))
        return order[within * self.per_step : (within + 1) * self.per_step].tolist()

    def micro_batches(self, step: int) -> tuple[list[list[int]], int]:
        """This rank's sample indices for each micro-step of ``step``, and the step's global label-token count."""
        indices = self.step_indices(step)
        total_tokens = sum(self.dataset[indices]["num_label_tokens"])
        per_micro = self.micro_batch * self.world_size
        mine = []
        for m in range(self.grad_accum):
            chunk = indices[m * per_micro : (m + 1) * per_micro]
            mine.append(chunk[self.rank * self.micro_batch : (self.rank + 1) * self.micro_batch])
        return mine, total_tokens


def collate(samples: list[dict], pad_token_id: int, device) -> dict:
    """Right-pad to the longest sample; padding has attention_mask 0 and label -100."""
    length = max(len(s["input_ids"]) for s in samples)
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(samples), length), dtype=torch.long)
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = torch.tensor(s["input_ids"])
        labels[i, :n] = torch.tensor(s["labels"])
        mask[i, :n] = 1
    return {"input_ids": input_ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}


class RankBatchSampler:
    """This rank's micro-batches of one epoch in training order, as a DataLoader ``batch_sampler``.

    For HF Trainer, which iterates its DataLoader once per epoch and calls ``set_epoch``: epoch e
    yields the micro-batches of optimizer steps [e * steps_per_epoch, (e + 1) * steps_per_epoch), the
    same samples ``GlobalBatches.micro_batches`` gives the plain training loop at those steps.
    """

    def __init__(self, batches: GlobalBatches):
        self.batches = batches
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.batches.steps_per_epoch * self.batches.grad_accum

    def __iter__(self):
        first = self.epoch * self.batches.steps_per_epoch
        for step in range(first, first + self.batches.steps_per_epoch):
            yield from self.batches.micro_batches(step)[0]
