"""Can a rank read its peers' rows straight from their GPU memory, and how fast? (issue #40, nineteenth session)

torchrun --nproc_per_node=N bench/symm_pull_probe.py [--rows 32768 --hidden 2048 --repeats 20]

On symmetric memory (torch.distributed._symmetric_memory: one buffer a rank, each mapped into every rank's address
space): (1) every rank writes its rank into its buffer, a device barrier, and each reads every peer's first value;
(2) ``moe/pull_kernel.pull_rows`` reads rows scattered over all ranks' buffers, checked against the same rows all-gathered
by NCCL; (3) its time against NCCL's all-to-all of the same bytes (equal splits: the best case for NCCL); (4) copy in,
barrier and pull captured in one CUDA graph, replayed on new data and checked. Prints one JSON line per rank 0 result.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from megablocks_utils.moe.pull_kernel import pull_rows


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    group = dist.group.WORLD
    n, h = args.rows, args.hidden
    out = {"world": world, "rows": n, "hidden": h, "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}

    buf = symm_mem.empty(n, h, dtype=torch.bfloat16, device=device)
    handle = symm_mem.rendezvous(buf, group.group_name)
    peers = [handle.get_buffer(r, (n, h), torch.bfloat16) for r in range(world)]
    table = torch.tensor([t.data_ptr() for t in peers], dtype=torch.int64, device=device)
    buf.fill_(rank)
    handle.barrier(channel=0)
    seen = [int(peers[r][0, 0].item()) for r in range(world)]
    out["peer_values_ok"] = seen == list(range(world))

    # (2) rows scattered over the ranks: row i from rank i % world... shuffled, some zero rows.
    gen = torch.Generator(device="cpu").manual_seed(rank)
    buf.copy_(torch.randn(n, h, generator=gen).to(torch.bfloat16))
    handle.barrier(channel=0)
    src_rank = torch.randint(0, world, (n,), generator=gen).to(torch.int32).to(device)
    src_row = torch.randint(0, n, (n,), generator=gen).to(torch.int32)
    src_row[torch.rand(n, generator=gen) < 0.05] = -1
    src_row = src_row.to(device)
    got = pull_rows(table, src_rank, src_row, torch.empty(n, h, dtype=torch.bfloat16, device=device))
    everyone = torch.empty(world, n, h, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(everyone, buf, group=group)
    want = everyone[src_rank.long(), src_row.clamp(min=0).long()] * (src_row >= 0).unsqueeze(-1)
    out["pull_exact"] = bool(torch.equal(got, want))
    handle.barrier(channel=0)

    # (3) time: each rank pulls n rows, its own share (1/world) local, the rest from peers in contiguous runs.
    per = n // world
    runs_rank = torch.arange(world, device=device).repeat_interleave(per).to(torch.int32)
    runs_row = (torch.arange(world * per, device=device) % per + rank * per).to(torch.int32)
    target = torch.empty(world * per, h, dtype=torch.bfloat16, device=device)
    out["pull_ms"] = timed(lambda: pull_rows(table, runs_rank, runs_row, target), args.repeats)
    # The kernel's choices of columns per step and warps per program (pull_kernel.BLOCK_COLUMNS, WARPS: the default).
    for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (512, 2)):
        out[f"pull_ms_{block}x{warps}"] = timed(lambda: pull_rows(table, runs_rank, runs_row, target, block, warps), args.repeats)
    send = torch.randn(world * per, h, device=device).to(torch.bfloat16)
    recv = torch.empty_like(send)
    out["nccl_all_to_all_ms"] = timed(lambda: dist.all_to_all_single(recv, send, group=group), args.repeats)
    out["copy_in_ms"] = timed(lambda: buf[: world * per].copy_(send), args.repeats)
    out["barrier_ms"] = timed(lambda: handle.barrier(channel=0), args.repeats)
    out["pull_GBps_remote"] = (world - 1) * per * h * 2 / out["pull_ms"] / 1e6

    # (4) copy in, barrier, pull in one CUDA graph; replayed on new data.
    source = torch.empty(n, h, dtype=torch.bfloat16, device=device)
    pulled = torch.empty(world * per, h, dtype=torch.bfloat16, device=device)

    def step():
        buf.copy_(source)
        handle.barrier(channel=0)
        pull_rows(table, runs_rank, runs_row, pulled)
        handle.barrier(channel=1)

    source.fill_(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            step()
        ok = True
        for trial in range(3):
            source.copy_(torch.full((n, h), rank * 10 + trial, dtype=torch.bfloat16, device=device))
            graph.replay()
            torch.cuda.synchronize()
            expect = torch.arange(world, device=device).repeat_interleave(per).to(torch.bfloat16) * 10 + trial
            ok = ok and bool(torch.equal(pulled[:, 0], expect))
        out["graph_ok"] = ok
        out["graph_step_ms"] = timed(graph.replay, args.repeats)
    except Exception as e:  # noqa: BLE001 - the probe reports what failed
        out["graph_error"] = repr(e)[:300]
    results = [None] * world
    dist.all_gather_object(results, out)
    if rank == 0:
        for r in results:
            print(json.dumps(r))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
