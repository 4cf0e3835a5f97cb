"""Probe of the static exchange (megablocks_utils/moe/static_exchange.py) on GPUs, for the change that wires it into
the layer: what its fixed shapes cost and buy at Qwen3-30B-A3B's MoE layer, ep = the GPU count.

    source bench/device_env.sh
    torchrun --nproc_per_node=2 bench/static_exchange_probe.py --out bench/results/static_exchange_probe_2gpus.jsonl
    torchrun --nproc_per_node=2 bench/static_exchange_probe.py --smoke --out /tmp/probe.jsonl   # CPU, gloo, tiny

Each rank routes its own random tokens through one random router shared by the ranks (``--skews R``: a per-expert
logit offset, the same on every rank, sized so the busiest expert gets R times the mean load; 0: the router's own;
``--rank_skew S``: also an offset of its own on each rank, S standard deviations, as one rank's documents differ from
another's) and runs ``--layers`` MoE layers' expert parts in a row (route, dispatch, the exchange, the experts' grouped
GEMMs, combine; no router, no attention), forward and backward. One JSON record per measurement (rank 0 prints it
and appends it to --out), then a table:
  exact     the static exchange's outputs and gradients against ``exchange``'s, at a capacity nothing overflows
  time      ms per layer, forward + backward (wall, and GPU events; median of --iters, rank 0 and the slowest rank), of
            ``exchange`` and of ``static_exchange`` at each --factors capacity factor; how many timed routings overflowed;
            (CUDA) the peak memory allocated
  overflow  per --skews value and factor, over --draws routings: the share that overflows, and the capacity factor each
            routing needed (its busiest block over a peer's mean share: median, p90, max)
  sync      (CUDA) whether forward + backward sync with the host (torch.cuda.set_sync_debug_mode("error")), per path
  graph     (CUDA) whether the static path's forward, and forward + backward, capture in a torch.cuda.CUDAGraph with
            NCCL inside: replay against eager on new routings (bitwise equal?, ms), or the capture's error
``--smoke``: hidden 64, 8 experts, top-2, 64 tokens, fp32 on CPU ranks, through torch's grouped GEMM (it runs on CPU
too; the per-expert loop cannot take padded rows).
"""

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date, timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megablocks_utils.moe import experts as moe_experts  # noqa: E402
from megablocks_utils.moe.dispatch import combine, dispatch, exchange, route  # noqa: E402
from megablocks_utils.moe.layer import ExpertParallelExperts  # noqa: E402
from megablocks_utils.moe.static_exchange import static_capacity, static_exchange  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top_k", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768, help="each expert's width (moe_intermediate_size)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--layers", type=int, default=4, help="MoE layers in a row (the host can run ahead of the GPU across them)")
    p.add_argument("--factors", default="1.0,1.25,1.5,2.0", help="capacity factors: a block's rows over a peer's mean share")
    p.add_argument("--multiple", type=int, default=128, help="capacities rounded up to this many rows")
    p.add_argument("--skews", default="0,1.5,2.38", help="busiest expert's load over the mean for the overflow count; 0 = own")
    p.add_argument("--time_skew", type=float, default=0.0, help="the skew of the timed routings")
    p.add_argument("--rank_skew", type=float, default=0.0, help="each rank's own logit offset (standard deviations; 0: none)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--draws", type=int, default=200, help="routings per skew for the overflow count")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU ranks (gloo): that the probe runs")
    p.add_argument("--out", default="", help="append the records to this JSON-lines file")
    args = p.parse_args()
    if args.smoke:
        args.hidden, args.experts, args.top_k, args.intermediate, args.tokens = 64, 8, 2, 32, 64
        args.layers, args.multiple, args.skews, args.iters, args.warmup, args.draws = 2, 8, "0,2", 2, 1, 8
    return args


class Router:
    """One random router shared by the ranks; ``skew`` moves its logits by a fixed per-expert offset (a learned bias
    would) sized by bisection so that the busiest expert, over all ranks' tokens, gets ``skew`` times the mean."""

    def __init__(self, args, device, rank: int):
        generator = torch.Generator(device=device).manual_seed(0)
        self.weight = torch.randn(args.experts, args.hidden, device=device, generator=generator) / args.hidden**0.5
        self.direction = torch.randn(args.experts, device=device, generator=generator)
        own = torch.randn(args.experts, device=device, generator=torch.Generator(device=device).manual_seed(1 + rank))
        self.rank_offset = args.rank_skew * own
        self.offset = self.rank_offset.clone()
        self.args, self.device, self.rank = args, device, rank

    def draw(self, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's top-k experts and weights (softmax, renormalized, as Qwen3-MoE) for fresh random tokens."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(self.args.tokens, self.args.hidden, device=self.device, generator=generator)
        probs = torch.softmax(x @ self.weight.T + self.offset, dim=-1)
        top_w, top_i = probs.topk(self.args.top_k, dim=-1)
        return top_i, top_w / top_w.sum(-1, keepdim=True)

    def skew(self, target: float, seed: int) -> float:
        """Set the offset for ``target`` (0: none), on tokens drawn from ``seed`` (and the rank); returns the busiest
        expert's load over the mean reached."""
        self.offset.copy_(self.rank_offset)
        ratio = load_ratio(self.draw(seed + self.rank)[0], self.args.experts)
        if target <= 0 or ratio >= target:
            return ratio
        low, high = 0.0, 1.0
        while self._ratio_at(high, seed) < target and high < 1e3:
            high *= 2
        for _ in range(30):
            middle = (low + high) / 2
            low, high = (middle, high) if self._ratio_at(middle, seed) < target else (low, middle)
        return self._ratio_at(high, seed)

    def _ratio_at(self, scale: float, seed: int) -> float:
        self.offset.copy_(self.rank_offset + scale * self.direction)
        return load_ratio(self.draw(seed + self.rank)[0], self.args.experts)


def global_counts(top_i: torch.Tensor, experts: int) -> torch.Tensor:
    """[world, experts]: every rank's rows per expert."""
    flat = top_i.reshape(-1)
    counts = torch.zeros(experts, dtype=torch.int64, device=top_i.device).scatter_add_(0, flat, torch.ones_like(flat))
    gathered = [torch.empty_like(counts) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, counts)
    return torch.stack(gathered)


def load_ratio(top_i: torch.Tensor, experts: int) -> float:
    load = global_counts(top_i, experts).sum(0).float()
    return float(load.max() / load.mean())


def make_layers(args, ep: int, rank: int, device, dtype) -> list[ExpertParallelExperts]:
    """``--layers`` layers of this rank's experts (random weights in the compute dtype), as the model builds them."""
    local = args.experts // ep
    layers = []
    for layer in range(args.layers):
        generator = torch.Generator(device=device).manual_seed(1000 * layer + rank)
        experts = ExpertParallelExperts(args.experts, SimpleNamespace(ep_size=ep), "silu",
                                        compile_elementwise=device.type == "cuda")
        gate_up = torch.randn(local, 2 * args.intermediate, args.hidden, device=device, generator=generator) / args.hidden**0.5
        down = torch.randn(local, args.hidden, args.intermediate, device=device, generator=generator) / args.intermediate**0.5
        experts.set_weights(torch.nn.Parameter(gate_up.to(dtype)), torch.nn.Parameter(down.to(dtype)))
        # On CPU the weights' gradients go through autograd: adding into .grad in the GEMM is a GPU kernel.
        experts.weight_grads_in_gemm = device.type == "cuda"
        layers.append(experts)
    return layers


def run_layers(layers, x, routings, path: str, capacity: int | None):
    """The layers' expert parts in a row, forward: the output and the static path's overflow flags."""
    group = dist.group.WORLD
    flags = []
    for experts, (top_i, top_w) in zip(layers, routings):
        k, fuse = top_i.shape[1], experts.fuse_elementwise(x)
        r = route(top_i, experts.num_experts)
        routed = dispatch(x, r, k, fuse)
        if path == "exchange":
            out = exchange([routed], [r.counts], experts.ep_size, experts.num_local_experts, group, experts.compute)[0]
        else:
            out, overflow = static_exchange(routed, r.counts, experts.ep_size, experts.num_local_experts, group, experts.compute,
                                            capacity)
            flags.append(overflow)
        x = combine(out, r, top_w, x.dtype, fuse)
    return x, flags


def synchronize(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    args = parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=3), device_id=device if cuda else None)
    rank, ep = dist.get_rank(), dist.get_world_size()
    if args.experts % ep:
        raise SystemExit(f"--experts {args.experts} is not divisible by the {ep} ranks; launch a GPU count that divides it")
    if not cuda:
        moe_experts.grouped_mm_supported = lambda x: True  # torch's grouped GEMM runs on CPU too (fp32)
    dtype = torch.bfloat16 if cuda else torch.float32
    base = dict(device=torch.cuda.get_device_name() if cuda else "cpu", ep=ep, hidden=args.hidden, experts=args.experts,
                top_k=args.top_k, intermediate=args.intermediate, tokens=args.tokens, layers=args.layers, dtype=str(dtype),
                rank_skew=args.rank_skew,
                torch=torch.__version__, date=date.today().isoformat())
    records = []

    def keep(record: dict) -> None:
        record = {**base, **record}
        records.append(record)
        if rank == 0:
            print(json.dumps(record), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(record) + "\n")

    factors = [float(f) for f in args.factors.split(",")]
    capacities = {f: static_capacity(args.tokens, args.top_k, ep, f, args.multiple) for f in factors}
    no_overflow = static_capacity(args.tokens, args.top_k, ep, float(ep), args.multiple)
    router = Router(args, device, rank)
    layers = make_layers(args, ep, rank, device, dtype)
    generator = torch.Generator(device=device).manual_seed(rank)
    x0 = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype, generator=generator)
    dy = torch.randn_like(x0)

    def forward_backward(routings, path, capacity):
        for experts in layers:
            experts.gate_up_proj.grad = experts.down_proj.grad = None
        x = x0.detach().requires_grad_()
        y, flags = run_layers(layers, x, routings, path, capacity)
        y.backward(dy)
        return y.detach(), x.grad, [(e.gate_up_proj.grad, e.down_proj.grad) for e in layers], flags

    # exact: outputs and gradients equal to exchange's where nothing overflows.
    router.skew(args.time_skew, seed=10**6)
    routings = [router.draw(seed=10**6 + 97 * layer + rank) for layer in range(args.layers)]
    y, dx, dw, _ = forward_backward(routings, "exchange", None)
    y_s, dx_s, dw_s, flags = forward_backward(routings, "static", no_overflow)
    pairs = [(y, y_s), (dx, dx_s)] + [(a, b) for layer, layer_s in zip(dw, dw_s) for a, b in zip(layer, layer_s)]
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
    keep(dict(probe="exact", capacity=no_overflow, max_abs_diff=diff, equal=diff == 0.0,
              overflow=bool(torch.stack(flags).any())))

    # time: each path, the same routings (--time_skew), forward + backward of all layers.
    draws = [[router.draw(seed=7919 * i + 97 * layer + rank) for layer in range(args.layers)]
             for i in range(args.warmup + args.iters)]
    for path, factor in [("exchange", None)] + [("static", f) for f in factors]:
        capacity = capacities.get(factor)
        wall, gpu, overflowed = [], [], 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i, routings in enumerate(draws):
            synchronize(device)
            dist.barrier()
            start = time.perf_counter()
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            _, _, _, flags = forward_backward(routings, path, capacity)
            if cuda:
                end.record()
            synchronize(device)
            if i >= args.warmup:
                wall.append((time.perf_counter() - start) * 1e3 / args.layers)
                gpu.append(begin.elapsed_time(end) / args.layers if cuda else None)
                overflowed += bool(flags and torch.stack(flags).any())
        slowest = torch.tensor(statistics.median(wall), device=device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        keep(dict(probe="time", path=path, factor=factor, capacity=capacity, ms_per_layer_wall=statistics.median(wall),
                  ms_per_layer_wall_slowest_rank=float(slowest), ms_per_layer_gpu=statistics.median(gpu) if cuda else None,
                  overflowed=overflowed, timed=len(wall), skew=args.time_skew,
                  peak_allocated_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None))

    # overflow: how often each capacity overflows, and the factor each routing needed, per skew.
    share = args.tokens * args.top_k / ep
    for skew in [float(s) for s in args.skews.split(",")]:
        reached = router.skew(skew, seed=2 * 10**6)
        needed = []
        for d in range(args.draws):
            counts = global_counts(router.draw(seed=3 * 10**6 + 7919 * d + rank)[0], args.experts)  # [source, expert]
            needed.append(int(counts.view(ep, ep, -1).sum(-1).max()))  # the busiest (source, destination) block
        factors_needed = sorted(n / share for n in needed)
        for factor in factors:
            keep(dict(probe="overflow", skew=skew, skew_reached=reached, factor=factor, capacity=capacities[factor],
                      overflow_share=sum(n > capacities[factor] for n in needed) / len(needed), draws=len(needed),
                      needed_factor_p50=statistics.median(factors_needed),
                      needed_factor_p90=factors_needed[int(0.9 * (len(needed) - 1))], needed_factor_max=factors_needed[-1]))
    router.skew(args.time_skew, seed=10**6)

    if cuda:
        probe_sync(keep, forward_backward, draws[0], capacities[max(factors)])
        for backward in (False, True):
            probe_graph(keep, layers, x0, dy, draws, capacities[max(factors)], backward)
    dist.barrier()
    if rank == 0:
        print_table(records)
    dist.destroy_process_group()


def probe_sync(keep, forward_backward, routings, capacity) -> None:
    """Whether each path's forward + backward syncs with the host: torch.cuda.set_sync_debug_mode("error") raises on
    the first sync (exchange's count read is one: the control)."""
    for path in ("exchange", "static"):
        error = ""
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            forward_backward(routings, path, capacity)
        except RuntimeError as e:
            error = str(e).splitlines()[0][:300]
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        dist.barrier()
        keep(dict(probe="sync", path=path, capacity=capacity if path == "static" else None, synced=bool(error), error=error))


def probe_graph(keep, layers, x0, dy, draws, capacity: int, backward: bool) -> None:
    """The static path's forward (with ``backward``: and backward, the input's gradient out) captured in a CUDA graph on
    fixed input buffers; replayed on new routings and compared with eager on the same inputs."""
    record = dict(probe="graph", backward=backward, capacity=capacity)
    x = x0.detach().clone().requires_grad_(backward)
    routings = [(top_i.clone(), top_w.clone()) for top_i, top_w in draws[0]]

    def step():
        y, flags = run_layers(layers, x, routings, "static", capacity)
        outs = [y, torch.stack(flags).any()]
        if backward:
            outs.append(torch.autograd.grad(y, x, dy)[0])
        return outs

    def load(i: int) -> None:
        with torch.no_grad():
            for (top_i, top_w), (new_i, new_w) in zip(routings, draws[i % len(draws)]):
                top_i.copy_(new_i)
                top_w.copy_(new_w)

    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up off the default stream, as capture wants (compiles, NCCL communicators)
                step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: c10d's watchdog thread may query CUDA while this thread captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            captured = step()
    except Exception as e:  # noqa: BLE001 (the probe's answer is the error)
        keep({**record, "captured": False, "error": f"{type(e).__name__}: {str(e)[:1500]}"})
        torch.cuda.synchronize()
        dist.barrier()
        return
    equal, replay_ms, eager_ms = True, [], []
    for i in range(1, 11):
        load(i)
        start = time.perf_counter()
        graph.replay()
        torch.cuda.synchronize()
        replay_ms.append((time.perf_counter() - start) * 1e3)
        replayed = [t.clone() for t in captured]
        dist.barrier()
        start = time.perf_counter()
        eager = step()
        torch.cuda.synchronize()
        eager_ms.append((time.perf_counter() - start) * 1e3)
        equal &= all(torch.equal(a, b) for a, b in zip(replayed, eager))
        dist.barrier()
    keep({**record, "captured": True, "replay_equal": equal, "replay_ms_per_layer": statistics.median(replay_ms) / len(layers),
          "eager_ms_per_layer": statistics.median(eager_ms) / len(layers)})


SHAPE_FIELDS = ("device", "hidden", "experts", "top_k", "intermediate", "tokens", "layers", "dtype", "torch", "date", "rank_skew")


def print_table(records: list[dict]) -> None:
    exchange_ms = next((r["ms_per_layer_wall"] for r in records if r["probe"] == "time" and r["path"] == "exchange"), None)
    print("\n| path | factor | capacity | ms/layer wall (slowest rank) | ms/layer GPU | overflowed | with reruns (est.) | peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in (r for r in records if r["probe"] == "time"):
        share = r["overflowed"] / r["timed"]
        rerun = r["ms_per_layer_wall"] + share * exchange_ms if r["path"] == "static" else r["ms_per_layer_wall"]
        gpu = f"{r['ms_per_layer_gpu']:.3f}" if r["ms_per_layer_gpu"] is not None else "-"
        peak = f"{r['peak_allocated_gib']:.1f}" if r["peak_allocated_gib"] is not None else "-"
        print(f"| {r['path']} | {r['factor'] or '-'} | {r['capacity'] or '-'} | {r['ms_per_layer_wall']:.3f} "
              f"({r['ms_per_layer_wall_slowest_rank']:.3f}) | {gpu} | {r['overflowed']}/{r['timed']} | {rerun:.3f} | {peak} |")
    print("\n| skew (reached) | factor | overflow share | needed factor p50 / p90 / max |")
    print("|---|---|---|---|")
    for r in (r for r in records if r["probe"] == "overflow"):
        print(f"| {r['skew']} ({r['skew_reached']:.2f}) | {r['factor']} | {r['overflow_share']:.3f} | "
              f"{r['needed_factor_p50']:.3f} / {r['needed_factor_p90']:.3f} / {r['needed_factor_max']:.3f} |")
    for r in (r for r in records if r["probe"] in ("exact", "sync", "graph")):
        print(json.dumps({k: v for k, v in r.items() if k not in SHAPE_FIELDS}))


if __name__ == "__main__":
    main()
