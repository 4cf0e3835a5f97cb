"""A micro-batch's own bookkeeping makes no host sync on a GPU: the collate's copies (pinned, non-blocking) and the
step's sums (Python numbers kept on the host until the all_reduce). Each had emptied the GPU's queue at every
micro-batch (bench/profile_steps.py --phases --sync_debug, one H200, 2026-11-24)."""

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
