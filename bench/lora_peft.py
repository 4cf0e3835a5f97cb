"""LoRA on every expert: ours (train_fsdp2.py --finetuning lora's model) against transformers + PEFT
(``LoraConfig(target_parameters=...)``), one GPU, the same packed rows, the same weights and adapters.

    torchrun --nproc_per_node=1 bench/lora_peft.py --variant ours --out bench/results/lora_peft_h200.jsonl
    torchrun --nproc_per_node=1 bench/lora_peft.py --variant peft --out bench/results/lora_peft_h200.jsonl

The model: ``--model_config``'s config.json (default Qwen3-30B-A3B's, tests/configs) with ``--layers`` decoder layers,
random bf16 weights from one seed (transformers' init), built on the GPU. The adapters: PEFT's default targets of
train_fsdp2.py (q/k/v/o and every expert's gate_up_proj and down_proj), rank ``--r``, alpha 2r, fp32 (both), every A
and B drawn from a seed per PEFT key (B non-zero, so the adapters change the loss): both variants train the same
function. The rows (``--data``), the same in both variants: ``--micro_batch`` x ``--seq`` tokens per micro-step, through
data.collate, the attention ``--attn`` for both (default varlen: no mask built).

- random: packed documents of random lengths (seeded) of random tokens, every token a label (the speed runs).
- chat, alpaca: the repo's records (data_chat.jsonl, data.json) as train_fsdp2.py reads them (load_training_data with
  packing, GlobalBatches on one rank, seed 42, labels on the answers only), tokenized by the embedded tiny model's
  tokenizer (``--tokenizer``, made as train_fsdp2.py makes it when missing; its ids are the first 512 of the model's
  vocabulary). At seq 4096 the chat records fill 137 rows: 200 steps of one row see each about 1.5 times.

The loss: cross-entropy only (no load-balancing loss; the routers are frozen), the mean over the step's label tokens.
Optimizer: torch's AdamW (fused on GPUs) on the adapters at a constant ``--lr``, no warm-up, clipping at 1.0.

- ours: ``shard_moe`` (ep 1), ``add_lora``, ``parallelize`` as the script (no FSDP on one GPU; ``--ac``), the adapters
  inside the grouped GEMMs.
- peft: transformers' model with ``experts_implementation="grouped_mm"``, ``get_peft_model``; PEFT adds s * B_e A_e to
  each expert weight per forward (a parametrization), so each layer builds an [E, out, in] weight; ``--ac full`` is
  transformers' gradient checkpointing (non-reentrant).

Each run appends one JSON record (step time median after ``--warmup``, tokens/s, peak memory, each step's loss and
gradient norm, warm-up steps included) to ``--out``; the two variants' losses should agree to bf16 rounding, step by
step. How far the loss falls: ``loss_first10_mean`` and ``loss_last10_mean``, the means of the first and last 10
steps' losses (overlapping below 20 steps), and ``loss_fall``, their difference (``bench/run.py lora --quality``
compares the two variants').
"""

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from datetime import date

import torch
import torch.distributed as dist

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, ROOT)
DATA_FILES = {"chat": "data_chat.jsonl", "alpaca": "data.json"}
SEED = 42  # train_fsdp2.py's default: the rows and their order it would train on


def packed_rows(generator: torch.Generator, rows: int, seq: int, vocab: int, mean_doc: int) -> list[dict]:
    """``rows`` rows of ``seq`` tokens, each documents of random lengths (exponential around ``mean_doc``), every token
    a label; the collator's layout (per-document position ids)."""
    out = []
    for _ in range(rows):
        ids, positions = [], []
        while len(ids) < seq:
            n = min(seq - len(ids), max(16, int(torch.empty(1).exponential_(1 / mean_doc, generator=generator))))
            ids += torch.randint(1, vocab, (n,), generator=generator).tolist()
            positions += list(range(n))
        out.append({"input_ids": ids, "labels": ids, "position_ids": positions})
    return out


def real_steps(kind: str, tokenizer_dir: str, seq: int, micro_batch: int, grad_accum: int, steps: int) -> tuple[list, int, int, int]:
    """Each step's micro-batches of packed rows of the repo's ``kind`` records, as train_fsdp2.py draws them on one
    rank; the tokenizer's pad id and vocabulary size; the number of packed rows."""
    from transformers import AutoTokenizer

    from megablocks_utils.data.batches import GlobalBatches, load_training_data
    from megablocks_utils.model.tiny import SHIPPED_DATA, make_tiny_mixtral

    if not os.path.isdir(tokenizer_dir):
        make_tiny_mixtral(tokenizer_dir, SHIPPED_DATA)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    data = load_training_data(os.path.join(ROOT, DATA_FILES[kind]), tokenizer, seq, packing=True, seed=SEED)
    batches = GlobalBatches(data.train, micro_batch, grad_accum, 1, 0, SEED, unit="packed rows")
    rows = [[[data.train[j] for j in m] for m in batches.micro_batches(step)[0]] for step in range(steps)]
    return rows, tokenizer.pad_token_id, len(tokenizer), len(data.train)


def loss_fall(losses: list[float]) -> dict:
    """How far the loss fell: the means of the first and last 10 steps' losses and their difference."""
    first, last = statistics.mean(losses[:10]), statistics.mean(losses[-10:])
    return {"loss_first10_mean": first, "loss_last10_mean": last, "loss_fall": first - last}


def seeded_adapters(keys_shapes: dict) -> dict:
    """Every adapter tensor (PEFT keys and layout) from a seed of its own key: the same in both variants."""
    state = {}
    for key, shape in keys_shapes.items():
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        fan_in = shape[-1] if ".lora_A." in key else None
        scale = 1 / fan_in**0.5 if fan_in else 0.02
        state[key] = (torch.rand(shape, generator=g) * 2 - 1) * scale
    return state


def tally_saved(model, batch: dict, tokens: int) -> dict:
    """The tensors autograd keeps from one forward for its backward, weights left out, counted once per storage:
    bytes per token (all layers) and the largest kinds by shape and dtype (where activation memory goes)."""
    from torch.distributed.tensor import DTensor

    from megablocks_utils.train.loss import forward_with_loss

    weights = {(q.to_local() if isinstance(q, DTensor) else q).untyped_storage().data_ptr() for q in model.parameters()}
    seen: dict[int, tuple] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = forward_with_loss(model, batch["model_inputs"], batch["labels"])
    del loss
    kinds: dict[tuple, list] = {}
    for shape, dtype, nbytes in seen.values():
        kind = kinds.setdefault((shape, dtype), [0, 0])
        kind[0] += 1
        kind[1] += nbytes
    top = sorted(kinds.items(), key=lambda kv: -kv[1][1])[:25]
    return {"bytes_per_token": sum(n for *_, n in seen.values()) / tokens,
            "kinds": [{"shape": list(shape), "dtype": dtype, "count": c, "bytes_per_token": n / tokens} for (shape, dtype), (c, n) in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=["ours", "peft"], required=True)
    p.add_argument("--model_config", default=os.path.join(ROOT, "tests", "configs", "qwen3-30b-a3b"))
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=1)
    p.add_argument("--mean_doc", type=int, default=1024, help="mean document length in the packed rows")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--ac", choices=["none", "full", "selective"], default="none", help="selective: ours only")
    p.add_argument("--ac_layers", type=int, default=-1, help="ours: checkpoint only this many layers (-1: all)")
    p.add_argument("--checkpoint_experts", action="store_true",
                   help="ours: recompute the routed experts in every layer --ac leaves out (train_fsdp2.py's checkpoint_experts)")
    p.add_argument("--compile_dense", choices=["default", "true", "false"], default="default",
                   help="torch.compile attention and norms; default: each side's own default (ours on, transformers off)")
    p.add_argument("--loss", choices=["default", "chunked", "full"], default="default",
                   help="ours: the loss inside lm_head over row chunks (train_fsdp2.py's default) or from full logits; "
                        "transformers always full logits")
    p.add_argument("--adapter_dtype", choices=["fp32", "bf16"], default="fp32",
                   help="ours: bf16 adapters trained by adamw_bf16 (the script's --optim adamw_bf16) instead of fp32 + AdamW")
    p.add_argument("--quantize_base", choices=["none", "fp8"], default="none",
                   help="ours: the frozen experts and linear layers held in FP8 (the script's --quantize_base)")
    p.add_argument("--fp8_expert_gemm", choices=["auto", "kernel", "dequantize"], default="auto",
                   help="ours, FP8 experts: their grouped GEMMs scale the weight tiles in our kernel, or a pass writes each "
                        "layer's bf16 weight before torch's grouped GEMM; auto (the library's): by rows per expert (moe/quantized.py)")
    p.add_argument("--release", choices=["bf16", "fp8", "mxfp4"], default=None,
                   help="ours: random weights read layer by layer as from a checkpoint released so (bench/random_checkpoint.py: "
                        "models whose bf16 weights do not fit the GPU); default: transformers' model built in memory")
    p.add_argument("--attn", default="varlen", help="varlen (GPU), sdpa, flex_attention, eager")
    p.add_argument("--data", choices=["random", *DATA_FILES], default="random", help="random tokens, or the repo's records")
    p.add_argument("--tokenizer", default=os.path.join(ROOT, "tiny-mixtral"),
                   help="chat, alpaca: the tokenizer (default the embedded tiny model's, made when missing)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW's learning rate, constant")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=os.path.join(BENCH, "results", "lora_peft.jsonl"))
    p.add_argument("--gpu_memory_gib", type=float, default=0.0,
                   help="cap the caching allocator at this many GiB (a smaller GPU on a larger one); 0: the whole GPU")
    p.add_argument("--cuda_graphs", action="store_true",
                   help="ours: each micro-step replayed from a CUDA graph after the warm-up (train_fsdp2.py's cuda_graphs; "
                        "its StepLoss, whose router statistics the plain loop leaves out)")
    p.add_argument("--tally_saved", action="store_true",
                   help="instead of training: what one micro-batch's forward saves for the backward, by shape (no weights)")
    args = p.parse_args()
    if args.variant == "peft" and (args.release or args.ac == "selective" or args.ac_layers != -1 or args.checkpoint_experts or args.loss == "chunked"
                                   or args.adapter_dtype != "fp32" or args.quantize_base != "none"):
        p.error("--ac selective, --ac_layers, --checkpoint_experts, --loss chunked, --adapter_dtype bf16, --quantize_base and --release are ours only")
    if args.cuda_graphs and (args.variant == "peft" or args.warmup <= 2):
        p.error("--cuda_graphs: ours, with --warmup 3 or more (2 eager steps, then the captures)")
    args.compile_dense = args.variant == "ours" if args.compile_dense == "default" else args.compile_dense == "true"
    chunked = args.variant == "ours" and args.loss != "full"

    from peft import get_peft_model, set_peft_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from megablocks_utils import (
        build_mesh,
        compile_dense_parts,
        decoder_layers,
        shard_moe,
        spec_for,
    )
    from megablocks_utils.data.batches import collate
    from megablocks_utils.model.attention import choose_attention
    from megablocks_utils.model.quantized_base import describe_base, set_expert_gemm
    from megablocks_utils.model.lora import (
        DEFAULT_TARGETS,
        LoraSettings,
        add_lora,
        find_targets,
        load_peft_tensors,
        parse_targets,
        peft_config,
        peft_tensors,
    )
    from megablocks_utils.parallel.grads import clip_grad_norm_
    from megablocks_utils.parallel.parallelize import parallelize
    from megablocks_utils.train.loss import forward_with_loss, install_loss_head
    from megablocks_utils.train.optim import build_optimizer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        if args.gpu_memory_gib > 0:  # the allocator then refuses to grow past this share: an OOM there is an OOM on that GPU
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * 2**30 / torch.cuda.get_device_properties().total_memory))
    dist.init_process_group("nccl" if cuda else "gloo")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = AutoConfig.from_pretrained(args.model_config)
    config.num_hidden_layers = args.layers
    config.use_cache = False
    attention = choose_attention(args.attn, config, device.type)[0]
    lora = LoraSettings(r=args.r, alpha=2 * args.r, dropout=0.0, targets=parse_targets(DEFAULT_TARGETS))
    record = {"variant": args.variant, "device": torch.cuda.get_device_name() if cuda else "cpu", "model": os.path.basename(args.model_config),
              "layers": args.layers, "seq": args.seq, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum, "r": args.r,
              "ac": args.ac, "ac_layers": args.ac_layers, "checkpoint_experts": args.checkpoint_experts, "compile_dense": args.compile_dense, "chunked_loss": chunked,
              "adapter_dtype": args.adapter_dtype, "quantize_base": args.quantize_base, "gpu_memory_gib": args.gpu_memory_gib or None, "attention": attention, "data": args.data, "lr": args.lr,
              "cuda_graphs": args.cuda_graphs, "date": date.today().isoformat(), "torch": torch.__version__}
    try:
        if args.data == "random":
            generator = torch.Generator().manual_seed(1)
            steps = [[packed_rows(generator, args.micro_batch, args.seq, config.vocab_size, args.mean_doc)
                      for _ in range(args.grad_accum)] for _ in range(args.warmup + args.steps)]
            pad_id = 0
        else:
            steps, pad_id, vocab, rows = real_steps(args.data, args.tokenizer, args.seq, args.micro_batch, args.grad_accum,
                                                    args.warmup + args.steps)
            if vocab > config.vocab_size:
                raise SystemExit(f"error: the tokenizer {args.tokenizer} has {vocab} tokens, more than the model's vocab_size "
                                 f"{config.vocab_size}; use a model config with at least {vocab}")
            record.update(data_rows=rows)
        torch.manual_seed(0)
        impl = {"experts_implementation": "grouped_mm"} if args.variant == "peft" and cuda else {}
        with torch.device("meta") if args.release else device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention, **impl)
        if args.variant == "ours" and args.release:  # layer by layer from random weights in the release's layout
            from random_checkpoint import RandomCheckpoint

            mesh = build_mesh(1, device.type)
            shard_moe(model, mesh, device=device, quantize_base=args.quantize_base,
                      checkpoint=RandomCheckpoint(config, args.release, device))
            record.update(release=args.release)
        elif args.variant == "ours":
            # shard_moe copies each layer's experts into its own tensors: from the host, not beside them on the GPU
            spec = spec_for(config)
            for layer in decoder_layers(model):
                experts = getattr(getattr(layer, spec.block_attr), spec.experts_attr, None)
                if experts is not None:
                    experts.to("cpu")
            if cuda:
                torch.cuda.empty_cache()
            mesh = build_mesh(1, device.type)
            shard_moe(model, mesh, device=device, quantize_base=args.quantize_base)
        if args.variant == "ours":
            add_lora(model, mesh, lora, torch.bfloat16 if args.adapter_dtype == "bf16" and cuda else torch.float32)
            if chunked:
                install_loss_head(model, fuse=args.compile_dense)
            parallelize(model, mesh, param_dtype=dtype, activation_checkpointing=args.ac, activation_checkpointing_layers=args.ac_layers,
                        checkpoint_experts=args.checkpoint_experts, compile_dense=args.compile_dense, device=device)
            keys = {k: tuple(v.shape) for k, v in peft_tensors(model).items()}
            load_peft_tensors(model, seeded_adapters(keys))
            record.update(base=describe_base(model, args.micro_batch * args.seq) or "bf16")
            if args.fp8_expert_gemm != "auto":
                record.update(fp8_expert_gemm=args.fp8_expert_gemm, fp8_expert_gemm_weights=set_expert_gemm(model, args.fp8_expert_gemm))
        else:
            model = get_peft_model(model, peft_config(lora, find_targets(model, lora.targets), "", inference_mode=False))
            keys = {k.replace(".default", ""): tuple(v.shape) for k, v in model.named_parameters() if "lora_" in k}
            result = set_peft_model_state_dict(model, seeded_adapters(keys))
            assert not result.unexpected_keys, result.unexpected_keys[:3]
            if args.ac == "full":
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if args.compile_dense and cuda:
                compile_dense_parts(model.base_model.model)
        model.train()
        trained = [q for q in model.parameters() if q.requires_grad]
        record.update(adapter_params=sum(q.numel() for q in trained), adapter_dtypes=sorted({str(q.dtype) for q in trained}))
        # One group per kind: a fused step cannot mix DTensors (ours: the expert adapters) and plain tensors.
        from torch.distributed.tensor import DTensor

        kinds = [[q for q in trained if not isinstance(q, DTensor)], [q for q in trained if isinstance(q, DTensor)]]
        groups = [{"params": kind} for kind in kinds if kind]
        if args.adapter_dtype == "bf16" and cuda:
            optimizer = build_optimizer("adamw_bf16", groups, lr=args.lr, betas=(0.9, 0.999), device_type="cuda")
        else:
            optimizer = torch.optim.AdamW(groups, lr=args.lr, fused=cuda)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if args.tally_saved:
            batch = collate(steps[0][0], pad_id, device, args.seq, attention)
            record.update(status="ok", saved=tally_saved(model, batch, args.micro_batch * args.seq))
            steps = []
        graphs = None
        if args.cuda_graphs:
            from megablocks_utils.train.cuda_graph import MicroStepGraphs, document_multiple, graph_blocker
            from megablocks_utils.train.step import StepLoss

            blocker = graph_blocker(device_type=device.type, world_size=1, moe_backend="native", attention=attention,
                                    activation_checkpointing=args.ac, checkpoint_experts=args.checkpoint_experts, lora=True, dtype=dtype)
            if blocker:
                raise SystemExit(f"error: --cuda_graphs: {blocker}")
            graphs = MicroStepGraphs(model, device, announce=print)
        times, losses, norms = [], [], []
        for step, micro_batches in enumerate(steps):
            batches = [collate(rows, pad_id, device, args.seq, attention, document_multiple=document_multiple(1) if graphs else 1)
                       for rows in micro_batches]
            labels = sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            total = 0.0
            if graphs is not None:  # train_fsdp2.py's micro-steps: eager for 2 steps, then captured and replayed
                step_loss = StepLoss(step + 1, labels, len(batches), aux_coef=0.0, group=dist.group.WORLD, device=device)
                for i, batch in enumerate(batches):
                    graphs.micro_step(step_loss, batch, steps_done=step, first=i == 0)
                total = step_loss.sums.all_reduce().ce_sum / labels
            for batch in batches if graphs is None else []:  # the loss read once a step, as train_fsdp2.py reads it
                loss_sum, out = forward_with_loss(model, batch["model_inputs"], batch["labels"])
                loss = loss_sum / labels
                loss.backward()
                total += loss.detach()
                del out, loss_sum, loss
            total = float(total)
            norm = clip_grad_norm_(trained, 1.0)
            optimizer.step()
            if graphs is not None:
                graphs.zero_grads()
            else:
                optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(total)
            norms.append(float(norm))
            if step % 10 == 0 or step == len(steps) - 1:  # progress, in the log a timed-out launch leaves
                print(f"step {step}: loss {total:.4f}, {time.perf_counter() - start:.3f} s", flush=True)
        if times:  # (none with --tally_saved)
            step_time = statistics.median(times)
            record.update(status="ok", step_time_s=step_time, tokens_per_s=args.grad_accum * args.micro_batch * args.seq / step_time,
                          losses=losses, grad_norms=norms, **loss_fall(losses))
        if cuda:
            record.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30,
                          peak_reserved_gib=torch.cuda.max_memory_reserved() / 2**30)
        if graphs is not None:
            graphs.release()
    except torch.OutOfMemoryError as e:
        record.update(status="OOM", error=str(e).splitlines()[0][:200])
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
