"""Samples (or packed rows) to each rank's micro-batches, and a micro-batch to the model's inputs.

Every rank sees the same shuffled order; global micro-batch i is samples [i*B*W, (i+1)*B*W) of it
and rank r takes its r-th block of B. So the global batch of a step does not depend on how many
ranks share it, which is what lets a 2-rank run be compared with a 1-rank run exactly. With packing
(``packing.py``) a sample is a packed row of several records.
"""

from dataclasses import dataclass

import torch

from megablocks_utils.data.records import build_dataset, tokenize_records
from megablocks_utils.errors import DataError
from megablocks_utils.data.packing import varlen_inputs
from megablocks_utils.data.records import IGNORE_INDEX


@dataclass
class TrainingData:
    """What a run trains and evaluates on: ``train`` (packed rows, or samples) and ``eval`` (the same kind, or None)."""

    train: object
    eval: object
    samples: int  # training samples before packing
    dropped: int
    format: str
    packing: bool
    max_length: int

    @property
    def needs_mask(self) -> bool:
        """Whether any row, train or eval, holds more than one document or is shorter than max_length (padded).

        Row by row, stopping at the first that does: real data answers at its first row, without reading whole
        columns into Python; only rows that are all full single documents (synthetic data) are read to the end."""
        for rows in (self.train, self.eval):
            for row in rows if rows is not None else ():
                if len(row["input_ids"]) < self.max_length or (self.packing and len(row["samples"]) > 1):
                    return True
        return False

    def describe(self, per_step: int) -> str:
        unit = "rows" if self.packing else "samples"
        text = f"{self.samples} {self.format} samples ({self.dropped} dropped: no label within max_length)"
        if self.packing:
            text += f" packed into {len(self.train)} rows of {self.max_length}"
        text += f"; {per_step} {unit} per step"
        return text + (f"; eval: {len(self.eval)} {unit}" if self.eval is not None else "")


def load_training_data(data_path: str, tokenizer, max_length: int, *, packing: bool, seed: int, eval_data_path: str = "",
                       eval_split: float = 0.0, source: str = "the model") -> TrainingData:
    """Both scripts' data: read, check, hold out the eval share (or read eval_data_path), tokenize, pack."""
    from megablocks_utils.data.packing import pack_dataset

    train, dropped, (held_out, fmt) = build_dataset(data_path, tokenizer, max_length, eval_split=eval_split, seed=seed, source=source)
    samples, evaluation = len(train), None
    if eval_data_path:
        evaluation = build_dataset(eval_data_path, tokenizer, max_length, source=source)[0]
    elif held_out:
        evaluation = tokenize_records(held_out, fmt, tokenizer, max_length, f"{data_path} (eval_split)")[0]
    if packing:  # the eval loss is the same packed or not; packed, it takes fewer forwards
        train = pack_dataset(train, max_length, seed)
        evaluation = pack_dataset(evaluation, max_length, seed) if evaluation is not None else None
    return TrainingData(train, evaluation, samples, dropped, fmt, packing, max_length)


class GlobalBatches:
    """Which samples each rank gets for each micro-step: deterministic, seed- and epoch-dependent."""

    def __init__(self, dataset, micro_batch: int, grad_accum: int, world_size: int, rank: int, seed: int, unit: str = "samples"):
        self.dataset = dataset
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.per_step = micro_batch * grad_accum * world_size
        if len(dataset) < self.per_step:
            raise DataError(
                f"the dataset has {len(dataset)} {unit} but one optimizer step needs "
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


def _copier(device):
    """Host tensor -> ``device``. To a GPU: through pinned memory, without waiting. A copy from pageable memory makes the
    host wait for all work queued on the GPU; at each micro-batch that emptied the queue, and the GPU then idled while
    the host launched the next forward (bench/profile_steps.py --phases). The pinned block is not reused before its
    copy is done (torch's pinned-memory allocator records the copy's stream)."""
    device = torch.device(device)
    if device.type != "cuda":
        return lambda t: t.to(device)
    return lambda t: t.pin_memory().to(device, non_blocking=True)


def collate(samples: list[dict], pad_token_id: int, device, length: int | None = None, attention: str = "sdpa",
            document_multiple: int = 1) -> dict:
    """One micro-batch as tensors, every row ``length`` tokens (the scripts pass max_length; None: the longest sample).

    A fixed row length is what keeps compiled modules from recompiling on data: the last rows of a packed
    dataset, or short unpacked samples, would otherwise give the compiled attention a new shape. What is left
    over at the end of a row is padding with no labels: in a packed row it is a document of its own (its
    positions restart at 0), in an unpacked one it is masked by the attention mask.

    ``model_inputs``: the keyword arguments of the model's forward. Packed rows carry per-document
    ``position_ids`` and no attention mask, so transformers keeps documents apart (a block mask for flex, a dense
    mask for sdpa/eager); for ``attention="varlen"`` they also carry the documents' cumulative lengths
    (``packing.varlen_inputs``), computed here, on the host, once per micro-batch, padded with empty documents to a
    multiple of ``document_multiple`` (CUDA graphs: one per document count, train/cuda_graph.py).
    ``real`` marks real tokens (for the router statistics and token counts). ``attention_sq``: the sum of squared
    attention spans (each document's length, packed; the padded length, unpacked), so that MFU counts the
    attention that was useful, not the row's length.
    """
    packed = "position_ids" in samples[0]
    longest = max(len(s["input_ids"]) for s in samples)
    if length is None:
        length = longest
    elif longest > length:
        raise ValueError(f"a row of {longest} tokens does not fit the collator's length {length}")
    input_ids = torch.full((len(samples), length), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    real = torch.zeros((len(samples), length), dtype=torch.long)
    positions = torch.arange(length).repeat(len(samples), 1)  # unpacked: one document, then the padding
    attention_sq = 0 if packed else len(samples) * length**2
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        input_ids[i, :n] = torch.tensor(s["input_ids"])
        labels[i, :n] = torch.tensor(s["labels"])
        real[i, :n] = 1
        if packed:
            positions[i, :n] = torch.tensor(s["position_ids"])
            starts = torch.cat([(positions[i, :n] == 0).nonzero().flatten(), torch.tensor([n])])
            attention_sq += int((starts.diff() ** 2).sum())
        positions[i, n:] = torch.arange(length - n)  # the padding after the last document is a document of its own
    if attention == "sdpa_causal" and not (bool(real.all()) and bool((positions == torch.arange(length)).all())):
        raise ValueError("attention 'sdpa_causal' masks nothing but the causal triangle: this micro-batch has padding or "
                         "several documents in a row; use 'sdpa', 'flex_attention' or 'varlen' (attn_implementation 'auto' "
                         "picks sdpa_causal only when every row is one whole document)")
    to_device = _copier(device)
    inputs = {
        "input_ids": to_device(input_ids),
        "attention_mask": None if packed else to_device(real),
        "position_ids": to_device(positions) if packed else None,
        "use_cache": False,  # with a cache, transformers would not keep packed documents apart
    }
    if attention == "varlen":
        boundaries = varlen_inputs(positions, document_multiple)
        cu = to_device(boundaries["cu_seq_lens_q"])
        # The number of documents changes from batch to batch: a dynamic size from the first compile on, not a
        # recompile for each new count (torch._dynamo.maybe_mark_dynamic is torch.compile's documented switch).
        torch._dynamo.maybe_mark_dynamic(cu, 0)
        inputs.update(cu_seq_lens_q=cu, max_length_q=boundaries["max_length_q"])
    return {
        **{k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids")},
        "model_inputs": inputs,
        "labels": to_device(labels),
        "real": to_device(real),
        "attention_sq": float(attention_sq),
    }


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
