"""Probe of the next lever at ep > 1 (issue #40): the dense segment between two MoE layers replayed from CUDA graphs,
the MoE part launched from Python as today. At ep 4 the forward is paced by the host (~5 ms of launches per layer behind
each layer's count read; bench/reports/ep_levers_h200_2026-11-27e.md); the segment (the layer's input norm, attention,
residual and post-attention norm) has fixed shapes and no host sync, so it can be one graph each way.

    source bench/device_env.sh
    torchrun --nproc_per_node=4 bench/segment_graphs_probe.py --out bench/results/segment_graphs_probe_4gpus.jsonl
    torchrun --nproc_per_node=2 bench/segment_graphs_probe.py --smoke --out /tmp/probe.jsonl   # CPU, gloo, eager only

The model: ``--shape`` with ``--layers`` layers (bench/real_data.py's random checkpoint, written once), loaded as
train_fsdp2.py loads it (ep = the rank count), dense weights whole on every rank (``fsdp_wrap none``: FSDP would move
their addresses each step), attention and norms compiled (``compile_dense``). Each micro-step: one row of ``--seq``
random tokens per rank through the decoder stack (no loss head: the mean square of the final norm's output), forward
and backward. Three ways, the same code but for the segments:
  eager    every segment launched from Python (today's forward, bar FSDP)
  graphed  each layer's segment through ``torch.cuda.make_graphed_callables`` (forward and backward graphs): what
           ``cuda_graphs segments`` does in training (train/segment_graphs.py)
  graphed_routed  the segment and the MoE block's part before its count read (router, route, dispatch:
           ``ExpertParallelMoE.before_exchange``) in one graph each way, the rest eager (``exchange`` and ``combine``, as
           the layer's exact exchange with its tokens whole): what extending the segments that far would buy (the MoE
           block's launches pace the forward after them). Blocks without a shared expert only.
One JSON record per way (rank 0 appends it to --out): ms per micro-step (wall, median of --iters), the forward's host
ms per layer, the forward's GPU ms (CUDA events); one of the probe's stack against the model's own forward, and one of
the graphed micro-step against the eager one (max abs difference of the stack's output and of a dense gradient).
Nothing here changes the training scripts.
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date, timedelta

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.model.architectures import decoder_layers  # noqa: E402
from megablocks_utils.model.attention import choose_attention  # noqa: E402
from megablocks_utils.model.build import load_model  # noqa: E402
from megablocks_utils.parallel.parallelize import parallelize  # noqa: E402


class DenseSegment(nn.Module):
    """A decoder layer up to its MoE block: ``h -> (h + attention(norm(h)), post_norm(h + ...))``. Only these three
    modules are children, so the graphs' backward asks for their parameters' gradients and no others."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attn = layer.self_attn
        self.post_attention_layernorm = layer.post_attention_layernorm

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        attended = self.self_attn(hidden_states=self.input_layernorm(h), position_embeddings=(cos, sin), attention_mask=None)[0]
        h = h + attended
        return h, self.post_attention_layernorm(h)


class RoutedSegment(DenseSegment):
    """``DenseSegment`` and the MoE block up to its exchange (``ExpertParallelMoE.before_exchange``: router probabilities,
    top-k weights and experts, the route's four tensors, the routed rows), what ``cuda_graphs segments`` captures with
    ``ROUTE_IN_GRAPH`` on. The router is a child (its weight a graph input), the experts are not (the rows' exchange and
    the experts run eagerly: ``rest``, the block's ``after_exchange``)."""

    def __init__(self, layer: nn.Module):
        super().__init__(layer)
        self.router = layer.mlp.top_k_router
        self._block = [layer.mlp]  # in a list: not a child

    def forward(self, h, cos, sin):
        h, normed = super().forward(h, cos, sin)
        return (h, *self._block[0].before_exchange(normed.reshape(-1, normed.shape[-1])))

    def rest(self, outputs, shape) -> torch.Tensor:
        """The MoE block's output from ``forward``'s outputs."""
        return self._block[0].after_exchange(shape, outputs[1:])


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3_30b_a3b", help="bench/real_data.py's SHAPES (decoder layers with input_layernorm, "
                   "self_attn, post_attention_layernorm and mlp)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=4096, help="tokens per rank per micro-step")
    p.add_argument("--iters", type=int, default=10, help="timed micro-steps per way, after --warmup")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dir", default="", help="the checkpoint (written if missing); default /tmp/<shape>-L<layers>")
    p.add_argument("--out", default="bench/results/segment_graphs_probe.jsonl")
    p.add_argument("--smoke", action="store_true", help="CPU ranks (gloo), the shape shrunk, fp32, eager only")
    return p.parse_args()


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=10), device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    directory = args.dir or f"/tmp/{args.shape}-L{args.layers}{'-shrunk' if args.smoke else ''}"
    if rank == 0:
        from real_data import write_checkpoint  # bench/ is on the path when run as bench/segment_graphs_probe.py

        write_checkpoint(directory, args.shape, args.layers, shrink=args.smoke)
    dist.barrier()
    dtype = torch.bfloat16 if cuda else torch.float32
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory)
    attention = choose_attention("auto", config, device.type, masked=False, dtype=dtype)[0]
    model, mesh = load_model(directory, world, device=device, dtype=dtype, attn_implementation=attention)
    parallelize(model, mesh, param_dtype=dtype, compile_dense=cuda, fsdp_wrap="none", device=device)
    model.train()
    layers, stack = decoder_layers(model), model.model
    segments = [DenseSegment(layer) for layer in layers]
    seq, hidden = args.seq, config.hidden_size
    positions = torch.arange(seq, device=device)[None]
    records = []

    def keep(record: dict) -> None:
        record = {"probe": "segment_graphs", "shape": args.shape, "layers": args.layers, "seq": args.seq, "ep": world,
                  "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                  "date": str(date.today()), **record}
        records.append(record)
        if rank == 0:
            print(json.dumps(record), flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(record) + "\n")

    def tokens(seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1000 + rank)
        return torch.randint(0, config.vocab_size, (1, seq), generator=g).to(device)

    def forward(segs, ids) -> torch.Tensor:
        """The decoder stack as the model runs it, with each layer's part before its MoE block (or before its exchange:
        ``RoutedSegment``) as ``segs``."""
        h = stack.embed_tokens(ids)
        cos, sin = stack.rotary_emb(h, positions)
        for layer, segment in zip(layers, segs):
            outputs = segment(h, cos, sin)
            if len(outputs) == 2:
                h, normed = outputs
                moe = layer.mlp(normed)
            else:
                moe = segment.rest(outputs, h.shape)  # RoutedSegment: the block keeps the layer input's shape
                h = outputs[0]
            h = h + (moe[0] if isinstance(moe, tuple) else moe)
        return stack.norm(h)

    def micro_step(segs, ids, timings: dict | None = None) -> torch.Tensor:
        """Forward and backward of the stack; returns the stack's output (detached). ``timings`` gets the forward's host
        seconds and, on CUDA, its start and end events."""
        start = time.perf_counter()
        if timings is not None and cuda:
            timings["start"] = torch.cuda.Event(enable_timing=True)
            timings["start"].record()
        out = forward(segs, ids)
        loss = out.float().pow(2).mean()
        if timings is not None:
            timings["host_s"] = time.perf_counter() - start
            if cuda:
                timings["end"] = torch.cuda.Event(enable_timing=True)
                timings["end"].record()
        loss.backward()
        return out.detach()

    def timed(way: str, segs) -> None:
        for i in range(args.warmup):
            micro_step(segs, tokens(i))
            model.zero_grad(set_to_none=True)
        walls, hosts, gpus = [], [], []
        for i in range(args.iters):
            timings = {}
            synchronize(device)
            start = time.perf_counter()
            micro_step(segs, tokens(100 + i), timings)
            synchronize(device)
            walls.append(time.perf_counter() - start)
            hosts.append(timings["host_s"])
            if cuda:
                gpus.append(timings["start"].elapsed_time(timings["end"]) / 1e3)
            model.zero_grad(set_to_none=True)
        keep({"way": way, "micro_step_ms": round(1e3 * statistics.median(walls), 2),
              "forward_host_ms_per_layer": round(1e3 * statistics.median(hosts) / args.layers, 3),
              "forward_gpu_ms": round(1e3 * statistics.median(gpus), 2) if gpus else None,
              "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None})

    # The routed way where every MoE block is the native one with the exact exchange and no shared expert.
    routable = all(getattr(layer.mlp, "shared_expert_attr", "") is None and type(layer.mlp.experts).__name__ == "ExpertParallelExperts"
                   and layer.mlp.experts.exchange_mode is None and layer.mlp.experts.overlap_chunks == 1 for layer in layers)
    routed_segments = [RoutedSegment(layer) for layer in layers] if routable and world > 1 else None
    with torch.no_grad():  # the probe's stacks are the model's: the same output as its own forward
        ids = tokens(7)
        own = stack(input_ids=ids).last_hidden_state
        keep({"way": "stack_vs_model", "output_max_abs_diff": (forward(segments, ids) - own).abs().max().item()})
        if routed_segments is not None:
            keep({"way": "routed_stack_vs_model", "output_max_abs_diff": (forward(routed_segments, ids) - own).abs().max().item()})
    probe_grad = segments[0].self_attn.o_proj.weight
    reference = micro_step(segments, tokens(7))
    reference_grad = probe_grad.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    timed("eager", segments)
    for way, segs in (("graphed", segments), ("graphed_routed", routed_segments)):
        if segs is None:
            keep({"way": way, "skipped": "a shared expert, the megablocks backend, the static exchange, chunks or ep 1"})
            continue
        if not cuda:
            keep({"way": way, "skipped": "make_graphed_callables needs CUDA"})
            continue
        h = torch.randn(1, seq, hidden, device=device, dtype=dtype)
        cos, sin = stack.rotary_emb(h, positions)
        samples = tuple((h.clone().requires_grad_(), cos.clone(), sin.clone()) for _ in segs)
        try:
            graphed = torch.cuda.make_graphed_callables(tuple(segs), samples)
        except Exception as e:  # a probe reports why it could not capture, and keeps the eager record
            keep({"way": way, "error": f"{type(e).__name__}: {str(e)[:400]}"})
            continue
        model.zero_grad(set_to_none=True)
        out = micro_step(graphed, tokens(7))
        keep({"way": f"{way}_vs_eager", "output_max_abs_diff": (out.float() - reference.float()).abs().max().item(),
              "grad_max_abs_diff": (probe_grad.grad.float() - reference_grad.float()).abs().max().item()})
        model.zero_grad(set_to_none=True)
        timed(way, graphed)
    if rank == 0:
        ways = {r["way"]: r for r in records if "micro_step_ms" in r}
        for way in ("graphed", "graphed_routed"):
            if {"eager", way} <= ways.keys():
                print(f"{way} segments: micro-step {ways[way]['micro_step_ms']} ms against {ways['eager']['micro_step_ms']} "
                      f"ms eager; forward host per layer {ways[way]['forward_host_ms_per_layer']} against "
                      f"{ways['eager']['forward_host_ms_per_layer']} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
