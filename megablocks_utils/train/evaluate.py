"""Eval loss: the mean next-token loss over an eval set's label tokens, on the sharded training model.

Every rank runs the same number of forward passes (the expert all-to-alls need all of them): the
rows are dealt out round by round, and a rank short of rows in the last round fills its micro-batch with
copies of row 0 with every label ignored, so every forward has the training rows' shape (no recompile).
The rows go through the same collator and attention kernel as training. Nothing is gathered; two sums
are all-reduced at the end.
"""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from megablocks_utils.data.batches import collate
from megablocks_utils.moe.aux_loss import router_stats
from megablocks_utils.moe.exchange_mode import run_exactly
from megablocks_utils.train.loss import IGNORE_INDEX, forward_with_loss


@torch.no_grad()
def eval_loss(model, dataset, micro_batch: int, pad_token_id: int, device, group, length: int | None = None,
              attention: str = "sdpa") -> float:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    per_round = micro_batch * world
    sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, label tokens
    was_training = model.training
    model.eval()
    for start in range(0, len(dataset), per_round):
        mine = list(range(start + rank * micro_batch, min(start + (rank + 1) * micro_batch, len(dataset))))
        filler = {**dataset[0], "labels": [IGNORE_INDEX] * len(dataset[0]["labels"])}
        samples = [dataset[i] for i in mine] + [filler] * (micro_batch - len(mine))
        batch = collate(samples, pad_token_id, device, length, attention)
        labels = batch["labels"]

        def forward():  # router_stats drops the routing the forward recorded (no loss uses it)
            loss_sum, _ = forward_with_loss(model, batch["model_inputs"], labels)
            router_stats(model, batch["real"], None)
            return loss_sum

        loss_sum, _ = run_exactly(model, forward, group, device)  # an overflowed static exchange rerun exactly
        sums += torch.stack([loss_sum.double(), (labels[:, 1:] != IGNORE_INDEX).sum().double()])
    dist.all_reduce(sums, group=group)
    if isinstance(model, FSDPModule):
        # A unit kept gathered through its forward (fsdp_wrap "model") reshards in its backward; a no-grad forward has
        # none, and in-place edits after it (LoRA's merge) would go to the gathered copy and be lost.
        model.reshard()
    model.train(was_training)
    return float(sums[0] / sums[1])
