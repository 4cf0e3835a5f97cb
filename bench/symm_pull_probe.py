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
import triton
import triton.language as tl

from megablocks_utils.moe.pull_kernel import pull_rows


# Variants tried against pull_kernel.pull_rows (twentieth session): several rows a program (more loads in flight), and
# the push (each rank stores its rows into the receivers' buffers: remote stores, local loads).
@triton.jit
def _pull_many_kernel(table_ptr, src_rank_ptr, src_row_ptr, out_ptr, N, H, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    inside = rows < N
    rank = tl.load(src_rank_ptr + rows, mask=inside, other=0)
    src = tl.load(src_row_ptr + rows, mask=inside, other=-1).to(tl.int64)
    base = tl.load(table_ptr + rank).to(tl.pointer_type(out_ptr.dtype.element_ty))
    cols = tl.arange(0, BLOCK_H)
    values = tl.load(base[:, None] + tl.maximum(src, 0)[:, None] * H + cols[None, :], mask=(src >= 0)[:, None], other=0.0)
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], values, mask=inside[:, None])


def pull_many(table, src_rank, src_row, out, rows_per_program, warps):
    n, h = out.shape
    _pull_many_kernel[(triton.cdiv(n, rows_per_program),)](table, src_rank, src_row, out, n, h, ROWS=rows_per_program,
                                                          BLOCK_H=h, num_warps=warps)
    return out


@triton.jit
def _push_kernel(table_ptr, dst_rank_ptr, dst_row_ptr, src_ptr, H, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rank = tl.load(dst_rank_ptr + row)
    dst = tl.load(dst_row_ptr + row).to(tl.int64)
    base = tl.load(table_ptr + rank).to(tl.pointer_type(src_ptr.dtype.element_ty))
    writable = tl.where(dst >= 0, H, 0)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        values = tl.load(src_ptr + row * H + cols, mask=cols < writable)
        tl.store(base + tl.maximum(dst, 0) * H + cols, values, mask=cols < writable)


def push_rows(table, dst_rank, dst_row, src, block=2048, warps=8):
    n, h = src.shape
    _push_kernel[(n,)](table, dst_rank, dst_row, src, h, BLOCK_H=min(block, triton.next_power_of_2(h)), num_warps=warps)


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
    for rows_per_program, warps in ((2, 8), (4, 8), (4, 16), (8, 16)):
        out[f"pull_many_ms_{rows_per_program}x{warps}"] = timed(
            lambda: pull_many(table, runs_rank, runs_row, target, rows_per_program, warps), args.repeats)
    check = pull_many(table, runs_rank, runs_row, torch.empty_like(target), 4, 8)
    out["pull_many_exact"] = bool(torch.equal(check, pull_rows(table, runs_rank, runs_row, torch.empty_like(target))))
    # Padding: a pull into a 3x larger buffer whose extra rows are zeros (what capacity factor 3 costs each pull).
    pad_rank = torch.cat([runs_rank, torch.zeros(2 * world * per, dtype=torch.int32, device=device)])
    pad_row = torch.cat([runs_row, torch.full((2 * world * per,), -1, dtype=torch.int32, device=device)])
    padded = torch.empty(3 * world * per, h, dtype=torch.bfloat16, device=device)
    out["pull_padded_3x_ms"] = timed(lambda: pull_rows(table, pad_rank, pad_row, padded), args.repeats)
    # The push: my row i of rank r's share goes to rank r, row (my rank) * per + i: the same bytes as the pull above.
    mine = torch.randn(world * per, h, device=device).to(torch.bfloat16)
    push_rank = torch.arange(world, device=device).repeat_interleave(per).to(torch.int32)
    push_row = (torch.arange(world * per, device=device) % per + rank * per).to(torch.int32)
    handle.barrier(channel=0)
    push_rows(table, push_rank, push_row, mine)
    handle.barrier(channel=0)
    everyone_mine = torch.empty(world, world * per, h, dtype=torch.bfloat16, device=device)
    dist.all_gather_into_tensor(everyone_mine, mine, group=group)
    expect = everyone_mine[:, rank * per:(rank + 1) * per].reshape(world * per, h)
    out["push_exact"] = bool(torch.equal(buf[: world * per], expect))
    handle.barrier(channel=0)
    out["push_ms"] = timed(lambda: push_rows(table, push_rank, push_row, mine), args.repeats)
    out["push_ms_4096x16"] = timed(lambda: push_rows(table, push_rank, push_row, mine, 4096, 16), args.repeats)
    out["push_ms_1024x4"] = timed(lambda: push_rows(table, push_rank, push_row, mine, 1024, 4), args.repeats)
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
