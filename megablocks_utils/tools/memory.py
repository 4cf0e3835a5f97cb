"""Will a training plan fit in GPU memory? An estimate from config.json alone, before any weight is loaded.

    python -m megablocks_utils.tools.memory --model_name_or_path /models/Mixtral-8x7B-v0.1 --nproc 8 --gpu_memory_gib 80 \\
        --max_length 4096 --per_device_train_batch_size 1 --optim adamw_bf16 --activation_checkpointing full

The command line of the fit check: it prints the estimate's breakdown, whether it fits, and settings that would
(exit 1 when it does not fit, 2 on a bad argument). The estimate itself, which the training scripts run too, is
``megablocks_utils/train/memory_plan.py``; docs/memory.md explains it.
"""

import argparse
import functools
import sys

from megablocks_utils.config.inputs import parse_bool
from megablocks_utils.errors import InputError
from megablocks_utils.model.architectures import spec_for
from megablocks_utils.model.loading import load_config
from megablocks_utils.train.auto_exchange import AUTO, plan_as_the_script
from megablocks_utils.train.memory_activations import checkpointing_mode
from megablocks_utils.train.memory_counts import OPTIM_BYTES, GiB
from megablocks_utils.train.cuda_graph import graph_blocker
from megablocks_utils.train.memory_fit import checkpointing_hint, fit_error, plan_graphs
from megablocks_utils.train.memory_plan import DEFAULTS, FSDP_WRAP_SETTINGS, estimate_memory


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse prints the usage too)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m megablocks_utils.tools.memory", description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", required=True, help="model directory; only its config.json is read")
    parser.add_argument("--nproc", type=int, required=True, help="GPUs in the job (world size)")
    parser.add_argument("--gpu_memory_gib", type=float, required=True, help="memory of one GPU, GiB")
    parser.add_argument("--nproc_per_node", type=int, default=DEFAULTS["nproc_per_node"])
    parser.add_argument("--ep_size", type=int, default=DEFAULTS["ep_size"], help="0 = all ranks")
    parser.add_argument("--optim", default=DEFAULTS["optim"], choices=list(OPTIM_BYTES))
    parser.add_argument("--max_length", type=int, default=DEFAULTS["max_length"])
    parser.add_argument("--per_device_train_batch_size", type=int, default=DEFAULTS["per_device_train_batch_size"])
    parser.add_argument("--gradient_accumulation_steps", type=int, default=DEFAULTS["gradient_accumulation_steps"])
    parser.add_argument("--activation_checkpointing", default=DEFAULTS["activation_checkpointing"], help="none, selective, full (true = full, false = none)")
    parser.add_argument("--activation_checkpointing_layers", type=int, default=DEFAULTS["activation_checkpointing_layers"],
                        help="how many decoder layers to checkpoint, spread evenly; -1 = all")
    parser.add_argument("--shard_experts", default=DEFAULTS["shard_experts"], help="auto, true or false")
    parser.add_argument("--dp_replicate", type=int, default=DEFAULTS["dp_replicate"])
    parser.add_argument("--finetuning", default=DEFAULTS["finetuning"], choices=["full", "lora"],
                        help="lora: weights frozen in bf16, adapters on --lora_target_modules train")
    parser.add_argument("--lora_r", type=int, default=DEFAULTS["lora_r"])
    parser.add_argument("--lora_dropout", type=float, default=DEFAULTS["lora_dropout"])
    parser.add_argument("--lora_target_modules", default=DEFAULTS["lora_target_modules"], help="auto (the attention projections and routed experts) or PEFT names, comma-separated")
    parser.add_argument("--chunked_loss", default=str(DEFAULTS["chunked_loss"]).lower(), help="true or false: the loss over chunks of rows")
    parser.add_argument("--checkpoint_experts", default=str(DEFAULTS["checkpoint_experts"]).lower(),
                        help="true or false: recompute the routed experts of the layers not checkpointed")
    parser.add_argument("--recompute_swiglu", default=str(DEFAULTS["recompute_swiglu"]).lower(),
                        help="true or false: the experts' SwiGLU output made again in the backward, not kept")
    parser.add_argument("--quantize_base", default=DEFAULTS["quantize_base"], choices=["none", "fp8"],
                        help="lora: fp8 holds the frozen experts and linear layers in FP8")
    parser.add_argument("--fsdp_wrap", default=DEFAULTS["fsdp_wrap"], choices=FSDP_WRAP_SETTINGS,
                        help="FSDP units of the dense weights: each decoder layer, the whole model at once, or auto (train_fsdp2.py's rule)")
    parser.add_argument("--ep_capacity_factor", type=float, default=DEFAULTS["ep_capacity_factor"],
                        help="> 0: the static expert exchange, each MoE layer's received rows fixed at this x the mean; 0: the "
                             "exact exchange; -1 (auto): as train_fsdp2.py resolves it (2 at ep 2 and 3 at ep 4 = world size "
                             "on one node with adamw_bf16 and CUDA graphs, where it fits)")
    parser.add_argument("--cuda_graphs", default=DEFAULTS["cuda_graphs"], choices=["auto", "true", "false", "segments"],
                        help="as train_fsdp2.py's: what auto's exchange and FSDP units depend on")
    args = parser.parse_args(argv)
    if not args.gpu_memory_gib > 0:
        parser.error(f"--gpu_memory_gib {args.gpu_memory_gib} must be positive")
    if args.ep_capacity_factor < 0 and args.ep_capacity_factor != AUTO:
        parser.error(f"--ep_capacity_factor {args.ep_capacity_factor:g}: give 0 or more, or -1 (auto)")
    chunked_loss, checkpoint_experts = parse_bool(args.chunked_loss), parse_bool(args.checkpoint_experts)
    if chunked_loss is None:
        parser.error(f"--chunked_loss expects true or false, got {args.chunked_loss!r}")
    if checkpoint_experts is None:
        parser.error(f"--checkpoint_experts expects true or false, got {args.checkpoint_experts!r}")
    recompute_swiglu = parse_bool(args.recompute_swiglu)
    if recompute_swiglu is None:
        parser.error(f"--recompute_swiglu expects true or false, got {args.recompute_swiglu!r}")
    try:
        plan_for = functools.partial(
            estimate_memory,
            args.model_name_or_path,
            world_size=args.nproc,
            ep_size=args.ep_size,
            optim=args.optim,
            shard_experts=args.shard_experts,
            dp_replicate=args.dp_replicate,
            nproc_per_node=args.nproc_per_node,
            max_length=args.max_length,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            activation_checkpointing=args.activation_checkpointing,
            activation_checkpointing_layers=args.activation_checkpointing_layers,
            finetuning=args.finetuning,
            lora_r=args.lora_r,
            lora_dropout=args.lora_dropout,
            lora_target_modules=args.lora_target_modules,
            chunked_loss=chunked_loss,
            checkpoint_experts=checkpoint_experts,
            recompute_swiglu=recompute_swiglu,
            quantize_base=args.quantize_base,
        )
        ep = plan_for(fsdp_wrap="layer", ep_capacity_factor=0.0).ep  # --ep_size resolved (0: all ranks) and checked
        wrap, factor, note = plan_as_the_script(
            args.ep_capacity_factor, args.fsdp_wrap, plan_for, args.gpu_memory_gib * GiB, world_size=args.nproc, ep=ep,
            local_world_size=args.nproc_per_node, optim=args.optim, lora=args.finetuning == "lora",
            activation_checkpointing=checkpointing_mode(args.activation_checkpointing), checkpoint_experts=checkpoint_experts,
            expert_bias=spec_for(load_config(args.model_name_or_path)).expert_bias, cuda_graphs=args.cuda_graphs)
        blocker = graph_blocker(device_type="cuda", world_size=args.nproc, moe_backend="native", attention=None,
                                activation_checkpointing=checkpointing_mode(args.activation_checkpointing),
                                checkpoint_experts=checkpoint_experts, lora=args.finetuning == "lora",
                                fsdp=args.nproc > 1 and wrap != "none", ep_size=ep, static_exchange=factor > 0,
                                dropout=args.finetuning == "lora" and args.lora_dropout > 0)
        estimate, graphs_note = plan_graphs(functools.partial(plan_for, fsdp_wrap=wrap, ep_capacity_factor=factor),
                                            args.cuda_graphs, blocker, args.gpu_memory_gib * GiB)
    except InputError as e:
        parser.error(str(e))
    for line in (note, graphs_note and f"cuda_graphs auto: off ({graphs_note})"):
        if line:
            print(line)
    print(estimate.describe())
    error = fit_error(estimate, args.gpu_memory_gib * GiB)
    if error:
        print(error)
    hint = None if error else checkpointing_hint(estimate, args.gpu_memory_gib * GiB)
    if hint:
        print(hint)
    print(f"GPU memory: {args.gpu_memory_gib:.1f} GiB per GPU")
    print("fits: no" if error else "fits: yes")
    return 1 if error else 0


if __name__ == "__main__":
    sys.exit(main())
