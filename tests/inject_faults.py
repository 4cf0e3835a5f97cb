"""Run a training script with faults injected at given steps, for the tests of what a run does when things go wrong.

    torchrun --nproc_per_node=2 tests/inject_faults.py --nan_grad_at 3 train_fsdp2.py --max_steps 4 ...
    accelerate launch ... tests/inject_faults.py --disk_full_at 2 train_fsdp1.py --accelerator_config ... ...

Each rank patches the library where the fault belongs, then runs the script as ``python SCRIPT ARGS`` would
(``runpy``, as ``__main__``): the scripts and the library hold no test hooks. Steps count from 1.

- ``--nan_loss_at 3,5``: the last rank's summed cross-entropy of every micro-batch of these steps becomes NaN
  (``StepLoss.micro_batch``); its gradients stay finite, so only the loss shows the fault.
- ``--nan_grad_at 3``: one gradient entry of the last rank becomes NaN right before the gradient norm
  (``grad_norm_and_clip_coef``, which ``clip_grad_norm_`` calls too).
- ``--disk_full_at 2``: the last rank's save of that step's checkpoint fails as on a full disk (ENOSPC): inside
  DCP's shard writes (train_fsdp2.py), after Trainer's own save (train_fsdp1.py).
- ``--kill_in_save_at 4``: rank 0 SIGKILLs itself after every rank wrote that step's checkpoint, before it is
  renamed from ``.tmp`` (train_fsdp2.py).
"""

import argparse
import errno
import os
import runpy
import signal
import sys
from unittest import mock


def steps(text: str) -> set[int]:
    return {int(s) for s in text.split(",") if s}


def last_rank() -> bool:
    import torch.distributed as dist

    return dist.get_rank() == dist.get_world_size() - 1


def nan_loss_at(bad_steps: set[int]) -> None:
    import megablocks_utils.train.step as step_module

    micro_batch, forward_with_loss = step_module.StepLoss.micro_batch, step_module.forward_with_loss

    def nan_loss_sum(model, model_inputs, labels):
        loss_sum, out = forward_with_loss(model, model_inputs, labels)
        return loss_sum + float("nan"), out

    def faulty_micro_batch(self, model, batch):
        if self.step in bad_steps and last_rank():
            with mock.patch.object(step_module, "forward_with_loss", nan_loss_sum):
                return micro_batch(self, model, batch)
        return micro_batch(self, model, batch)

    step_module.StepLoss.micro_batch = faulty_micro_batch


def nan_grad_at(bad_steps: set[int]) -> None:
    """The step is the newest StepLoss's: both scripts make it at the step's start, and take the norm after its backward."""
    from torch.distributed.tensor import DTensor

    import megablocks_utils.parallel.grads as grads
    import megablocks_utils.train.step as step_module

    current = {}
    init, norm = step_module.StepLoss.__init__, grads.grad_norm_and_clip_coef

    def tracked_init(self, step, *args, **kwargs):
        current["step"] = step
        init(self, step, *args, **kwargs)

    def faulty_norm(parameters, *args, **kwargs):
        parameters = list(parameters)
        if current.get("step") in bad_steps and last_rank():
            for p in parameters:
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                if local is not None and local.numel() > 0:
                    local[(0,) * local.dim()] = float("nan")
                    break
        return norm(parameters, *args, **kwargs)

    step_module.StepLoss.__init__ = tracked_init
    # train_fsdp2.py imports it by name after this; clip_grad_norm_ (train_fsdp1.py's) looks it up in grads at each call
    grads.grad_norm_and_clip_coef = faulty_norm


def full_disk_write(self, plan, planner):
    """DCP's ``FileSystemWriter.write_data`` on a full disk."""
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))


def disk_full_at(bad_step: int) -> None:
    import transformers
    from torch.distributed.checkpoint import FileSystemWriter

    import megablocks_utils.train.checkpoint as checkpoint

    save_checkpoint, trainer_save = checkpoint.save_checkpoint, transformers.Trainer._save_checkpoint

    def faulty_save_checkpoint(root, step, *args, **kwargs):
        if step == bad_step and last_rank():
            with mock.patch.object(FileSystemWriter, "write_data", full_disk_write):
                return save_checkpoint(root, step, *args, **kwargs)
        return save_checkpoint(root, step, *args, **kwargs)

    def faulty_trainer_save(self, model, trial):
        trainer_save(self, model, trial)
        if self.state.global_step == bad_step and last_rank():
            path = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)

    checkpoint.save_checkpoint = faulty_save_checkpoint
    transformers.Trainer._save_checkpoint = faulty_trainer_save


def kill_in_save_at(bad_step: int) -> None:
    import torch.distributed as dist

    import megablocks_utils.train.checkpoint as checkpoint

    save_checkpoint, replace = checkpoint.save_checkpoint, os.replace

    def faulty_save_checkpoint(root, step, *args, **kwargs):
        if step != bad_step or dist.get_rank() != 0:
            return save_checkpoint(root, step, *args, **kwargs)
        final = os.path.join(root, checkpoint.checkpoint_name(step))

        def kill_before_rename(src, dst):
            if dst == final:
                os.kill(os.getpid(), signal.SIGKILL)
            replace(src, dst)

        with mock.patch.object(os, "replace", kill_before_rename):  # save_checkpoint's rename of the finished .tmp
            return save_checkpoint(root, step, *args, **kwargs)

    checkpoint.save_checkpoint = faulty_save_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--nan_loss_at", type=steps, default=set())
    parser.add_argument("--nan_grad_at", type=steps, default=set())
    parser.add_argument("--disk_full_at", type=int)
    parser.add_argument("--kill_in_save_at", type=int)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    faults = parser.parse_args()
    script = os.path.abspath(faults.script)
    sys.path[0] = os.path.dirname(script)  # where `python SCRIPT` would import from
    if faults.nan_loss_at:
        nan_loss_at(faults.nan_loss_at)
    if faults.nan_grad_at:
        nan_grad_at(faults.nan_grad_at)
    if faults.disk_full_at is not None:
        disk_full_at(faults.disk_full_at)
    if faults.kill_in_save_at is not None:
        kill_in_save_at(faults.kill_in_save_at)
    sys.argv = [script, *faults.args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
