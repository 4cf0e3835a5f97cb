"""CPU dry run of tests/gpu/test_megablocks.py's checks: megablocks' real Python code, its kernels replaced by torch.

    torchrun --standalone --nproc_per_node=2 bench/megablocks_fake_kernels.py /path/to/sdists

megablocks cannot run without CUDA, so this checks everything around its kernels on a CPU: the
``ParallelDroplessMLP`` orchestration from the megablocks 0.10.0 source distribution (routing bins,
expert-parallel all-to-all over our ep group, regrouping), our ``MegablocksExperts`` plumbing (the
weight mapping, ``gmm``'s arguments, gradients) and the check script's own logic. Faked with torch:
megablocks' CUDA extension (sort, histogram, cumsum, replicate), its two Triton kernels used on the
grouped path (gather, scatter), grouped_gemm's ``gmm`` (with its contiguity and host-size checks), and
``triton`` itself (only so that megablocks and stk import). On CPU the experts' bf16 GEMMs would run
as the per-expert loop; here ``gmm`` is forced so that its call is exercised too.
The sdists folder holds megablocks-0.10.0.tar.gz and stanford_stk-0.7.1.tar.gz (docs/megablocks.md).
"""

import importlib.metadata
import os
import sys
import tarfile
import tempfile
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # tests/gpu/test_megablocks.py holds the checks


def unpack(sdists: str) -> None:
    where = tempfile.mkdtemp(prefix="megablocks_src_")
    for name in ("megablocks-0.10.0", "stanford_stk-0.7.1"):
        with tarfile.open(os.path.join(sdists, f"{name}.tar.gz")) as tar:
            tar.extractall(where, filter="data")
        sys.path.insert(0, os.path.join(where, name))


def fake_triton() -> types.ModuleType:
    def passthrough(*args, **kwargs):
        return args[0] if args and callable(args[0]) else (lambda fn: fn)

    class Anything:
        def __getattr__(self, name):
            return Anything()

        def __call__(self, *args, **kwargs):
            return Anything()

    triton = types.ModuleType("triton")
    triton.__version__ = "fake"
    triton.jit = triton.autotune = triton.heuristics = passthrough
    triton.Config = lambda *args, **kwargs: None
    language = types.ModuleType("triton.language")
    language.__getattr__ = lambda name: Anything()
    triton.language = language
    return triton


def fake_megablocks_ops() -> types.ModuleType:
    ops = types.ModuleType("megablocks_ops")

    def sort(x, end_bit, x_out, iota_out):
        values, order = torch.sort(x, stable=True)
        x_out.copy_(values)
        iota_out.copy_(order.to(iota_out.dtype))

    def replicate_forward(x, bins, out):
        counts = torch.diff(bins.long(), prepend=bins.new_zeros(1).long())
        out.copy_(torch.repeat_interleave(x, counts, dim=1))

    ops.sort = sort
    ops.histogram = lambda x, n: torch.bincount(x.long().flatten(), minlength=n).to(torch.int32)
    ops.inclusive_cumsum = lambda x, dim, out: out.copy_(torch.cumsum(x, dim))
    ops.exclusive_cumsum = lambda x, dim, out: out.copy_(torch.cumsum(x, dim) - x)
    ops.replicate_forward = replicate_forward
    return ops


def fake_grouped_gemm() -> types.ModuleType:
    def gmm(a, b, batch_sizes, trans_b=False):
        assert batch_sizes.device.type == "cpu" and batch_sizes.dtype == torch.int64, "grouped_gemm wants host int64 sizes"
        assert a.is_contiguous() and b.is_contiguous(), "grouped_gemm checks contiguity"
        assert a.dim() == 2 and b.dim() == 3 and b.shape[0] == len(batch_sizes) and int(batch_sizes.sum()) == a.shape[0]
        rows = torch.split(a, batch_sizes.tolist())
        return torch.cat([r @ (b[e].T if trans_b else b[e]) for e, r in enumerate(rows)])

    package = types.ModuleType("grouped_gemm")
    package.ops = types.ModuleType("grouped_gemm.ops")
    package.ops.gmm = gmm
    package.backend = types.ModuleType("grouped_gemm.backend")  # megablocks' grouped_gemm_util reads it at import
    return package


def install_fakes() -> None:
    import torch._dynamo  # noqa: F401  (torch looks for triton itself; it must not find the fake one)
    import transformers.models.mixtral.modeling_mixtral  # noqa: F401

    sys.modules["triton"] = fake_triton()
    sys.modules["triton.language"] = sys.modules["triton"].language
    sys.modules["megablocks_ops"] = fake_megablocks_ops()
    sys.modules["grouped_gemm"] = fake_grouped_gemm()
    sys.modules["grouped_gemm.ops"] = sys.modules["grouped_gemm"].ops
    import megablocks.layers.dmoe  # noqa: F401
    import megablocks.ops as ops

    def gather(x, indices, bin_ids, bins, top_k):  # row i of the output = token indices[i] // top_k
        return x[indices.long() // top_k]

    def scatter(x, indices, bin_ids, weights, bins, top_k):  # the inverse, weighted, summed over the k copies
        index = indices.long()
        rows = x if weights is None else x * weights[index].unsqueeze(-1).to(x.dtype)
        out = torch.zeros(index.numel(), x.shape[1], dtype=x.dtype).index_copy(0, index, rows)
        return out.view(-1, top_k, x.shape[1]).sum(1)

    ops.gather, ops.scatter = gather, scatter

    from megablocks_utils.model import build as shard
    from megablocks_utils.moe import megablocks_backend
    from megablocks_utils.moe.layer import ExpertParallelExperts

    shard.check_megablocks = lambda device_type=None: None  # it refuses CPU runs, rightly

    def compute(self, x, counts, counts_host):  # MegablocksExperts.compute without its CUDA/bf16 test
        if self.local.force_loop:
            return ExpertParallelExperts.compute(self, x, counts, counts_host)
        w_gate_up, w_down = self._local_weights(x.dtype)
        gmm = sys.modules["grouped_gemm.ops"].gmm
        batch_sizes = torch.tensor(counts_host, dtype=torch.int64)
        gate, up = gmm(x, w_gate_up, batch_sizes, trans_b=True).chunk(2, dim=-1)
        return gmm(self.local.act_fn(gate) * up, w_down, batch_sizes, trans_b=True)

    megablocks_backend.MegablocksExperts.compute = compute
    importlib.metadata.version = lambda name: "fake"


def main() -> None:
    import torch.distributed as dist

    unpack(sys.argv[1])
    install_fakes()
    from gpu.test_megablocks import (  # the GPU test's checks, on CPU ranks
        equivalence,
        experts_alone,
    )

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failed = []
    for check in (experts_alone, equivalence):
        for label, ok, detail in check(rank, world, device="cpu"):
            if rank == 0:
                print(f"{'ok  ' if ok else 'FAIL'} {label}: {detail}", flush=True)
            if not ok:
                failed.append(label)
    if rank == 0:
        print("all checks passed" if not failed else "FAILED: " + ", ".join(failed), flush=True)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
