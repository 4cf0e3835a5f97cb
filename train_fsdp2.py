"""Fine-tune a Mixture-of-Experts model with FSDP2 on the dense weights and expert parallelism on the experts.

    torchrun --nproc_per_node=2 train_fsdp2.py                      # the embedded tiny Mixtral, CPU or GPU
    torchrun --nproc_per_node=8 train_fsdp2.py --model_name_or_path /models/Mixtral-8x7B-v0.1 --ep_size 8

Edit the settings below or override any of them from a file (--config run.yaml) or on the command line
(--name value; a true/false setting alone means true). `python train_fsdp2.py --help` lists them all.
"""

import functools
import math
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# ----------------------------------------------------------------------------- settings
model_name_or_path = "tiny-mixtral"  # local HF MoE model dir; "tiny-mixtral" is created on first use
data_path = "data.json"  # records (alpaca, chat messages, prompt/completion or text) as JSON, JSONL, parquet or a datasets dir
eval_data_path = ""  # held-out records for the eval loss (same formats); "" = none, or eval_split
eval_split = 0.0  # hold out this fraction of data_path's records for the eval loss (instead of eval_data_path)
eval_steps = 0  # compute the eval loss every N steps (and at the end, whenever there is eval data); 0 = only at the end
packing = True  # pack several samples into each row of max_length, documents kept apart (false: one padded sample per row)
attn_implementation = "auto"  # "auto" (the fastest exact kernel for model, device and rows), "flex_attention", "varlen", "sdpa", "eager"
output_dir = "output/fsdp2"  # metrics.jsonl, summary.json and the final HF model (final/)
overwrite_output_dir = False  # refuse to write over an earlier run's results unless true
ep_size = 0  # expert-parallel degree; 0 = all ranks (dp = world_size // ep_size)
shard_experts = "auto"  # FSDP-shard each expert over dp too ("true") or replicate it ("false"); "auto": true across nodes (inputs.py)
ep_capacity_factor = -1.0  # > 0 at ep > 1: the expert exchange at fixed shapes (no host sync); 0: exact; -1: auto (README)
dp_replicate = 1  # HSDP: replicas of the FSDP shards (the number of nodes keeps all-gathers inside a node); 1 = plain FSDP
optim = "adamw_torch"  # "adamw_torch" (fp32 weights and state, 16 B/param), "adamw_bf16", "adamw_torch_8bit" (megablocks_utils/train/optim.py)
finetuning = "full"  # "full" (every weight trains) or "lora" (weights frozen in the compute dtype, adapters train; final/ is a PEFT adapter)
lora_r = 16  # LoRA rank of each adapter
lora_alpha = 32  # LoRA scale: adapters add (alpha / r) * B A
lora_dropout = 0.0  # dropout on each adapter's input (PEFT's lora_dropout)
lora_target_modules = "auto"  # "auto" (attention and routed experts, docs/lora.md) or PEFT names, comma-separated
merge_lora = False  # finetuning="lora": also write the merged model in hub layout to output_dir/merged
quantize_base = "none"  # finetuning="lora": "fp8" holds the frozen experts and linear layers in FP8 (one GPU, sm89+)
moe_backend = "native"  # "native" (grouped GEMM + all-to-all) or "megablocks"
max_length = 256  # tokens per row (packed) or sample; longer samples are truncated
per_device_train_batch_size = 4  # rows (packed) or samples per rank per micro-step
gradient_accumulation_steps = 2  # micro-steps per optimizer step
learning_rate = 2e-3  # peak learning rate (the tiny model trains from scratch; ~1e-5 for Mixtral)
lr_scheduler_type = "cosine"  # "cosine", "cosine_with_min_lr" (down to min_lr_rate), "linear", "constant_with_warmup", ...
min_lr_rate = 0.1  # cosine_with_min_lr: the final learning rate as a fraction of learning_rate
warmup_steps = 5.0  # linear warmup steps; below 1, a fraction of the total steps (as TrainingArguments)
warmup_ratio = 0.0  # linear warmup as a fraction of the total steps; when > 0 it replaces warmup_steps
weight_decay = 0.0  # AdamW weight decay (not on norms and biases, as Trainer)
adam_beta1 = 0.9  # AdamW's decay rate of the gradient average
adam_beta2 = 0.95  # AdamW's decay rate of the squared-gradient average
adam_epsilon = 1e-8  # AdamW's denominator guard
max_grad_norm = 1.0  # clip the global gradient norm (0: no clipping, norm still logged)
max_steps = 40  # optimizer steps; -1 = num_train_epochs over the data
num_train_epochs = 1  # used when max_steps = -1
seed = 42  # model-independent seeding: data order, dropout
dtype = "auto"  # "auto" (bf16 compute with fp32 params on GPU, fp32 on CPU), "bf16" or "fp32"
activation_checkpointing = "none"  # "none", "full" (recompute each decoder layer in backward) or "selective" (keep GEMM outputs)
activation_checkpointing_layers = -1  # checkpoint only this many decoder layers, spread evenly (the rest run faster); -1 = all
checkpoint_experts = False  # in layers not checkpointed, recompute only the routed experts in backward
recompute_swiglu = False  # make the experts' SwiGLU output again in backward, not keep it (GPU; ep 1 so far)
fsdp_wrap = "auto"  # FSDP units of the dense weights: "layer", "model", "none" or "auto" (README: which and when)
compile_dense = True  # torch.compile each layer's attention, norms and dense MLPs (GPU only)
cuda_graphs = "auto"  # replay each micro-step from a CUDA graph: "auto", "true", "segments" or "false" (README)
chunked_loss = True  # the loss inside lm_head's forward over chunks of rows, no full-vocabulary logits (false: full logits, then cross-entropy)
router_aux_loss_coef = -1.0  # load-balancing loss weight; -1 = the model config's router_aux_loss_coef
load_balance_coeff = 0.0  # aux-loss-free balancing: per-expert routing bias step (DeepSeek-V3); 0 = off
save_steps = 0  # write a sharded checkpoint (DCP) every N steps to output_dir/checkpoints; 0 = off
save_total_limit = 2  # keep only the newest N checkpoints
resume = ""  # "auto" = the newest complete checkpoint in output_dir/checkpoints, or a checkpoint dir
nonfinite = "stop"  # on a NaN/inf loss or gradient norm: "stop" (exit naming the last good checkpoint) or "skip" the step
max_consecutive_skips = 5  # with nonfinite="skip": stop when one more step would be skipped after this many in a row; 0 = never
collective_timeout_s = 600  # a collective waiting longer than this for another rank (dead or stuck) ends the run with an error
logging_steps = 1  # progress-bar update interval (metrics.jsonl gets every step)
report_to = "none"  # "tensorboard": also write loss, lr, grad norm, tokens/s, MFU and expert load as TensorBoard scalars
logging_dir = ""  # where report_to writes its event files; "" = output_dir/runs
peak_tflops = 0.0  # per-device peak for MFU; 0 = 989 (H100/H200 bf16) on GPU, MFU not reported on CPU
gpu_memory_gib = 0.0  # cap each GPU's memory at this many GiB (to emulate a smaller GPU); 0 = all of it
# -----------------------------------------------------------------------------

# The settings are the block above, taken before anything is imported: an imported constant is never one.
settings = {k: v for k, v in globals().items() if not k.startswith("_") and isinstance(v, (int, float, str, bool))}

# Only light modules before the inputs are checked (transformers and the model come after).
from megablocks_utils.config.inputs import (  # noqa: E402
    check_data_and_model,
    check_output_dir,
    fail,
    finished_same_run,
    nothing_to_do,
    resolve_shard_experts,
    stop_together,
)
from megablocks_utils.config.settings import parse_settings  # noqa: E402
from megablocks_utils.errors import CheckpointError, InputError, NonFiniteStep  # noqa: E402
from megablocks_utils.model.architectures import spec_for  # noqa: E402
from megablocks_utils.model.attention import choose_attention  # noqa: E402
from megablocks_utils.model.lora import check_lora  # noqa: E402
from megablocks_utils.model.quantized_base import check_quantize_base, released_format  # noqa: E402
from megablocks_utils.model.tiny import ensure_default_model  # noqa: E402
from megablocks_utils.parallel.activation_checkpointing import (
    parse_activation_checkpointing,  # noqa: E402
)
from megablocks_utils.mesh import FSDP_UNITS_TEXT, check_dp_replicate, check_ep_size  # noqa: E402
from megablocks_utils.train.cuda_graph import (  # noqa: E402
    WARMUP_STEPS,
    MicroStepGraphs,
    document_multiple,
    graph_blocker,
    resolve_cuda_graphs,
    zero_grads,
)
from megablocks_utils.train.auto_exchange import AUTO, resolve_capacity_factor, resolve_wrap_and_factor  # noqa: E402
from megablocks_utils.train.optim import param_dtype  # noqa: E402
from megablocks_utils.train.segment_graphs import SegmentGraphs  # noqa: E402
from megablocks_utils.train.segment_plan import resolve_segment_graphs, segment_blocker  # noqa: E402
from megablocks_utils.train.memory_activations import check_checkpointed_layers  # noqa: E402
from megablocks_utils.train.memory_fit import check_fit, plan_graphs  # noqa: E402
from megablocks_utils.train.memory_plan import estimate_memory  # noqa: E402
from megablocks_utils.train.tensorboard_writer import require_tensorboard  # noqa: E402

RESULTS = ("metrics.jsonl", "summary.json", "final", "merged", "checkpoints")  # what a run leaves in output_dir

# ----------------------------------------------------------------------------- inputs
# Checked on every rank alike from the same files, before the process group and anything heavy: a
# bad input stops every rank within seconds, rank 0 says what to fix, nothing is written.
try:
    parse_settings(settings, __file__, doc=__doc__)  # --help, --config, --name value; every range and choice (settings.RULES)
    globals().update(settings)
    settings["activation_checkpointing"] = activation_checkpointing = parse_activation_checkpointing(activation_checkpointing)
    if report_to == "tensorboard":
        require_tensorboard()
    num_experts, experts_name, model_config = check_data_and_model(data_path, eval_data_path, eval_split, model_name_or_path,
                                                                  attn_implementation, "cuda" if torch.cuda.is_available() else "cpu",
                                                                  quantized_ok=finetuning == "lora" and quantize_base == "fp8")
    check_checkpointed_layers(activation_checkpointing_layers, model_config.num_hidden_layers)
    lora = check_lora(model_config, finetuning=finetuning, r=lora_r, alpha=lora_alpha, dropout=lora_dropout, target_modules=lora_target_modules,
                      moe_backend=moe_backend, load_balance_coeff=load_balance_coeff, merge_lora=merge_lora)  # None: a full fine-tune
    check_quantize_base(quantize_base, finetuning=finetuning, device_type="cuda" if torch.cuda.is_available() else "cpu",
                        world_size=int(os.environ.get("WORLD_SIZE", 1)), released=released_format(model_name_or_path))
    if not (overwrite_output_dir or resume) and finished_same_run(output_dir, settings):  # the same command again
        nothing_to_do(f"{output_dir} already holds this run, finished with these settings (summary.json, final/): nothing "
                      "to do; to train it again pass --overwrite_output_dir true, or choose another --output_dir")
    earlier_results = check_output_dir(output_dir, RESULTS, overwrite_output_dir, bool(resume), "--resume auto")
    # ep_capacity_factor auto: the static exchange with whole micro-steps as CUDA graphs where that ran, else the exact one
    factor_auto = ep_capacity_factor == AUTO
    ep_capacity_factor, factor_note = resolve_capacity_factor(
        ep_capacity_factor, device_type="cuda" if torch.cuda.is_available() else "cpu", world_size=int(os.environ.get("WORLD_SIZE", 1)),
        ep_size=ep_size or int(os.environ.get("WORLD_SIZE", 1)), local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        moe_backend=moe_backend, expert_bias=spec_for(model_config).expert_bias, lora=bool(lora),
        activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts,
        dtype=torch.float32 if dtype == "fp32" or not torch.cuda.is_available() else torch.bfloat16, optim=optim,
        cuda_graphs=cuda_graphs, fsdp_wrap=fsdp_wrap)
    # cuda_graphs true that cannot run is refused here already (the attention kernel and FSDP are checked after loading)
    graphs_blocker = graph_blocker(
        device_type="cuda" if torch.cuda.is_available() else "cpu", world_size=int(os.environ.get("WORLD_SIZE", 1)), moe_backend=moe_backend,
        attention=None, activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts,
        lora=bool(lora), dtype=torch.float32 if dtype == "fp32" or not torch.cuda.is_available() else torch.bfloat16,
        fsdp=int(os.environ.get("WORLD_SIZE", 1)) > 1 and fsdp_wrap != "none" and not (factor_auto and ep_capacity_factor > 0),
        static_exchange=ep_capacity_factor > 0,  # (auto's factor comes with fsdp_wrap auto resolved to none)
        ep_size=ep_size or int(os.environ.get("WORLD_SIZE", 1)), dropout=bool(lora) and lora_dropout > 0)
    resolve_cuda_graphs(cuda_graphs, graphs_blocker)
    # cuda_graphs segments that cannot run is refused here too; the attention is the one auto would pick for packed rows
    segments_planned = resolve_segment_graphs(cuda_graphs, segment_blocker(
        device_type="cuda" if torch.cuda.is_available() else "cpu", world_size=int(os.environ.get("WORLD_SIZE", 1)),
        ep_size=ep_size or int(os.environ.get("WORLD_SIZE", 1)), moe_backend=moe_backend,
        attention=choose_attention(attn_implementation, model_config, "cuda" if torch.cuda.is_available() else "cpu",
                                   dtype=torch.bfloat16)[0] if torch.cuda.is_available() else None,
        activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts, lora=bool(lora),
        dtype=torch.float32 if dtype == "fp32" or not torch.cuda.is_available() else torch.bfloat16,
        weights=param_dtype(optim) if torch.cuda.is_available() else torch.float32, fsdp_wrap=fsdp_wrap),
        single_node=int(os.environ.get("LOCAL_WORLD_SIZE", 1)) >= int(os.environ.get("WORLD_SIZE", 1)))[0]
    if "RANK" not in os.environ:
        raise InputError("launch with torchrun, e.g. `torchrun --nproc_per_node=2 train_fsdp2.py`")
    ep = check_ep_size(ep_size, int(os.environ["WORLD_SIZE"]), num_experts, experts_name)
    check_dp_replicate(dp_replicate, int(os.environ["WORLD_SIZE"]) // ep, ep)
    experts_sharded = resolve_shard_experts(shard_experts, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_WORLD_SIZE", 0)))
except InputError as e:
    fail(e)

from transformers import AutoConfig, AutoTokenizer, get_scheduler  # noqa: E402

from megablocks_utils import (  # noqa: E402
    average_replicated_grads,
    build_mesh,
    clipped_step,
    expert_parameters,
    grad_norm_and_clip_coef,
    load_model,
)
from megablocks_utils.data.batches import GlobalBatches, collate, load_training_data
from megablocks_utils.model.export import export_hf  # noqa: E402
from megablocks_utils.model.lora import (  # noqa: E402
    add_lora,
    merge_adapters,
    save_peft_adapter,
)
from megablocks_utils.model.quantized_base import dequantize_base, describe_base  # noqa: E402
from megablocks_utils.moe.balance import (  # noqa: E402
    add_routing_bias,
    routing_bias_note,
    update_routing_bias,
)
from megablocks_utils.moe.exchange_mode import (  # noqa: E402
    drop_static_exchange,
    exact_exchange,
    exchange_mode,
    step_overflowed,
    use_static_exchange,
)
from megablocks_utils.parallel.parallelize import (  # noqa: E402
    fsdp_left_out,
    parallelize,
    set_gradient_sync,
)
from megablocks_utils.parallel.activation_checkpointing import recompute_swiglu_text, trains_with_dropout  # noqa: E402
from megablocks_utils.parallel.embedding_rows import TouchedRows  # noqa: E402
from megablocks_utils.parallel.replicated_grads import ReplicatedGradSync  # noqa: E402
from megablocks_utils.train.checkpoint import (  # noqa: E402
    checkpoint_step,
    complete_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from megablocks_utils.train.evaluate import eval_loss  # noqa: E402
from megablocks_utils.train.loss import install_loss_head  # noqa: E402
from megablocks_utils.train.metrics import active_params  # noqa: E402
from megablocks_utils.train.nonfinite import (  # noqa: E402
    NonFiniteSteps,
    where_to_continue,
)
from megablocks_utils.train.optim import (  # noqa: E402
    build_optimizer,
    parameter_groups,
    prepare_step,
    state_bytes,
)
from megablocks_utils.train.output_dir import (
    checkpoints_kept,
    disk_space_warning,
    prepare_output_dir,
    stop_if_finished,
)
from megablocks_utils.train.run_log import MetricsLog
from megablocks_utils.train.step import StepLoss
from megablocks_utils.train.step_clock import StepClock
from megablocks_utils.train.stop_signal import StopSignal, exit_stopped
from megablocks_utils.train.tensorboard_writer import TensorBoardWriter  # noqa: E402

# ----------------------------------------------------------------------------- process group
use_cuda = torch.cuda.is_available()
if use_cuda:
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if gpu_memory_gib > 0:  # the caching allocator refuses to grow past this share of the GPU
        torch.cuda.set_per_process_memory_fraction(min(1.0, gpu_memory_gib * 2**30 / torch.cuda.get_device_properties().total_memory))
device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
# The timeout bounds how long a rank waits in a collective for another one (also the mesh's groups,
# see build_mesh): a rank that died or hangs ends the run with an error on the others, not a hang.
timeout = timedelta(seconds=collective_timeout_s)
dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
rank, world_size = dist.get_rank(), dist.get_world_size()
master = rank == 0
# Schedulers send SIGTERM before preemption: finish the step, save, exit 0. Installed first thing,
# so a signal during loading is honoured after the first step; ranks agree on stopping with each
# step's sums (a signal can reach them at different moments) and stop at that step's end.
stop_signal = StopSignal(device)
try:
    nonfinite_steps = NonFiniteSteps(nonfinite, max_consecutive_skips)
except ValueError as e:
    fail(e)
torch.manual_seed(seed)
compute_dtype = {"auto": torch.bfloat16 if use_cuda else torch.float32, "bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

# ----------------------------------------------------------------------------- output dir
metrics_path = os.path.join(output_dir, "metrics.jsonl")
checkpoint_root = os.path.join(output_dir, "checkpoints")
try:
    resume_from = resolve_resume(resume, checkpoint_root)
    resume_step = checkpoint_step(resume_from) if resume_from else 0
except CheckpointError as e:
    fail(e)
if resume == "auto" and resume_from is None and not overwrite_output_dir and {"summary.json", "final/"} & set(earlier_results):
    fail(f"--resume auto: {output_dir} holds a finished run and no checkpoint to continue it from; choose another "
         "output_dir, or pass --overwrite_output_dir true to replace it")

# ----------------------------------------------------------------------------- data and model
ensure_default_model(model_name_or_path)  # the embedded default: made once, locally, deterministically
# The fit check: the per-GPU peak estimated from config.json alone, before any weight is read.
gpu_bytes = 0  # on CPU: nothing to fit into
if use_cuda:
    gpu_bytes = gpu_memory_gib * 2**30 if gpu_memory_gib > 0 else torch.cuda.get_device_properties(device).total_memory
plan_for = functools.partial(
    estimate_memory, model_name_or_path, world_size=world_size, ep_size=ep, optim=optim, shard_experts=experts_sharded,
    dp_replicate=dp_replicate, nproc_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), max_length=max_length,
    per_device_train_batch_size=per_device_train_batch_size, gradient_accumulation_steps=gradient_accumulation_steps,
    activation_checkpointing=activation_checkpointing, activation_checkpointing_layers=activation_checkpointing_layers,
    finetuning=finetuning, lora_r=lora_r, lora_dropout=lora_dropout, lora_target_modules=lora_target_modules,
    chunked_loss=chunked_loss, checkpoint_experts=checkpoint_experts, ep_capacity_factor=ep_capacity_factor,
    recompute_swiglu=recompute_swiglu, quantize_base=quantize_base)
# FSDP's units of the dense weights: "auto" gathers them all at once where ep covers every rank and that fits with room
# (auto's factor needs them whole on every rank: where that does not fit it is dropped and the units chosen without it)
fsdp_wrap, ep_capacity_factor, wrap_note = resolve_wrap_and_factor(
    fsdp_wrap, plan_for, gpu_bytes, world_size, ep, factor=ep_capacity_factor, factor_auto=factor_auto,
    segments_planned=segments_planned)
factor_note = wrap_note or factor_note
try:  # with whole micro-steps as CUDA graphs where they would run: their pool counted, or auto leaves them off
    plan, graphs_memory = plan_graphs(functools.partial(plan_for, fsdp_wrap=fsdp_wrap, ep_capacity_factor=ep_capacity_factor),
                                      cuda_graphs, graphs_blocker, gpu_bytes)
except InputError as e:
    fail(e)
check_fit(plan, gpu_bytes, hint=True)  # rank 0 prints the estimate; where it exceeds the GPU every rank stops here
# The data first, so a problem with it shows before a large model is read. Each block ends with the
# ranks comparing notes: an error on any rank (a rank reads only its own experts) stops them all.
with stop_together():
    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    data = load_training_data(data_path, tokenizer, max_length, packing=packing, seed=seed, eval_data_path=eval_data_path,
                              eval_split=eval_split, source=model_name_or_path)
    dataset, eval_set = data.train, data.eval
    # The kernel for these rows (megablocks_utils/model/attention.py): auto picks by model, device and whether rows need a mask.
    attention, attention_choice = choose_attention(attn_implementation, model_config, device.type, masked=data.needs_mask,
                                                   dtype=compute_dtype)
    batches = GlobalBatches(dataset, per_device_train_batch_size, gradient_accumulation_steps, world_size, rank, seed,
                            unit="packed rows" if packing else "samples")
total_steps = max_steps if max_steps > 0 else num_train_epochs * batches.steps_per_epoch
stop_if_finished(output_dir, resume_from, resume_step, total_steps)  # e.g. a requeued --resume auto after the end: exit 0
space = disk_space_warning(output_dir, plan.counts.total, optim, checkpoints_kept(total_steps, save_steps, save_total_limit))
if master and space:
    print(space, flush=True)
# The meshes: experts over ep (and FSDP over dp), dense weights over all ranks (megablocks_utils/mesh.py).
mesh = build_mesh(ep, device.type, num_experts, experts_name or "num_local_experts", timeout,
                  shard_experts=experts_sharded, dp_replicate=dp_replicate)
with stop_together():
    # LoRA: the frozen weights in the compute dtype, the adapters in the optimizer's (megablocks_utils/model/lora.py).
    model, mesh = load_model(model_name_or_path, mesh, device=device, dtype=compute_dtype if lora else param_dtype(optim),
                             moe_backend=moe_backend, attn_implementation=attention, quantize_base=quantize_base)
    lora_targets = add_lora(model, mesh, lora, param_dtype(optim), seed) if lora else None
    exchange_note = use_static_exchange(model, ep_capacity_factor)  # "" when off (megablocks_utils/moe/exchange_mode.py)
if master and quantize_base != "none":
    print(describe_base(model, max_length * per_device_train_batch_size), flush=True)
if master and (factor_note or exchange_note):
    print("\n".join(line for line in (factor_note, exchange_note) if line), flush=True)
config = model.config
# The loss computed inside lm_head's forward, chunk by chunk (megablocks_utils/train/loss.py); before FSDP wraps the
# model, after LoRA (an adapter on lm_head keeps the full logits). "" when installed, else why not.
loss_note = install_loss_head(model, fuse=compile_dense) if chunked_loss else ""
if master and loss_note:
    print(loss_note, flush=True)
aux_coef = spec_for(config).aux_loss_coef(config) if router_aux_loss_coef < 0 else router_aux_loss_coef
if load_balance_coeff > 0:  # before a checkpoint is loaded: it restores the bias (megablocks_utils/moe/balance.py)
    add_routing_bias(model)
if master:
    print(
        f"world {world_size} = dp {mesh.dp_size} x ep {mesh.ep_size} (experts {'sharded' if experts_sharded else 'replicated'} "
        f"over dp, dp_replicate {dp_replicate}; FSDP units: {FSDP_UNITS_TEXT[fsdp_wrap]}); optim {optim}; "
        + (f"LoRA r {lora.r} on {', '.join(lora.targets)} ({plan.adapters / 1e6:.2f} M adapter params, the rest frozen); " if lora else "")
        + f"attention {attention_choice}; {data.describe(batches.per_step)}; "
        f"{total_steps} steps", flush=True,
    )

# ----------------------------------------------------------------------------- parallelize
# EP was applied while loading; then activation checkpointing, compile and FSDP2 (experts over dp,
# dense weights over all ranks), in that order (megablocks_utils/parallel/parallelize.py).
try:  # fsdp_wrap none with weights FSDP would have cast is refused here (parallelize.check_replicated_dense)
    compiled = parallelize(model, mesh, param_dtype=compute_dtype, activation_checkpointing=activation_checkpointing,
                           activation_checkpointing_layers=activation_checkpointing_layers, checkpoint_experts=checkpoint_experts,
                           recompute_swiglu=recompute_swiglu, compile_dense=compile_dense, fsdp_wrap=fsdp_wrap, device=device)
except ValueError as e:
    fail(e)
if master and compiled:
    print(f"compile_dense: {compiled} attention, norm and dense MLP modules compiled (the first steps include compiling)", flush=True)
if master and recompute_swiglu:
    print(recompute_swiglu_text(model, device.type), flush=True)
left_out = fsdp_left_out(model, mesh, compute_dtype)
if master and left_out:
    print(left_out, flush=True)
try:  # whether each micro-step can be one CUDA graph (megablocks_utils/train/cuda_graph.py)
    use_graphs, graphs_note = resolve_cuda_graphs(cuda_graphs, graph_blocker(
        device_type=device.type, world_size=world_size, moe_backend=moe_backend, attention=attention,
        activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts,
        lora=bool(lora), dtype=compute_dtype, fsdp=any(isinstance(m, FSDPModule) for m in model.modules()),
        ep_size=mesh.ep_size, static_exchange=exchange_mode(model) is not None, dropout=trains_with_dropout(model))
        or graphs_memory)
except InputError as e:
    fail(e)
if factor_auto and exchange_mode(model) is not None and not use_graphs:  # auto's static exchange goes with graphs only
    drop_static_exchange(model)
    if master:
        print(f"ep_capacity_factor auto: 0 after all, the exact exchange ({graphs_note})", flush=True)
try:  # or each layer's dense segment (megablocks_utils/train/segment_graphs.py), where whole micro-steps cannot be
    use_segments, segments_note = resolve_segment_graphs(cuda_graphs, segment_blocker(
        device_type=device.type, world_size=world_size, ep_size=mesh.ep_size, moe_backend=moe_backend, attention=attention,
        activation_checkpointing=activation_checkpointing, checkpoint_experts=checkpoint_experts, lora=bool(lora),
        dtype=compute_dtype, weights=param_dtype(optim), fsdp_wrap=fsdp_wrap, model=model),
        single_node=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) >= world_size)
except InputError as e:
    fail(e)
use_segments = use_segments and not use_graphs  # whole micro-steps as graphs, where they can be, hold the segments
if master:
    print(segments_note if use_segments else graphs_note, flush=True)
experts = set(expert_parameters(model))  # after FSDP: where it manages them, its sharded parameters
model.train()

# ----------------------------------------------------------------------------- optimizer and schedule
# Parameter groups per mesh, dense (FSDP's) and experts (the expert mesh): foreach and fused kernels cannot
# mix DTensors of different meshes in one call. With weight decay, norms and biases get none (as Trainer).
optimizer = build_optimizer(optim, parameter_groups(model, experts, weight_decay), lr=learning_rate,
                            betas=(adam_beta1, adam_beta2), eps=adam_epsilon, weight_decay=weight_decay, device_type=device.type)
warmup = warmup_ratio or warmup_steps  # steps, or below 1 a fraction of the total steps (TrainingArguments' rule)
scheduler = get_scheduler(lr_scheduler_type, optimizer, num_warmup_steps=math.ceil(warmup * total_steps) if warmup < 1 else int(warmup),
                          num_training_steps=total_steps,
                          scheduler_specific_kwargs={"min_lr_rate": min_lr_rate} if lr_scheduler_type == "cosine_with_min_lr" else None)

start_step = 0
if resume_from:
    try:
        restored = load_checkpoint(resume_from, model, optimizer, scheduler)
    except CheckpointError as e:
        fail(e)
    start_step = restored["step"]
    if master:
        print(f"resumed from {resume_from} at step {start_step} (written by {restored['world_size']} ranks)", flush=True)
        if not math.isclose(float(scheduler.base_lrs[0]), learning_rate, rel_tol=1e-6):  # torchao keeps lr as an fp32 tensor
            print(f"warning: the checkpoint's run used learning_rate={float(scheduler.base_lrs[0]):g}; a resumed run continues "
                  f"its schedule, so learning_rate={learning_rate:g} is not used (to train with another rate, start a "
                  "new run from the exported model)", flush=True)
        if (restored["samples_per_step"], restored.get("packing", False)) != (batches.per_step, packing):
            print(f"warning: the checkpoint's run used {restored['samples_per_step']} "
                  f"{'rows' if restored.get('packing', False) else 'samples'} per step, this one {batches.per_step} "
                  f"{'rows' if packing else 'samples'}: the data order after resume differs from the original run", flush=True)


def checkpoint(step):
    try:
        save_checkpoint(checkpoint_root, step, model, optimizer, scheduler,
                        {"samples_per_step": batches.per_step, "packing": packing, "seed": seed}, save_total_limit, model_name_or_path)
    except CheckpointError as e:  # e.g. a full disk: every rank stops here, the partial checkpoint removed
        if master:
            progress.close()  # the message on a line of its own
        fail(e)


# ----------------------------------------------------------------------------- train
kept = None
if master:
    kept = prepare_output_dir(output_dir, RESULTS, overwrite_output_dir and not resume_from, start_step, settings)
    board = TensorBoardWriter(logging_dir or os.path.join(output_dir, "runs"), start_step) if report_to == "tensorboard" else None
    from tqdm import tqdm

    progress = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True)
dist.barrier()
log = MetricsLog(metrics_path if master else None, aux_coef=aux_coef, world_size=world_size,
                 n_active=active_params(model, config, list(experts)), config=config,
                 peak_flops=(peak_tflops or (989.0 if use_cuda else 0.0)) * 1e12, device=device, earlier=kept or [])
world_group = mesh.world.get_group()

# After the warm-up steps each micro-step (forward, loss, backward) is replayed from a CUDA graph; gradients then stay
# allocated: the graphs add into them (the experts' are written over by a step's first micro-step, the rest zeroed).
graphs = MicroStepGraphs(model, device, announce=progress.write if master else None) if use_graphs else None
# Or each layer's part before its MoE block, after the same warm-up steps; its gradients then stay allocated too.
segments = SegmentGraphs(model, announce=progress.write if master else None) if use_segments else None
# Dense weights whole on every rank: their gradients averaged during the last micro-step's backward (not inside a graph)
replicated = ReplicatedGradSync(model.parameters(), world_group) if fsdp_wrap == "none" and graphs is None else None
# Under the graphs they are averaged after them, the input embedding's over the rows the step's tokens touched only
touched = (TouchedRows.for_model(model, per_device_train_batch_size * max_length, gradient_accumulation_steps, world_size)
           if fsdp_wrap == "none" and graphs is not None else None)
if touched is not None and master:
    progress.write(f"input embedding: its gradient averaged over the rows a step's tokens touch (at most {touched.capacity} "
                   f"of {touched.marks.numel()})")
# Under graphs a static exchange's overflow is not checked per micro-step but once a step (moe/exchange_mode.py)
defer_overflow = graphs is not None and exchange_mode(model) is not None


def micro_steps(step_loss, micro_batches, replay: bool) -> None:
    """Each micro-batch's forward, loss and backward: from CUDA graphs after their warm-up where ``replay``."""
    for i, indices in enumerate(micro_batches):
        # Dense gradients are reduced once, on the last micro-step; sharded experts' at every one.
        set_gradient_sync(model, mesh, i == len(micro_batches) - 1)
        if replicated is not None:
            replicated.arm(i == len(micro_batches) - 1)
        # Every row max_length tokens (no recompiles); packed rows keep their documents apart (data.collate).
        batch = collate([dataset[j] for j in indices], tokenizer.pad_token_id, device, max_length, attention,
                        document_multiple=document_multiple(world_size) if graphs or segments else 1)
        if touched is not None:
            touched.add(batch["input_ids"])
        if replay:
            graphs.micro_step(step_loss, batch, steps_done=step - start_step, first=i == 0)
        else:
            loss, _ = step_loss.micro_batch(model, batch)
            loss.backward()


run_start = time.perf_counter()
clock = StepClock(device)  # each step's time without a sync of its own (megablocks_utils/train/step_clock.py)
for step in range(start_step, total_steps):
    clock.start()
    if segments is not None:
        segments.live = step - start_step >= WARMUP_STEPS
    micro_batches, step_label_tokens = batches.micro_batches(step)
    # Each rank's loss is world_size x its share of the step's global token mean, so FSDP's average over
    # ranks gives the global mean's gradient (megablocks_utils/train/step.py); the step's sums go with it.
    step_loss = StepLoss(step + 1, step_label_tokens, len(micro_batches), aux_coef=aux_coef, group=world_group, device=device,
                         defer_overflow=defer_overflow)
    micro_steps(step_loss, micro_batches, replay=graphs is not None)
    if defer_overflow and step_overflowed(step_loss.overflow, world_group):  # one read a step
        # Some rank's static exchange dropped rows: the step again from zero gradients, eagerly, on the exact exchange
        # (no optimizer step was taken); exchange_reruns counts its micro-steps.
        zero_grads(model.parameters())
        step_loss = StepLoss(step + 1, step_label_tokens, len(micro_batches), aux_coef=aux_coef, group=world_group, device=device,
                             defer_overflow=True)
        with exact_exchange(model):
            micro_steps(step_loss, micro_batches, replay=False)
        step_loss.sums.exchange_reruns = len(micro_batches)
    if replicated is not None:  # the last backward's all-reduces waited for, the averages written back
        replicated.finish()
    elif fsdp_wrap == "none":  # under whole-micro-step graphs: dense gradients averaged here, once a step
        average_replicated_grads(model.parameters(), world_group, touched)
    # The true global norm over both meshes (logged as it is, before clipping) and the factor that clips it
    # (megablocks_utils/parallel/grads.py), applied by clipped_step below.
    grad_norm, clip_coef = grad_norm_and_clip_coef(model.parameters(), max_grad_norm)
    # adamw_bf16 builds its launch now, while the GPU still runs the micro-steps (the check below waits for them)
    prepared = prepare_step(optimizer, clip_coef)
    # Before the optimizer step: the sums over ranks, so every rank decides on the same global loss and norm; each
    # rank's SIGTERM flag goes with them (stop_signal.stopping, read at the step's end).
    try:
        skipped = step_loss.check(nonfinite_steps, grad_norm, stop_signal)
    except NonFiniteStep as e:
        if master:
            progress.close()  # the message on a line of its own
        saved = [(int(os.path.basename(c)[5:]), c) for c in complete_checkpoints(checkpoint_root)]
        fail(f"{e}; stopped without applying or saving this step; {where_to_continue(e.step, saved, '--resume', '--save_steps N')}")
    step_time = clock.lap()  # since the previous step's check: the host has just waited for the GPU there
    if not skipped:
        # adamw_bf16 multiplies each gradient by clip_coef as its update reads it (one pass over them fewer);
        # the other optimizers' gradients are scaled first. The same numbers either way.
        clipped_step(optimizer, clip_coef, prepared)
        # The step's global expert load (the same on every rank) moves the routing bias toward balance.
        update_routing_bias(model, step_loss.sums.tokens_per_expert, load_balance_coeff)
    lr = scheduler.get_last_lr()[0]  # the rate this step used (what Trainer logs), before the schedule moves on
    scheduler.step()  # also when skipped: the learning rate stays a function of the step, as the data does
    if graphs is not None:  # the graphs add into gradients that stay where they are
        graphs.zero_grads()
    elif segments is not None:
        segments.zero_grads()
    else:
        optimizer.zero_grad(set_to_none=True)
    # No sync here: the host reads and launches the next step while the GPU runs this one's optimizer. Before an eval, a
    # checkpoint or the end, the GPU drains and this step's time takes its optimizer (they are not training time).
    evaluating = eval_set is not None and ((eval_steps > 0 and (step + 1) % eval_steps == 0) or step + 1 == total_steps)
    saving = save_steps > 0 and ((step + 1) % save_steps == 0 or step + 1 == total_steps)
    if evaluating or saving or stop_signal.stopping or step + 1 == total_steps:
        step_time += clock.drain()
    evaluated = None  # the eval loss (after the step's timing): every eval_steps steps and at the end
    if evaluating:
        evaluated = eval_loss(model, eval_set, per_device_train_batch_size, tokenizer.pad_token_id, device, world_group,
                              max_length, attention)
    # The step's record, the same on every rank, from numbers the host read before the optimizer step (no host
    # sync here); rank 0 writes it to metrics.jsonl.
    record = log.record(step + 1, step_loss.sums, label_tokens=step_loss.label_tokens, lr=lr,
                        grad_norm=step_loss.sums.grad_norm, skipped=skipped, step_time=step_time, eval_loss=evaluated)
    if master:
        if board:
            board.write(record)
        progress.update(1)
        if (step + 1) % logging_steps == 0:
            progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}", gnorm=f"{record['grad_norm']:.2f}",
                                 **({"eval": f"{record['eval_loss']:.4f}"} if "eval_loss" in record else {}))
    if saving:
        checkpoint(step + 1)
    if stop_signal.stopping and step + 1 < total_steps:  # decided in step_loss.check, the same on every rank
        if save_steps <= 0 or (step + 1) % save_steps != 0:
            checkpoint(step + 1)
        if master:
            progress.close()
            print(f"SIGTERM: saved {os.path.join(checkpoint_root, 'step_%08d' % (step + 1))}; "
                  "continue with --resume auto", flush=True)
        if graphs is not None:
            graphs.release()
        exit_stopped()
runtime = time.perf_counter() - run_start
if graphs is not None:  # before export's collectives and the process group's end (MicroStepGraphs.release)
    graphs.release()

# ----------------------------------------------------------------------------- summary and export
# Persistent bytes per parameter: weights + gradients (same dtype) + optimizer state, this rank's shards summed over ranks.
local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
grad_copies = [2 if p.requires_grad else 1 for p in model.parameters()]  # a frozen weight (LoRA) has no gradient
state_sizes = torch.tensor([sum(t.numel() for t in local),
                            sum(c * t.numel() * t.element_size() for c, t in zip(grad_copies, local)) + state_bytes(optimizer)],
                           dtype=torch.float64, device=device)
dist.all_reduce(state_sizes)
summary = log.summary(runtime=runtime, steps_run=total_steps - start_step, skipped_steps=nonfinite_steps.skipped,
                      dp=mesh.dp_size, ep=mesh.ep_size, bytes_per_param=float(state_sizes[1] / state_sizes[0]), optim=optim)
if lora:  # final/: a PEFT adapter of the base model; merged/: the base with the adapters folded in
    save_peft_adapter(model, lora, lora_targets, os.path.join(output_dir, "final"), model_name_or_path, tokenizer)
    if merge_lora:
        dequantize_base(model, compute_dtype)  # a quantized base: the merged model in the compute dtype
        merge_adapters(model)
        export_hf(model, mesh, os.path.join(output_dir, "merged"), config=AutoConfig.from_pretrained(model_name_or_path), tokenizer=tokenizer)
else:
    export_hf(model, mesh, os.path.join(output_dir, "final"), config=AutoConfig.from_pretrained(model_name_or_path), tokenizer=tokenizer)
if master:
    progress.close()
    if board:
        board.close()
    saved = None  # the default line: the model in hub layout in final/
    notes = [routing_bias_note(model, load_balance_coeff)]
    if lora:
        saved = (f"saved the LoRA adapter (PEFT: PeftModel.from_pretrained(base, path)) to {os.path.join(output_dir, 'final')}"
                 + (f"; the merged model in hub layout to {os.path.join(output_dir, 'merged')}" if merge_lora else ""))
        if lora.dropout > 0 and lora_targets.target_parameters:
            notes.append("note: adapter_config.json says lora_dropout 0: PEFT refuses dropout on fused experts (inference is the same)")
    log.finish(summary, output_dir, saved=saved, note="\n".join(n for n in notes if n) or None)  # summary.json, the last lines
dist.destroy_process_group()
