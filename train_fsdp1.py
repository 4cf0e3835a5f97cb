"""Fine-tune a Mixture-of-Experts model with HF Trainer: FSDP1 (through accelerate) on the dense weights,
expert parallelism on the experts.

    accelerate launch --num_processes 2 --config_file accelerate.yaml train_fsdp1.py \\
        --accelerator_config accelerator_config.json            # the embedded tiny Mixtral, CPU or GPU

Edit the settings below or override any of them from a file (--config run.yaml) or on the command line
(--name value; a true/false setting alone means true); every TrainingArguments flag works too (--bf16,
--activation_checkpointing, --save_steps 100, ...). `python train_fsdp1.py --help` lists them.
Same model code, data order and loss as train_fsdp2.py, so both give the same loss at every step.
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# ----------------------------------------------------------------------------- settings
model_name_or_path = "tiny-mixtral"  # local HF MoE model dir; "tiny-mixtral" is created on first use
data_path = "data.json"  # records (alpaca, chat messages, prompt/completion or text) as JSON, JSONL, parquet or a datasets dir
eval_data_path = ""  # held-out records for the eval loss (same formats); "" = none, or eval_split
eval_split = 0.0  # hold out this fraction of data_path's records for the eval loss (--eval_strategy steps --eval_steps N: when)
packing = True  # pack several samples into each row of max_length, documents kept apart (false: one padded sample per row)
attn_implementation = "auto"  # "auto" (the fastest exact kernel for model, device and rows), "flex_attention", "varlen", "sdpa", "eager"
overwrite_output_dir = False  # refuse to write over an earlier run's results unless true
ep_size = 0  # expert-parallel degree; 0 = all ranks (dp = world_size // ep_size)
ep_capacity_factor = 0.0  # > 0 at ep > 1: the expert exchange at fixed shapes (no host sync); 0: exact (README)
moe_backend = "native"  # "native" (grouped GEMM + all-to-all) or "megablocks"
finetuning = "full"  # "full" only here: for "lora" (frozen weights, adapters, a PEFT adapter out) use train_fsdp2.py
max_length = 256  # tokens per row (packed) or sample; longer samples are truncated
router_aux_loss_coef = -1.0  # load-balancing loss weight; -1 = the model config's router_aux_loss_coef
load_balance_coeff = 0.0  # aux-loss-free balancing: per-expert routing bias step (DeepSeek-V3); 0 = off
peak_tflops = 0.0  # per-device peak for MFU; 0 = 989 (H100/H200 bf16) on GPU, MFU not reported on CPU
nonfinite = "stop"  # on a NaN/inf loss or gradient norm: "stop" (exit naming the last good checkpoint) or "skip" the step
max_consecutive_skips = 5  # with nonfinite="skip": stop when one more step would be skipped after this many in a row; 0 = never
warmup_ratio = 0.0  # linear warmup as a fraction of the total steps; when > 0 it replaces warmup_steps (as train_fsdp2.py)
chunked_loss = True  # the loss inside lm_head's forward over chunks of rows, no full-vocabulary logits (false: full logits, then cross-entropy)
# TrainingArguments defaults of this script (the same run as train_fsdp2.py's defaults); any
# TrainingArguments flag on the command line overrides them.
trainer_defaults = dict(
    output_dir="output/fsdp1",  # metrics.jsonl, summary.json, checkpoint-*/ and the final HF model (final/)
    per_device_train_batch_size=4,  # samples per rank per micro-step
    gradient_accumulation_steps=2,  # micro-steps per optimizer step
    learning_rate=2e-3,  # peak learning rate (the tiny model trains from scratch; ~1e-5 for Mixtral)
    lr_scheduler_type="cosine",
    warmup_steps=5,
    weight_decay=0.0,
    adam_beta2=0.95,
    optim="adamw_torch",  # torch AdamW (foreach), as train_fsdp2.py
    max_grad_norm=1.0,  # global-norm clipping over dense and expert gradients (done by this script, see below)
    max_steps=40,  # optimizer steps; -1 = num_train_epochs over the data
    seed=42,  # data order
    logging_steps=1,
    save_strategy="no",  # "steps" with --save_steps N for resumable Trainer checkpoints
    report_to="none",
    ddp_timeout=600,  # seconds a collective waits for another rank (dead or stuck) before the run fails (Trainer's: 1800)
)
# -----------------------------------------------------------------------------

# The settings are the block above, taken before anything is imported: an imported constant is never one.
settings = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

# Only what the inputs' checks need before they run (the Trainer, accelerate's FSDP and the model come after).
from transformers import HfArgumentParser, TrainingArguments  # noqa: E402

from megablocks_utils.config.inputs import (  # noqa: E402
    check_data_and_model,
    check_output_dir,
    fail,
    fsdp_requested,
    stop_together,
)
from megablocks_utils.config.settings import (  # noqa: E402
    check_values,
    describe,
    help_comments,
    parse_settings,
)
from megablocks_utils.errors import CheckpointError, InputError, NonFiniteStep  # noqa: E402
from megablocks_utils.model.attention import choose_attention  # noqa: E402  (settings first, so they read like a config file)
from megablocks_utils.model.loading import load_config  # noqa: E402
from megablocks_utils.model.tiny import ensure_default_model  # noqa: E402
from megablocks_utils.mesh import check_ep_size  # noqa: E402
from megablocks_utils.train.tensorboard_writer import require_tensorboard  # noqa: E402

training_fields = dataclasses.fields(TrainingArguments)
training_flags = {f.name for f in training_fields} | {f"no_{f.name}" for f in training_fields}  # --no_x: HfArgumentParser's negation
RESULTS = ("metrics.jsonl", "summary.json", "final", "checkpoint-*")  # what a run leaves in output_dir


def trainer_help():
    """--help's part on TrainingArguments: this script's defaults (comment, else transformers' help), then the rest."""
    helps = {f.name: f.metadata.get("help", "").split(". ")[0] for f in training_fields}
    helps.update(help_comments(__file__))
    return (f"\nTrainingArguments given by this script (trainer_defaults; the same --config and command line override them):\n"
            f"{describe(trainer_defaults, helps, numbers_only=True)}\n\nEvery other TrainingArguments flag works too, "
            "e.g. --bf16, --save_strategy steps, --report_to tensorboard (transformers' TrainingArguments documentation).")


def complete_trainer_checkpoints(output_dir):
    """checkpoint-N directories in output_dir, oldest first, without the ones cut short by a crash
    (Trainer writes trainer_state.json last)."""
    from transformers.trainer_utils import sort_checkpoints

    found = sort_checkpoints(output_dir) if os.path.isdir(output_dir) else []
    return [c for c in found if os.path.isfile(os.path.join(c, "trainer_state.json"))]


def trainer_checkpoint(resume_from_checkpoint, output_dir):
    """--resume_from_checkpoint: true/last = the newest complete checkpoint-N in output_dir, or a path (checked)."""
    if resume_from_checkpoint is None:
        return None
    resume = resume_from_checkpoint
    if resume.lower() in ("true", "last"):
        complete = complete_trainer_checkpoints(output_dir)
        if not complete:
            raise InputError(
                f"--resume_from_checkpoint {resume}: {output_dir} holds no complete checkpoint-* directory; drop "
                "--resume_from_checkpoint to start a new run (--overwrite_output_dir true to replace earlier results)"
            )
        resume = complete[-1]
    if not os.path.isfile(os.path.join(resume, "trainer_state.json")):
        raise InputError(f"--resume_from_checkpoint {resume}: not a Trainer checkpoint (no trainer_state.json)")
    return resume


# ----------------------------------------------------------------------------- inputs
# Checked on every rank alike from the same files, before the process group and anything heavy: a
# bad input stops every rank within seconds, rank 0 says what to fix, nothing is written.
use_cuda = torch.cuda.is_available()
try:
    trainer_argv = parse_settings(settings, __file__, known_extra=training_flags - set(settings),
                                  extra_kind="TrainingArguments flag", doc=__doc__, more_help=trainer_help)
    globals().update(settings)
    if ep_capacity_factor == -1:  # auto: the exact exchange here (no CUDA graphs, which auto's static exchange goes with)
        ep_capacity_factor = 0.0
    if finetuning != "full":  # FSDP1 here keeps the experts as ignored_modules, outside any adapter path
        raise InputError(f"--finetuning {finetuning} is not supported by train_fsdp1.py; use train_fsdp2.py --finetuning {finetuning}")
    defaults = [f"--{k}={v}" for k, v in trainer_defaults.items()]
    if not use_cuda:
        # Without --use_cpu accelerate brings CPU processes up as DistributedType.NO: no process group,
        # every rank training alone. With it they join one gloo group (and fsdp_on_cpu makes it FSDP below).
        defaults.append("--use_cpu=true")
        # accelerate would name each process's device "cpu:0", which FSDP1 rejects for parameters on "cpu";
        # ACCELERATE_TORCH_DEVICE is accelerate's own setting for the process device.
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        # transformers gives --ddp_timeout to accelerate's process group only on GPUs: on CPU start the gloo
        # group here with it (accelerate then takes this one). Parsing TrainingArguments starts the group, so
        # the value is read first.
        timeout_flag = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        timeout_flag.add_argument("--ddp_timeout", type=int)
        ddp_timeout = timeout_flag.parse_known_args(defaults + trainer_argv)[0].ddp_timeout
        if "RANK" in os.environ and not dist.is_initialized():
            dist.init_process_group("gloo", timeout=timedelta(seconds=ddp_timeout))
    try:
        parser = HfArgumentParser(TrainingArguments, exit_on_error=False)  # errors come back here, not as usage text per rank
        (args,) = parser.parse_args_into_dataclasses(args=defaults + trainer_argv)
    except (argparse.ArgumentError, ValueError) as e:
        raise InputError(f"{e}; fix the TrainingArguments flag") from None
    # TrainingArguments checks few ranges (a batch size of 0 and a NaN learning rate pass it): ours, as in train_fsdp2.py.
    check_values({f.name: getattr(args, f.name) for f in training_fields}, numbers_only=True)
    if warmup_ratio > 0:
        args.warmup_steps = warmup_ratio  # TrainingArguments takes a fraction of the total steps in warmup_steps
    if "tensorboard" in (args.report_to or []):
        require_tensorboard()
    if args.fp16:
        raise InputError("fp16 (with its loss scaler) is not supported with the expert shards; use --bf16 true")
    from transformers import Trainer

    try:  # Trainer's own lookup of --optim: an optimizer whose package is missing stops here, not after loading
        Trainer.get_optimizer_cls_and_kwargs(args)
    except (ImportError, ValueError) as e:
        optim_name = getattr(args.optim, "value", args.optim)  # TrainingArguments keeps an OptimizerNames member
        raise InputError(f"--optim {optim_name}: {e}; or choose an optimizer torch has, e.g. --optim adamw_torch") from None
    if args.activation_checkpointing and (args.activation_checkpointing_kwargs or {}).get("use_reentrant"):
        raise InputError("use_reentrant activation checkpointing loses the load-balancing loss's gradient; drop use_reentrant")
    every_n = (args.activation_checkpointing_kwargs or {}).get("every_n_layers", 1)
    if not isinstance(every_n, int) or isinstance(every_n, bool) or every_n < 1:
        raise InputError(f"activation_checkpointing_kwargs every_n_layers={every_n!r} must be a positive integer (1 = every layer)")
    num_experts, experts_name, model_config = check_data_and_model(data_path, eval_data_path, eval_split, model_name_or_path,
                                                                  attn_implementation, "cuda" if use_cuda else "cpu")
    resume = trainer_checkpoint(args.resume_from_checkpoint, args.output_dir)
    check_output_dir(args.output_dir, RESULTS, overwrite_output_dir, resume is not None, "--resume_from_checkpoint last")
    # accelerate launch with accelerate.yaml sets ACCELERATE_USE_FSDP and the FSDP_* variables; anything
    # else (python, torchrun, a config without FSDP) would train without FSDP: stop instead.
    if not fsdp_requested() or "LOCAL_RANK" not in os.environ:
        raise InputError(
            "launch with accelerate and the FSDP config, e.g. `accelerate launch --num_processes 2 "
            "--config_file accelerate.yaml train_fsdp1.py --accelerator_config accelerator_config.json`"
        )
    ep = check_ep_size(ep_size, int(os.environ["WORLD_SIZE"]), num_experts, experts_name)
except InputError as e:
    fail(e)
start_step = 0 if resume is None else json.load(open(os.path.join(resume, "trainer_state.json")))["global_step"]

from transformers import AutoConfig, AutoTokenizer, Trainer, TrainerCallback  # noqa: E402

from megablocks_utils import (  # noqa: E402
    build_mesh,
    clip_grad_norm_,
    count_label_tokens,
    expert_parameters,
    load_model,
    moe_blocks,
    spec_for,
    sync_expert_grads,
)
from megablocks_utils.data.batches import (
    GlobalBatches,
    RankBatchSampler,
    collate,
    load_training_data,
)
from megablocks_utils.model.architectures import decoder_layer_class_name  # noqa: E402
from megablocks_utils.moe.balance import (  # noqa: E402
    add_routing_bias,
    routing_bias_note,
    update_routing_bias,
)
from megablocks_utils.moe.exchange_mode import use_static_exchange  # noqa: E402
from megablocks_utils.parallel.fsdp1 import (  # noqa: E402
    export_hf_fsdp1,
    fsdp_on_cpu,
    grad_shard_group,
    init_optimizer_state,
    sharding_facts,
    weight_checksums,
)
from megablocks_utils.train.checkpoint import (  # noqa: E402
    SAVE_ERRORS,
    copy_model_files,
    stop_if_save_failed,
)
from megablocks_utils.train.evaluate import eval_loss  # noqa: E402
from megablocks_utils.train.loss import install_loss_head  # noqa: E402
from megablocks_utils.train.metrics import active_params  # noqa: E402
from megablocks_utils.train.nonfinite import (  # noqa: E402
    NonFiniteSteps,
    where_to_continue,
)
from megablocks_utils.train.output_dir import (
    checkpoints_kept,
    disk_space_warning,
    prepare_output_dir,
    stop_if_finished,
)
from megablocks_utils.train.run_log import MetricsLog
from megablocks_utils.train.step import StepLoss
from megablocks_utils.train.stop_signal import StopSignal, exit_stopped

# ----------------------------------------------------------------------------- process group
device = args.device  # sets up accelerate's process state and the process group
if not dist.is_initialized():
    fail("accelerate did not start a process group; launch with `accelerate launch --num_processes N --config_file accelerate.yaml`")
rank, world_size = dist.get_rank(), dist.get_world_size()
master = rank == 0
# SIGTERM (a scheduler's notice before preemption) only raises a flag, installed first thing; the
# StopOnSigterm callback below ends the run at the next step's end with a saved checkpoint.
stop_signal = StopSignal(device)
try:
    nonfinite_steps = NonFiniteSteps(nonfinite, max_consecutive_skips)
except ValueError as e:
    fail(e)
# Trainer's own clipping cannot see the expert shards (FSDP1's clip_grad_norm_ counts DTensor experts as
# local plain tensors): it is switched off and this script clips by the true global norm before each
# optimizer step (MoETrainer.create_optimizer). --max_grad_norm keeps its meaning.
max_grad_norm, args.max_grad_norm = args.max_grad_norm, 0.0
if args.world_size != world_size:
    fail(f"accelerate sees {args.world_size} processes but the process group has {world_size}")
metrics_path = os.path.join(args.output_dir, "metrics.jsonl")

# ----------------------------------------------------------------------------- data and model
ensure_default_model(model_name_or_path)  # the embedded default: made once, locally, deterministically
# The fit check (megablocks_utils/train/memory_fit.py), before any weight is read: experts replicated over dp here.
from megablocks_utils.train.memory_fit import check_fit  # noqa: E402
from megablocks_utils.train.memory_plan import estimate_memory  # noqa: E402

# Trainer's AdamW with fp32 weights (the lean optims are train_fsdp2.py's; docs/train_fsdp1.md says why).
plan = estimate_memory(model_name_or_path, world_size=world_size, ep_size=ep, optim="adamw_torch", shard_experts=False,
                       nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), max_length=max_length,
                       per_device_train_batch_size=args.per_device_train_batch_size,
                       gradient_accumulation_steps=args.gradient_accumulation_steps,
                       activation_checkpointing="full" if args.activation_checkpointing else "none",
                       # Trainer's activation_checkpointing_kwargs {"every_n_layers": n} checkpoints layers 0, n, 2n, ...
                       activation_checkpointing_layers=len(range(0, load_config(model_name_or_path).num_hidden_layers, every_n)),
                       chunked_loss=chunked_loss, ep_capacity_factor=ep_capacity_factor)
check_fit(plan, torch.cuda.get_device_properties(device).total_memory if use_cuda else 0)  # too big for the GPU: every rank stops
# The data first, so a problem with it shows before a large model is read. Each block ends with the
# ranks comparing notes: an error on any rank (a rank reads only its own experts) stops them all.
with stop_together():
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    data = load_training_data(data_path, tokenizer, max_length, packing=packing, seed=args.seed, eval_data_path=eval_data_path,
                              eval_split=eval_split, source=model_name_or_path)
    dataset, eval_set = data.train, data.eval
    # The kernel for these rows (megablocks_utils/model/attention.py): auto picks by model, device and whether rows need a mask.
    attention, attention_choice = choose_attention(attn_implementation, model_config, device.type, masked=data.needs_mask,
                                                   dtype=torch.bfloat16 if args.bf16 else torch.float32)
    batches = GlobalBatches(dataset, args.per_device_train_batch_size, args.gradient_accumulation_steps, world_size, rank,
                            args.seed, unit="packed rows" if packing else "samples")
total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * batches.steps_per_epoch)
stop_if_finished(args.output_dir, resume, start_step, total_steps)  # e.g. a requeued --resume_from_checkpoint last after the end: exit 0
saves = checkpoints_kept(total_steps, max(1, int(args.save_steps)), args.save_total_limit or 0) if args.save_strategy == "steps" else 0
space = disk_space_warning(args.output_dir, plan.counts.total, "adamw_torch", saves)  # Trainer's AdamW: fp32 weights and moments
if master and space:
    print(space, flush=True)
with stop_together():
    # FSDP1 cannot shard the experts' DTensors, so they stay whole on their ep rank and replicated over
    # dp (sync_expert_grads sums their gradients); train_fsdp2.py shards them over dp as well.
    mesh = build_mesh(ep, device.type, None, timeout=args.ddp_timeout_delta, shard_experts=False)
    model, mesh = load_model(model_name_or_path, mesh, device=device, moe_backend=moe_backend, attn_implementation=attention)
    exchange_note = use_static_exchange(model, ep_capacity_factor)  # "" when off (megablocks_utils/moe/exchange_mode.py)
if master and exchange_note:
    print(exchange_note, flush=True)
config = model.config
# The loss computed inside lm_head's forward, chunk by chunk (megablocks_utils/train/loss.py), before accelerate wraps
# the model in FSDP1: "" when installed, else why not.
loss_note = install_loss_head(model) if chunked_loss else ""
if master and loss_note:
    print(loss_note, flush=True)
aux_coef = spec_for(config).aux_loss_coef(config) if router_aux_loss_coef < 0 else router_aux_loss_coef
if load_balance_coeff > 0:  # before Trainer wraps the model and loads a checkpoint (megablocks_utils/moe/balance.py)
    add_routing_bias(model)
experts = expert_parameters(model)
dense_numel = sum(p.numel() for p in model.parameters() if not any(p is e for e in experts))
world_group = mesh.world.get_group()
if master:
    print(
        f"world {world_size} = dp {mesh.dp_size} x ep {mesh.ep_size}; attention {attention_choice}; {data.describe(batches.per_step)}; "
        f"{total_steps} steps",
        flush=True,
    )


# ----------------------------------------------------------------------------- the Trainer
class StepMetrics(TrainerCallback):
    """The step's StepLoss (made by MoETrainer.get_batch_samples, filled by compute_loss, reduced over ranks
    before the optimizer step by MoETrainer.sync_and_clip); the step's record goes to metrics.jsonl at its end (``log``)."""

    def __init__(self):
        self.log = None  # the MetricsLog, made once output_dir is ready
        self.step_loss = None
        self.grad_norm = float("nan")
        self.skipped = False
        self.eval_pending = None  # a step's record waiting for its eval loss (MoETrainer.evaluate)

    def on_step_begin(self, args, state, control, lr_scheduler=None, **kwargs):
        self.start = time.perf_counter()
        self.lr = lr_scheduler.get_last_lr()[0]  # the rate this step uses (Trainer's log shows it too)

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        if use_cuda:
            torch.cuda.synchronize(device)  # the step's time includes the optimizer's GPU work
        if eval_set is not None and state.global_step == state.max_steps:
            control.should_evaluate = True  # the eval loss at the end too, as train_fsdp2.py
        # A step with an evaluation is written once its eval loss is known (MoETrainer.evaluate).
        evaluating = eval_set is not None and control.should_evaluate
        record = self.log.record(state.global_step, self.step_loss.sums, label_tokens=self.step_loss.label_tokens,
                                 lr=self.lr, grad_norm=self.grad_norm, skipped=self.skipped,
                                 step_time=time.perf_counter() - self.start, write=not evaluating)
        self.eval_pending = record if evaluating else None


class StopOnSigterm(TrainerCallback):
    """After SIGTERM reached any rank: all ranks save a Trainer checkpoint at this step's end and stop."""

    def on_step_end(self, args, state, control, **kwargs):
        if stop_signal.agreed() and state.global_step < state.max_steps:  # ranks may be signalled at different moments
            control.should_save = True
            control.should_training_stop = True


class ModelFilesInCheckpoints(TrainerCallback):
    """Config and tokenizer into each checkpoint-N, so `python -m megablocks_utils.tools.export` needs only it."""

    def on_save(self, args, state, control, **kwargs):
        path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if master and os.path.isdir(path):
            copy_model_files(model_name_or_path, path)


class MoETrainer(Trainer):
    """Trainer with the suite's loss, data order and clipping; everything else is stock Trainer + accelerate FSDP1."""

    # compute_loss returns each rank's share of the global mean over the whole optimizer step (see below).
    loss_is_scaled_for_ga = True

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        # On a CPU-only machine accelerate does not select FSDP: put its state on the FSDP1 path
        # (megablocks_utils/parallel/fsdp1.py), so wrapping and checkpoints take the same code as on GPUs.
        self.fsdp_made_on_cpu = fsdp_on_cpu(self.accelerator)
        if self.fsdp_made_on_cpu:
            self.is_fsdp_enabled = True

    def get_train_dataloader(self):
        """This rank's micro-batches from GlobalBatches, exactly as train_fsdp2.py feeds them.

        Not passed through accelerator.prepare: the sampler is already per rank, and accelerate
        would shard it again.
        """

        class EpochDataLoader(torch.utils.data.DataLoader):
            def set_epoch(self, epoch):  # Trainer calls it at each epoch; the sampler picks that epoch's steps
                self.batch_sampler.set_epoch(epoch)

        return EpochDataLoader(
            dataset,
            batch_sampler=RankBatchSampler(batches),
            # Every row max_length tokens, as in train_fsdp2.py (data.collate); moved to the GPU by Trainer.
            collate_fn=lambda samples: collate(samples, tokenizer.pad_token_id, "cpu", max_length, attention),
        )

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """One optimizer step's micro-batches and the step's label-token count over all ranks (the loss
        denominator); the step's StepLoss starts here, before its first forward."""
        samples = [batch for _, batch in zip(range(num_batches), epoch_iterator)]
        tokens = torch.tensor(sum(count_label_tokens(b["labels"]) for b in samples), dtype=torch.float64, device=device)
        dist.all_reduce(tokens, group=world_group)
        step_metrics.step_loss = StepLoss(self.state.global_step + 1, tokens, len(samples), aux_coef=aux_coef, group=world_group,
                                          device=device)
        return samples, tokens

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Each rank's loss is world_size x its share of the step's global mean (megablocks_utils/train/step.py;
        # FSDP averages dense gradients over ranks, sync_expert_grads the experts'). Summed over micro-steps
        # and averaged over ranks, as Trainer logs it, it is exactly train_fsdp2.py's loss.
        loss, out = step_metrics.step_loss.micro_batch(model, inputs)
        return (loss, out) if return_outputs else loss

    def _save_checkpoint(self, model, trial):
        """Trainer's checkpoint-N; when a write fails on any rank (a full disk above all), every rank stops
        with one message and the partial checkpoint-N is removed (megablocks_utils/train/checkpoint.py)."""
        path = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
        error = None
        try:
            super()._save_checkpoint(model, trial)
        except SAVE_ERRORS as e:  # every rank must learn of it; the message says what it was
            error = e
        stop_if_save_failed(error, self.state.global_step, path, lambda: complete_trainer_checkpoints(self.args.output_dir),
                            "--resume_from_checkpoint last")

    def create_optimizer(self, model=None):
        """Trainer's optimizer (one param group per mesh), made ready for resuming and hooked for clipping."""
        had_optimizer = self.optimizer is not None
        optimizer = super().create_optimizer(model)
        if not had_optimizer:
            if resume is not None:  # see init_optimizer_state: without it the checkpoint's optimizer state is not loaded
                init_optimizer_state(optimizer)
            optimizer.register_step_pre_hook(self.sync_and_clip)
            optimizer.register_step_post_hook(self.balance_routing)
        return optimizer

    def balance_routing(self, optimizer, hook_args, hook_kwargs):
        """Right after each optimizer step: the step's global expert load moves the routing bias (balance.py)."""
        if not step_metrics.skipped:
            update_routing_bias(self.model, step_metrics.step_loss.sums.tokens_per_expert, load_balance_coeff)

    def sync_and_clip(self, optimizer, hook_args, hook_kwargs):
        """Right before each optimizer step, on every rank: expert gradients averaged over dp, then the
        true global-norm clip over FSDP1's flat shards (summed over its group) and the expert DTensors,
        then the non-finite check on the step's global loss and norm (the same on every rank).

        Stopping raises NonFiniteStep out of trainer.train(). Skipping drops every gradient: the
        optimizer step that follows then changes nothing (AdamW passes over parameters without a
        gradient: no update, no moment or step count change); Trainer still steps the LR scheduler.
        """
        sync_expert_grads(self.model, mesh)
        norm = float(clip_grad_norm_(self.model.parameters(), max_grad_norm, sharded_group=grad_shard_group(self.model)))
        step_metrics.grad_norm = norm
        step_metrics.skipped = step_metrics.step_loss.check(nonfinite_steps, norm)
        if step_metrics.skipped:
            optimizer.zero_grad(set_to_none=True)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Trainer's schedule (--eval_strategy steps --eval_steps N, and the last step) with the suite's eval
        loss (megablocks_utils/train/evaluate.py): every rank runs the same number of forwards through the expert
        shards, and the loss is the mean over the eval set's label tokens, as in train_fsdp2.py."""
        if eval_set is None:
            return {}
        value = eval_loss(self.model_wrapped, eval_set, self.args.per_device_train_batch_size, tokenizer.pad_token_id,
                          device, world_group, max_length, attention)
        metrics = {f"{metric_key_prefix}_loss": value}
        self.log(metrics)
        step_metrics.log.add_eval(value, step_metrics.eval_pending)  # the step's record, written now with its eval loss
        step_metrics.eval_pending = None
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics=metrics)
        return metrics

    def log(self, logs, start_time=None):
        if "grad_norm" in logs:  # Trainer's own norm misses the expert shards; report ours
            logs["grad_norm"] = step_metrics.grad_norm
        if "loss" in logs and step_metrics.log.last is not None:
            logs["aux_loss"] = step_metrics.log.last["aux_loss"]
        super().log(logs, start_time)


step_metrics = StepMetrics()
trainer = MoETrainer(
    model=model, args=args, train_dataset=dataset, eval_dataset=eval_set, processing_class=tokenizer, callbacks=[step_metrics, StopOnSigterm(), ModelFilesInCheckpoints()]
)

# ----------------------------------------------------------------------------- parallelize
# FSDP1 comes from accelerate (accelerate.yaml: transformer-based wrap per decoder layer, full shard);
# the expert modules are its ignored_modules, so it never flattens or shards the expert DTensors.
plugin = trainer.accelerator.state.fsdp_plugin
if not trainer.is_fsdp_enabled or plugin is None or plugin.fsdp_version != 1:
    fail("accelerate did not set up FSDP1; launch with --config_file accelerate.yaml (distributed_type: FSDP, fsdp_version: 1)")
if "SHARDED_STATE_DICT" not in str(plugin.state_dict_type):
    fail("accelerate.yaml must set fsdp_state_dict_type: SHARDED_STATE_DICT (a full state dict would gather every expert on rank 0)")
plugin.ignored_modules = [block.experts for block in moe_blocks(model)]
# Wrap the model's own decoder-layer class (any architecture of megablocks_utils/model/architectures.py), not the
# one accelerate.yaml names.
plugin.transformer_cls_names_to_wrap = [decoder_layer_class_name(model)]
if args.bf16:  # bf16 compute with fp32 gradient reduction and fp32 buffers (rotary frequencies), as train_fsdp2.py
    from torch.distributed.fsdp import MixedPrecision

    plugin.mixed_precision_policy = MixedPrecision(torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
if master:
    print(f"accelerate: {trainer.accelerator.distributed_type}" + (" (on CPU/gloo, see megablocks_utils/parallel/fsdp1.py)" if trainer.fsdp_made_on_cpu else ""), flush=True)

# ----------------------------------------------------------------------------- train
kept = None
if master:
    kept = prepare_output_dir(args.output_dir, RESULTS, overwrite_output_dir and resume is None, start_step,
                              {**settings, "training_args": args.to_dict(), "max_grad_norm": max_grad_norm})
dist.barrier()
step_metrics.log = MetricsLog(metrics_path if master else None, aux_coef=aux_coef, world_size=world_size,
                              n_active=active_params(model, config, experts), config=config,
                              peak_flops=(peak_tflops or (989.0 if use_cuda else 0.0)) * 1e12, device=device, earlier=kept or [])

try:
    result = trainer.train(resume_from_checkpoint=resume)
except CheckpointError as e:  # a checkpoint could not be saved (MoETrainer._save_checkpoint)
    if master:
        print(file=sys.stderr)  # off Trainer's progress bar line
    fail(e)
except NonFiniteStep as e:
    if master:
        print(file=sys.stderr)
    saved = [(int(c.rsplit("-", 1)[1]), c) for c in complete_trainer_checkpoints(args.output_dir)]
    fail(f"{e}; stopped without applying or saving this step; "
         f"{where_to_continue(e.step, saved, '--resume_from_checkpoint', '--save_strategy steps --save_steps N')}")
if stop_signal.stopping and result.global_step < total_steps:
    if master:
        print(f"SIGTERM: saved {os.path.join(args.output_dir, f'checkpoint-{result.global_step}')}; "
              "continue with --resume_from_checkpoint last", flush=True)
    exit_stopped()
wrapped = trainer.model_wrapped
sharding = sharding_facts(wrapped)

# ----------------------------------------------------------------------------- summary and export
local_all = torch.tensor([sharding["dense_numel_local"]], dtype=torch.float64, device=device)
dist.all_reduce(local_all, op=dist.ReduceOp.MAX)
runtime = result.metrics["train_runtime"]
steps_run = result.global_step - start_step
checksums = weight_checksums(wrapped, mesh)
summary = step_metrics.log.summary(
    runtime=runtime, steps_run=steps_run, skipped_steps=nonfinite_steps.skipped, dp=mesh.dp_size, ep=mesh.ep_size,
    distributed_type=str(trainer.accelerator.distributed_type),
    fsdp_wrapped_modules=sharding["fsdp_wrapped_modules"],
    dense_numel_full=dense_numel,
    dense_numel_local_max=int(local_all),  # the largest shard any rank holds
    **checksums,
)
export_hf_fsdp1(wrapped, mesh, os.path.join(args.output_dir, "final"), config=AutoConfig.from_pretrained(model_name_or_path), tokenizer=tokenizer)
if master:
    step_metrics.log.finish(summary, args.output_dir, note=routing_bias_note(model, load_balance_coeff))
dist.destroy_process_group()
