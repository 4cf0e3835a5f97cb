"""A micro-batch's own bookkeeping makes no host sync on a GPU: the collate's copies (pinned, non-blocking) and the
step's sums (Python numbers kept on the host until the all_reduce). Each had emptied the GPU's queue at every
micro-batch (bench/profile_steps.py --phases --sync_debug, one H200, 2026-11-24). Nor does the step after its sums:
the clip, adamw_bf16's step with the clip folded in, and the step's record."""

import torch

from .launch import free_port, gpus

pytestmark = gpus(1)


def _packed_rows(n: int, length: int) -> list[dict]:
    rows = []
    for i in range(n):
        ids = list(range(1, length - 5))
        rows.append({"input_ids": ids, "labels": ids, "position_ids": list(range(length // 2)) + list(range(len(ids) - length // 2))})
    return rows


def test_collate_and_step_sums_make_no_host_sync():
    from megablocks_utils.data.batches import collate
    from megablocks_utils.train.run_log import StepSums

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rows = _packed_rows(2, 64)
    collate(rows, 0, device, 64, "sdpa")  # first use: the pinned-memory allocator's setup is not a step's work
    sums = StepSums(device)
    busy = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            busy = busy @ busy / 64  # work queued ahead: a sync would wait for it
            batch = collate(rows, 0, device, 64, "sdpa")
            sums.add(ce_sum=batch["labels"].float().sum(), aux=torch.zeros((), device=device), tokens=batch["real"].sum(),
                     token_slots=batch["input_ids"].numel(), attention_sq=batch["attention_sq"],
                     nonfinite=torch.zeros((), dtype=torch.bool, device=device))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    sums.all_reduce()  # the Python numbers join the device sums here: 3 micro-batches of 2 x 64 positions
    assert sums.token_slots == 3 * 2 * 64


def test_the_step_after_the_sums_makes_no_host_sync():
    """From the gradient norm to the step's record, only the sums' all_reduce reads the GPU (the stop-or-skip decision
    needs it): the norm and the clip's coefficient stay on the device, adamw_bf16 applies the coefficient in its kernel,
    and the record reads what that all_reduce copied (the norm, the expert counts). train_fsdp2.py makes no
    other (its step timing reads the host clock at this check: train/step_clock.py)."""
    from megablocks_utils.parallel.grads import grad_norm_and_clip_coef
    from megablocks_utils.train.adamw_bf16 import AdamWBF16
    from megablocks_utils.train.optim import clipped_step
    from megablocks_utils.train.run_log import MetricsLog, StepSums

    class Config:
        num_hidden_layers, hidden_size = 2, 64

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    params = [torch.nn.Parameter(torch.randn(s, device=device).bfloat16()) for s in ((1024, 256), (256,))]
    opt = AdamWBF16(params, lr=1e-3)
    log = MetricsLog(None, aux_coef=0.0, world_size=1, n_active=1000, config=Config(), peak_flops=1e15, device=device)
    busy = torch.randn(4096, 4096, device=device)
    for step in range(3):  # the first: the kernel's compile and the moments' allocation, outside the check
        for p in params:
            p.grad = torch.randn_like(p)
        sums = StepSums(device)
        sums.add(ce_sum=torch.tensor(5.0, device=device), aux=torch.zeros((), device=device), tokens=8, token_slots=8,
                 attention_sq=64.0, nonfinite=torch.zeros((), dtype=torch.bool, device=device),
                 tokens_per_expert=torch.ones(2, 4, dtype=torch.float64, device=device))
        checked = step > 0
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            busy = busy @ busy / 64  # work queued ahead: a sync would wait for it
            norm, coef = grad_norm_and_clip_coef(params, 1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        sums.all_reduce(grad_norm=norm)  # the one read, before the optimizer step
        if checked:
            torch.cuda.set_sync_debug_mode("error")
        try:
            busy = busy @ busy / 64
            clipped_step(opt, coef)
            opt.zero_grad(set_to_none=True)
            record = log.record(step + 1, sums, label_tokens=8.0, lr=1e-3, grad_norm=sums.grad_norm, skipped=False, step_time=1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert record["tokens_per_expert"] == [[1, 1, 1, 1], [1, 1, 1, 1]] and record["grad_norm"] == sums.grad_norm
