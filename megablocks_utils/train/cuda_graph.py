"""Each micro-step (forward, loss and backward) replayed from a CUDA graph: on one GPU, no Python between kernels.

Why: at DeepSeek-V2-Lite's shape (20 layers, 64 small experts, one H200) a micro-step launches thousands of kernels
from Python, and the host took about as long to launch them as the GPU to run them (``bench/profile_steps.py
--phases``: ~60 ms of host time per forward and again per backward): the step was paced by the host. Replayed, a
micro-step costs the host a few copies and one launch.

What makes a micro-step capturable, and where that is ensured:
- no FSDP hook and no host sync: the native MoE layer at ep 1 and the attention kernels ``graph_blocker`` allows make
  none in a step (tests/gpu/test_step_no_sync.py). At ep = world size > 1 the same with the static exchange (fixed
  all-to-all splits, overflow kept on the device: ``StepLoss(defer_overflow=True)``, the step rerun exactly by the
  script when any rank overflowed) and the dense weights whole on every rank (``fsdp_wrap`` "none", their gradients
  averaged after the micro-steps). Every rank must capture and replay the same graphs in the same order (their NCCL
  calls pair up): the signatures below are the same on every rank where shapes are fixed; varlen's document count,
  padded to a multiple of ``DOCUMENT_MULTIPLE`` on several ranks, could differ between ranks only with more documents
  than that in a micro-batch (then one rank captures while another replays: the eager warm-up's collectives still pair,
  not verified);
- fixed shapes: every row is max_length tokens and every micro-batch has as many rows (``data.collate``,
  ``GlobalBatches``); varlen's document boundaries come padded with empty documents to a multiple of
  ``document_multiple``. A graph is captured for each shape signature, all in one memory pool (their work never
  overlaps; only their small outputs stay reserved);
- gradients that exist before the capture and stay in place (``MicroStepGraphs.zero_grads`` after the optimizer step):
  the captured backward adds into them (autograd adds into an existing gradient in place; the experts' GEMM adds into
  ``.grad`` itself, ``moe/weight_grad.py``). A step's first micro-step has graphs of its own, in which the experts'
  GEMM writes their gradients over instead (``weight_grad.gradients_written``): only the other gradients, a small
  part of an MoE model's, are zeroed between steps;
- nothing read on the host from the step's tensors: the loss's 1 / label tokens is a device scalar set before each
  replay (``StepLoss.loss_and_numbers``), and the micro-step's numbers for the step's sums come back as device tensors.

The first ``warmup_steps`` steps run eagerly (torch.compile compiles there). After them, the first micro-batch of a
new signature (and place in the step: first or not) runs eagerly on the side stream the graph is then captured on
(warming that stream's libraries and compiled code), and later ones copy their tensors into the graph's inputs and
replay it.
"""

import time
from collections import defaultdict
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from megablocks_utils.config.inputs import parse_bool
from megablocks_utils.errors import InputError
from megablocks_utils.moe.weight_grad import gradients_written

# Steps run eagerly before any graph is captured (torch.compile compiles there).
WARMUP_STEPS = 2
# varlen's document count, padded up to a multiple of this: a graph per multiple (``document_multiple``).
DOCUMENT_MULTIPLE = 64
DOCUMENT_MULTIPLE_ONE_RANK = 8
# The attention kernels whose forward needs no host sync and no mask object (model/attention.py): with "sdpa" and
# "eager" transformers builds or checks a mask from the rows on the host, and flex_attention's block mask is not yet
# tried under a graph.
CAPTURABLE_ATTENTION = ("sdpa_causal", "varlen")
# Activation checkpointing (any mode, checkpoint_experts) and LoRA under graphs: the GPU count their equivalence to the
# eager step has run on (tests/gpu/test_graphs_lora.py); above it they stay off until that test runs there.
GRAPHS_WITH_RECOMPUTE_OR_LORA_RAN_ON_GPUS = 1


def document_multiple(world_size: int) -> int:
    """The multiple varlen's document count is padded to under graphs (``data.collate``), a graph per value. The flash
    kernel's grid grows with the count, empty documents included: 64 slots for the chat records' ~5 documents a row
    cost ~17 ms a step on one H200 (Qwen3 shape, 12 layers, 2026-11-29). One rank pads to 8 (a few
    more graphs); several ranks keep 64, so that every rank's count agrees and their graphs' collectives pair up."""
    return DOCUMENT_MULTIPLE_ONE_RANK if world_size == 1 else DOCUMENT_MULTIPLE


def graph_blocker(*, device_type: str, world_size: int, moe_backend: str, attention: str | None, activation_checkpointing: str,
                  checkpoint_experts: bool, lora: bool, dtype: torch.dtype = torch.bfloat16, fsdp: bool = False,
                  ep_size: int = 1, static_exchange: bool = False, dropout: bool = False) -> str | None:
    """Why this run's micro-steps cannot be CUDA graphs, or None when they can (``dtype``: the compute dtype; ``fsdp``:
    whether FSDP wraps any part of the model, as it does on one GPU to cast weights kept in another dtype, and on
    several unless ``fsdp_wrap`` is "none"; ``static_exchange``: ``ep_capacity_factor`` > 0; ``dropout``: whether the
    training forward draws random numbers, ``activation_checkpointing.trains_with_dropout``). The scripts ask once with
    the settings alone (``attention`` None: not yet chosen), to refuse ``cuda_graphs true`` before any loading, and
    again once the model is parallelized.

    Several ranks: only at ep = world size (no FSDP on the experts), with the static exchange (the exact one sizes its
    all-to-all on the host) and the dense weights whole on every rank (``fsdp_wrap`` "none"); the graphs then hold the
    exchange's NCCL all-to-alls and the aux loss's all-reduces."""
    if device_type != "cuda":
        return "CUDA graphs need a GPU"
    if dtype != torch.bfloat16:
        return (f"{str(dtype).removeprefix('torch.')} compute: the experts run their per-expert loop, which reads the routed "
                "counts on the host (the grouped GEMMs take bf16)")
    if world_size != 1:
        if ep_size != world_size:
            return (f"{world_size} ranks at ep {ep_size}: FSDP shards the experts over dp, in hooks between the kernels; "
                    f"graphs on several GPUs need ep = world size ({world_size})")
        if not static_exchange:
            return ("the exact expert exchange sizes its all-to-all on the host at every layer; --ep_capacity_factor 2 "
                    "(the static exchange, moe/exchange_mode.py) allows graphs")
        if fsdp:
            return ("FSDP gathers and reduces the dense weights in hooks between the kernels; --fsdp_wrap none (dense weights "
                    "whole on every rank) with --optim adamw_bf16 allows graphs")
    elif fsdp:
        return ("FSDP casts the weights (kept in fp32 for the optimizer) in hooks that reallocate them at every forward; "
                "--optim adamw_bf16 keeps bf16 weights, which one GPU trains without FSDP")
    if moe_backend != "native":
        return f"moe_backend {moe_backend!r} reads routed counts on the host"
    if attention is not None and attention not in CAPTURABLE_ATTENTION:
        return (f"attention {attention!r} builds or checks its mask on the host; graphs take "
                f"{' or '.join(CAPTURABLE_ATTENTION)} (attn_implementation auto picks them for rows of whole documents or on bf16 GPUs)")
    recomputes = activation_checkpointing != "none" or checkpoint_experts
    if recomputes and dropout:
        return ("dropout under activation checkpointing: the recompute replays the forward's random state, which a graph "
                "capture cannot read; set the dropout to 0 (lora_dropout, the model's attention_dropout) or keep graphs off")
    if world_size > GRAPHS_WITH_RECOMPUTE_OR_LORA_RAN_ON_GPUS and (recomputes or lora):
        return (f"{'activation checkpointing' if recomputes else 'LoRA'} under graphs has run on "
                f"{GRAPHS_WITH_RECOMPUTE_OR_LORA_RAN_ON_GPUS} GPU so far, not yet on {world_size}")
    return None


def resolve_cuda_graphs(setting, blocker: str | None) -> tuple[bool, str]:
    """(on, the line the script prints) for the ``cuda_graphs`` setting ("auto", "true", "false" or a bool); "true"
    where a graph cannot run raises InputError saying why."""
    if str(setting).lower() == "segments":  # each layer's dense segment instead (train/segment_graphs.py)
        return False, "cuda_graphs segments: no whole micro-step graphs"
    flag = parse_bool(setting)
    if flag is None and str(setting).lower() != "auto":
        raise InputError(f"cuda_graphs={setting!r} is unknown; choose auto, true, segments or false")
    if flag is False:
        return False, "cuda_graphs false: every micro-step launched from Python"
    if blocker is None:
        return True, f"cuda_graphs {setting}: each micro-step replayed from a CUDA graph after the warm-up steps"
    if flag:
        raise InputError(f"cuda_graphs true: {blocker}; run with --cuda_graphs auto or false")
    return False, f"cuda_graphs auto: off ({blocker})"


def signature(batch: dict) -> tuple:
    """What a graph is captured for: every tensor's name, shape and dtype, and the model's other inputs."""
    parts = []
    for where, values in (("batch", batch), ("model", batch["model_inputs"])):
        for name, value in sorted(values.items()):
            if isinstance(value, torch.Tensor):
                parts.append((where, name, tuple(value.shape), value.dtype))
            elif where == "model":  # the batch's own numbers (attention_sq) are read outside the graph
                parts.append((where, name, value))
    return tuple(parts)


def zero_grads(params) -> None:
    """Every existing gradient set to zero in place (the graphs add into them), a multi-tensor kernel per dtype.
    torch's ``optimizer.zero_grad(set_to_none=False)`` refuses DTensor and plain gradients in one multi-tensor call."""
    groups = defaultdict(list)
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            groups[(grad.device, grad.dtype)].append(grad)
    for grads in groups.values():
        torch._foreach_zero_(grads)


class _Captured:
    """One captured micro-step: its input tensors by name (the graph reads them), its numbers (it writes them)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict, numbers: dict):
        self.graph, self.numbers = graph, numbers
        # A tensor the batch holds under two names (input_ids: the batch's and the model's) is copied in once.
        self.inputs = list({id(t): (name, t) for name, t in inputs.items()}.values())

    def replay(self, batch: dict) -> dict:
        given = _tensors(batch)
        for name, static in self.inputs:
            static.copy_(given[name])
        self.graph.replay()
        return self.numbers


def _tensors(batch: dict) -> dict:
    """The batch's tensors by name: ``batch.<key>`` and ``model.<key>`` (its model inputs), a shared tensor under both."""
    out = {f"batch.{k}": v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    out.update({f"model.{k}": v for k, v in batch["model_inputs"].items() if isinstance(v, torch.Tensor)})
    return out


def _static_batch(batch: dict) -> tuple[dict, dict]:
    """A copy of ``batch`` whose tensors the graph keeps (the same tensor shared where the batch shares one), and those
    tensors by name."""
    copies: dict[int, torch.Tensor] = {}

    def static(value):
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in copies:
            copies[id(value)] = value.clone()
        return copies[id(value)]

    out = {k: static(v) for k, v in batch.items() if k != "model_inputs"}
    out["model_inputs"] = {k: static(v) for k, v in batch["model_inputs"].items()}
    return out, _tensors(out)


class MicroStepGraphs:
    """Runs ``StepLoss`` micro-steps (forward, loss, backward) for ``model``: eagerly for ``warmup_steps`` steps, then
    from a CUDA graph per batch signature and place in the step (first micro-step or not). After each optimizer step
    the script calls ``zero_grads``."""

    def __init__(self, model: nn.Module, device: torch.device, warmup_steps: int = WARMUP_STEPS, announce=None):
        self.model, self.warmup_steps = model, warmup_steps
        self.announce = announce  # called with a line after each capture (the script's progress bar writes it)
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Captured] = {}
        self.loss_scale = torch.zeros((), dtype=torch.float32, device=device)  # 1 / the step's label tokens
        self.constants = None  # the StepLoss numbers baked into the graphs (micro-steps, aux coef, world size)
        self.written: set[int] = set()  # ids of the parameters whose gradient a first micro-step's graph writes whole

    def micro_step(self, step_loss, batch: dict, steps_done: int, first: bool) -> None:
        """One micro-batch's forward, loss and backward (``first``: the step's first); its numbers added to
        ``step_loss``'s sums."""
        if steps_done < self.warmup_steps:
            loss, _ = step_loss.micro_batch(self.model, batch)
            loss.backward()
            return
        constants = (step_loss.micro_steps, step_loss.aux_coef, step_loss.world_size)
        if self.constants not in (None, constants):
            raise RuntimeError(f"the CUDA graphs were captured for (micro-steps, aux coef, world size) {self.constants}, "
                               f"this step has {constants}; run with --cuda_graphs false")
        self.constants = constants
        # fp32's own reciprocal, as torch's CUDA division by a Python number computes it (StepLoss.loss_and_numbers)
        one, tokens = torch.tensor(1.0, dtype=torch.float32), torch.tensor(float(step_loss.label_tokens), dtype=torch.float32)
        self.loss_scale.fill_(float(one / tokens))  # on the host, in fp32
        key = (signature(batch), first)
        captured = self.graphs.get(key)
        if captured is None:
            numbers = self._capture(step_loss, batch, key, first)
        else:
            numbers = captured.replay(batch)
        step_loss.add(numbers, batch)

    def zero_grads(self) -> None:
        """After the optimizer step. Before any capture, gradients freed, as the eager steps do; after, zeroed in place
        (the graphs add into them), but for those that the first micro-step's graphs write whole."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not self.graphs:
            for p in params:
                p.grad = None
            return
        zero_grads(p for p in params if id(p) not in self.written)

    def release(self) -> None:
        """Free every captured graph once training is done, before the process group is destroyed: a graph that holds
        NCCL kernels (ep > 1) must not outlive its communicator. Suspected, not shown, to be why ep 2 and ep 4 graph
        runs on 4 x H200 (2026-11-27, fourteenth session) never exited after their last step: orphaned ranks holding
        60 GB that the next launch ran out of memory beside, and a GPU test whose launches never returned."""
        torch.cuda.synchronize()
        for captured in self.graphs.values():
            captured.graph.reset()
        self.graphs.clear()

    def _capture(self, step_loss, batch: dict, key: tuple, first: bool) -> dict:
        """This micro-step run eagerly on the side stream, then captured there (capturing runs nothing); its numbers."""
        start = time.perf_counter()
        inputs, by_name = _static_batch(batch)

        def forward_backward() -> dict:
            # A first micro-step writes the experts' gradients over (this step's zeroing skipped them)
            with gradients_written(self.written) if first else nullcontext():
                loss, numbers, _ = step_loss.loss_and_numbers(self.model, inputs, self.loss_scale)
                loss.backward()
            return numbers

        # A gradient made inside the capture would be the graph's own, rewritten (not added to) at every replay: every
        # one exists first, made here on the current stream from the blocks the eager steps' freed gradients left (made
        # by the side stream's run below they would take new memory beside those: the caching allocator keeps each
        # stream's blocks apart; 13 GiB more reserved at Mixtral's width, 4 layers, one H200). The eager steps' other
        # cached blocks are let go for the same reason.
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.cuda.empty_cache()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            numbers = forward_backward()  # its own tensors: the capture below allocates from the graph's pool
        graph = torch.cuda.CUDAGraph()
        # Several ranks: c10d's watchdog thread queries CUDA events while this thread captures; "thread_local" keeps
        # that legal (the default mode would fail the capture). One rank keeps the default.
        mode = "thread_local" if dist.is_initialized() and dist.get_world_size() > 1 else "global"
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode=mode):  # synchronizes and empties the cache first
                captured_numbers = forward_backward()
        except RuntimeError as e:  # e.g. a host sync in a model's forward that no check here knows of
            raise RuntimeError(f"cuda_graphs: capturing the micro-step failed ({str(e).splitlines()[0][:300]}); something in "
                               "this model's step reads the GPU from the host or allocates outside the graph; run with "
                               "--cuda_graphs false (and report the model)") from e
        torch.cuda.current_stream().wait_stream(self.stream)
        self.graphs[key] = _Captured(graph, by_name, captured_numbers)
        if self.announce is not None:
            self.announce(f"cuda_graphs: captured the {'first' if first else 'later'} micro-step in {time.perf_counter() - start:.1f} s "
                          f"(graph {len(self.graphs)}: one per input shape and place in the step; "
                          f"{torch.cuda.memory_reserved() / 2**30:.1f} GiB reserved)")
        return numbers
