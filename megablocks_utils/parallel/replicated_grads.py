"""The gradients of dense weights every rank holds whole (``fsdp_wrap`` "none"), averaged over the ranks while the last
micro-step's backward still runs.

Averaged after the backward (``grads.average_replicated_grads``), the all-reduce of ~0.85 B dense gradients is exposed:
at ep 2 on 2 x H200 that made ``fsdp_wrap none`` 15% slower than FSDP, whose reduce-scatter runs inside the backward
(bench/reports/ep_levers_h200_2026-11-27e.md). Here each gradient, once autograd has added the last micro-step's part
into it (``Tensor.register_post_accumulate_grad_hook``), marks its bucket ready; a ready bucket is summed in fp32 (as
FSDP reduces) by an asynchronous all-reduce at once, beside the backward of the layers below it. Buckets are launched
strictly in their order (the parameters' reverse order, about the order their gradients appear), so every rank issues
the same collectives in the same order whatever its timing. ``finish`` waits for them, divides by the world size and
writes the results back into the gradients.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

# Elements per bucket: small enough that the last buckets (the embedding's, ~0.3 B at Qwen3's vocabulary, is one of its
# own) leave little to wait for after the backward, large enough for NCCL's bandwidth (64 MB in fp32).
OVERLAP_BUCKET = 1 << 24


class ReplicatedGradSync:
    """Average the gradients of ``params`` (plain tensors every rank holds whole) over ``group`` during the backward.

    Before each micro-step's backward the script calls ``arm(last)``: only the last micro-step's hooks launch collectives
    (gradients add up over micro-steps first). After the micro-steps, ``finish()``. Not for backwards captured in a CUDA
    graph (a hook there would launch its collective into the graph): ``MicroStepGraphs`` runs average afterwards."""

    def __init__(self, params, group: dist.ProcessGroup, bucket_elements: int = OVERLAP_BUCKET):
        self.group = group
        self.world_size = dist.get_world_size(group)
        params = [p for p in params if p.requires_grad and not isinstance(p, DTensor)]
        self.buckets: list[list[nn.Parameter]] = []
        size = 0
        for p in reversed(params):  # the backward meets the last layers first
            if not self.buckets or size + p.numel() > bucket_elements:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel()
        self.bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self.armed = False
        self._reset()
        if self.world_size > 1:
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

    def _reset(self) -> None:
        self.waiting = [len(bucket) for bucket in self.buckets]
        self.next = 0  # the next bucket to launch: launches go in bucket order only
        self.launched: list[tuple[list[torch.Tensor], torch.Tensor, object]] = []

    def arm(self, last_micro_step: bool) -> None:
        """Before a micro-step's backward: whether its gradients are the step's last part (then they are reduced)."""
        self.armed = last_micro_step and self.world_size > 1

    def _ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        b = self.bucket_of[id(param)]
        self.waiting[b] -= 1
        while self.next < len(self.buckets) and self.waiting[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def _launch(self, b: int) -> None:
        grads = [p.grad for p in self.buckets[b] if p.grad is not None]
        if not grads:
            self.launched.append(([], None, None))
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).float()  # one copy into the bucket, one cast
        self.launched.append((grads, flat, dist.all_reduce(flat, group=self.group, async_op=True)))

    def finish(self) -> None:
        """After the micro-steps: launch what the hooks did not (a weight without a gradient this step), wait for every
        bucket, and write the averages back into the gradients."""
        if self.world_size == 1:
            return
        while self.next < len(self.buckets):
            self._launch(self.next)
            self.next += 1
        for grads, flat, work in self.launched:
            if work is None:
                continue
            work.wait()  # on a GPU the current stream waits for the collective; the host does not
            flat.div_(self.world_size)
            for g, part in zip(grads, torch.split(flat, [g.numel() for g in grads])):
                g.copy_(part.view_as(g))
        self.armed = False
        self._reset()
