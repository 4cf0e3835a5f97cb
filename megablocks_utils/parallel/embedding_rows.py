"""The input embedding's gradient averaged over the rows that a step's tokens touched on some rank, not over every row.

Why: with the dense weights whole on every rank (``fsdp_wrap`` "none") and whole micro-steps as CUDA graphs, their
gradients are all-reduced once a step after the graphs, with nothing beside it: 15 ms of a 404 ms step at ep 4 on
4 x H200 (Qwen3-30B-A3B's shape, 12 layers; BENCHMARKS.md, "Several GPUs"). The embedding table is 37% of those bytes
(151,936 rows x 2048), but a row's gradient is non-zero only where some token of the step reads it: at most world x
tokens per rank rows (65,536 there), fewer in real text. Each rank marks the token ids it fed (``add``), the ranks take
the union (one all-reduce of a byte per vocabulary row), and only those rows travel: the same fp32 sums (a row no rank
touched is zero on every rank), at fixed shapes with no host sync (``torch.nonzero_static``: the union padded with
copies of row 0, each written back with the same value).

Not for a table tied to the output projection (lm_head's gradient fills every row), nor where the union could cover
half of the table (no bytes to save).
"""

import torch
import torch.distributed as dist
from torch import nn


class TouchedRows:
    """The rows of ``embedding`` that a step's input ids touched on this rank, and the average of its gradient over
    them (``average``). A step marks at most ``micro_steps`` different micro-batches of at most ``tokens_per_micro_step``
    ids on each of ``world_size`` ranks: the union's bound, which fixes its shape."""

    def __init__(self, embedding: nn.Parameter, tokens_per_micro_step: int, micro_steps: int, world_size: int):
        self.weight = embedding
        self.tokens_per_micro_step = tokens_per_micro_step
        self.capacity = min(world_size * micro_steps * tokens_per_micro_step, embedding.shape[0])
        self.marks = torch.zeros(embedding.shape[0], dtype=torch.uint8, device=embedding.device)

    @classmethod
    def for_model(cls, model: nn.Module, tokens_per_micro_step: int, micro_steps: int,
                  world_size: int) -> "TouchedRows | None":
        """For ``model``'s input embedding, or None where it would not be right or pay: one rank, a frozen table, one
        tied to the output projection, or steps whose tokens could touch half of the table."""
        embedding = model.get_input_embeddings().weight
        output = model.get_output_embeddings()
        if world_size == 1 or not embedding.requires_grad or (output is not None and output.weight is embedding):
            return None
        rows = cls(embedding, tokens_per_micro_step, micro_steps, world_size)
        return rows if 2 * rows.capacity <= embedding.shape[0] else None

    def add(self, input_ids: torch.Tensor) -> None:
        """Mark the rows ``input_ids`` read: each micro-batch of the step (one run again repeats its ids), before
        ``average``."""
        if input_ids.numel() > self.tokens_per_micro_step:
            raise ValueError(f"a micro-batch of {input_ids.numel()} ids; TouchedRows was sized for "
                             f"{self.tokens_per_micro_step} (per_device_train_batch_size x max_length)")
        self.marks.index_fill_(0, input_ids.reshape(-1).to(self.marks.device), 1)

    def average(self, group: dist.ProcessGroup, world_size: int) -> None:
        """Collective: the embedding's gradient summed over ``group`` in fp32 on the rows any rank marked, divided by
        ``world_size``, written back; the marks cleared for the next step."""
        grad = self.weight.grad
        if grad is None:  # no micro-step this step (the same on every rank)
            self.marks.zero_()
            return
        dist.all_reduce(self.marks, op=dist.ReduceOp.MAX, group=group)
        rows = torch.nonzero_static(self.marks, size=self.capacity, fill_value=0).squeeze(1)
        part = grad.index_select(0, rows).float()
        dist.all_reduce(part, group=group)
        part.div_(world_size)
        grad.index_copy_(0, rows, part.to(grad.dtype))
        self.marks.zero_()
