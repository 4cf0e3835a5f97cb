"""The input embedding's gradient averaged over the rows the step's tokens touched (parallel/embedding_rows.py), on gloo
ranks: the same average as every row's (parallel/grads.average_replicated_grads without it), the other weights still
averaged whole, two steps in a row (the marks cleared between them); where it is not used: one rank, a frozen or tied
table, a union that could cover half of the table; a micro-batch larger than it was sized for is refused."""

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks
from torch import nn

from megablocks_utils.parallel.embedding_rows import TouchedRows
from megablocks_utils.parallel.grads import average_replicated_grads

VOCAB, WIDTH, MICRO_TOKENS, MICRO_STEPS = 256, 8, 12, 2


class Tiny(nn.Module):
    """An embedding and an untied output projection, as transformers' models expose them."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.head

    def forward(self, ids):
        return self.head(self.embed(ids)).float().logsumexp(-1).sum()


def check_touched_rows_average_as_every_row(rank, world_size, dtype):
    torch.manual_seed(0)
    model = Tiny().to(dtype)  # the same weights on every rank
    reference = Tiny().to(dtype)
    reference.load_state_dict(model.state_dict())
    touched = TouchedRows.for_model(model, MICRO_TOKENS, MICRO_STEPS, world_size)
    assert touched is not None and touched.capacity == world_size * MICRO_STEPS * MICRO_TOKENS
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        for net in (model, reference):
            net.zero_grad(set_to_none=False)
        for _ in range(MICRO_STEPS):
            # each rank its own ids; step 1 draws from another part of the table than step 0
            ids = torch.randint(step * 128, step * 128 + 100, (2, MICRO_TOKENS // 2), generator=g)
            touched.add(ids)
            model(ids).backward()
            reference(ids).backward()
        average_replicated_grads(model.parameters(), dist.group.WORLD, touched)
        average_replicated_grads(reference.parameters(), dist.group.WORLD)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if world_size == 2:
                assert torch.equal(p.grad, q.grad), (step, name, (p.grad.float() - q.grad.float()).abs().max())
            else:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=f"step {step}, {name}")
        assert not touched.marks.any()  # cleared for the next step


@pytest.mark.parametrize("world_size,dtype", [(2, torch.float32), (2, torch.bfloat16), (3, torch.float32)],
                         ids=["2-fp32", "2-bf16", "3-fp32"])
def test_touched_rows_average_as_every_row(world_size, dtype):
    """Each row's sum is the fp32 sum of the ranks' values in both ways (the untouched rows are zero on every rank):
    equal to the bit on 2 ranks (a sum of two is one rounding in any order), to fp32 rounding on 3 (gloo adds in an
    order that depends on where a value sits in the buffer, for the untouched weights too)."""
    run_ranks(check_touched_rows_average_as_every_row, world_size, dtype)


def test_where_it_is_not_used():
    assert TouchedRows.for_model(Tiny(), MICRO_TOKENS, MICRO_STEPS, 1) is None  # one rank: nothing to average
    assert TouchedRows.for_model(Tiny(tied=True), MICRO_TOKENS, MICRO_STEPS, 2) is None  # lm_head fills every row
    frozen = Tiny()
    frozen.embed.weight.requires_grad_(False)
    assert TouchedRows.for_model(frozen, MICRO_TOKENS, MICRO_STEPS, 2) is None
    assert TouchedRows.for_model(Tiny(), 64, MICRO_STEPS, 2) is None  # 256 ids could touch every row
    assert TouchedRows.for_model(Tiny(), 32, MICRO_STEPS, 2) is not None  # 128: half the table, the most it takes


def test_a_micro_batch_larger_than_sized_for_is_refused():
    touched = TouchedRows.for_model(Tiny(), MICRO_TOKENS, MICRO_STEPS, 2)
    with pytest.raises(ValueError, match="a micro-batch of 13 ids; TouchedRows was sized for 12"):
        touched.add(torch.zeros(13, dtype=torch.long))
