"""The gathers' Triton kernels (``moe/gather_kernels.py``) on CPU, through Triton's interpreter, wired as the layer uses
them (``dispatch`` and ``combine`` with ``fuse``): the dispatch's gather-sum backward and the combine's forward and
backward against the eager functions CPU runs use, for token counts down to 0, k in {1, 2, 3, 8}, widths that end
mid-block, int64 and int32 row indices. fp32 is compared exactly where the kernels promise the eager order of sums;
bf16 and fp16 within one ulp (the interpreter truncates where a GPU rounds to nearest).

The interpreter is switched on when Triton is imported (``TRITON_INTERPRET=1``), so the kernels run in one child
process (this file as a script) and each test asserts one claim on its JSON report. Triton is not in
requirements-test.txt installs it (CPU torch does not bring it); without it these tests skip, and tests/gpu/test_gather_kernels.py
checks the same kernels on a GPU.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None,
    reason="needs triton (its CPU interpreter runs the kernels; requirements-test.txt installs it); "
    "tests/gpu/test_gather_kernels.py covers the kernels on a GPU",
)

# (tokens, k, hidden): one token, k = 1, widths that are not a power of two or end mid-block (forward blocks of up
# to 2048 columns, backward blocks of 4096 / k rounded up to a power of two), no tokens at all.
SHAPES = [(1, 1, 1), (5, 1, 33), (7, 2, 300), (6, 3, 257), (4, 8, 2500), (9, 8, 130), (0, 2, 16), (0, 8, 64)]
EXPERTS = 8


def _sequential(rows, weights=None):
    """Sum over j = 0..k-1 of [T, k, H] rows (times [T, k] weights) in that order: the kernels' order of sums."""
    total = rows[:, 0] if weights is None else rows[:, 0] * weights[:, :1]
    for j in range(1, rows.shape[1]):
        total = total + (rows[:, j] if weights is None else rows[:, j] * weights[:, j : j + 1])
    return total


def _rel(got, expected) -> float:
    """The largest difference over the largest expected magnitude (0 for empty tensors)."""
    got, expected = got.detach(), expected.detach()
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1e-30)) if got.numel() else 0.0


def _ulps(got, expected, dtype) -> float:
    """The largest difference in units of the last place of ``dtype`` at the expected value (0 where equal)."""
    import torch

    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    got, expected = got.detach().double(), expected.detach().double()
    scale = torch.exp2(torch.floor(torch.log2(expected.abs().clamp(min=1e-30))) - mantissa)
    return float(((got - expected).abs() / scale).max()) if got.numel() else 0.0


def measure() -> dict:
    """Runs in the child process, under the interpreter."""
    import torch

    from megablocks_utils.moe import dispatch as moe_dispatch

    torch.manual_seed(0)
    found = {"fp32": [], "low": [], "grad_subsets": {}}
    for tokens, k, hidden in SHAPES:
        choices = [torch.randperm(EXPERTS)[:k] for _ in range(tokens)]  # k distinct experts per token
        top_i = torch.stack(choices) if choices else torch.zeros(0, k, dtype=torch.long)
        route = moe_dispatch.route(top_i, EXPERTS)
        for index_dtype in (torch.int64, torch.int32):
            route = route._replace(copy_row=route.copy_row.to(index_dtype))
            copy_row = route.copy_row.long()
            case = {"shape": [tokens, k, hidden], "index": str(index_dtype)}

            x = torch.randn(tokens, hidden, requires_grad=True)
            grad = torch.randn(tokens * k, hidden)
            (d_x,) = torch.autograd.grad(moe_dispatch.dispatch(x, route, k, fuse=True), x, grad)
            (d_x_eager,) = torch.autograd.grad(moe_dispatch.dispatch(x, route, k, fuse=False), x, grad)
            expected = _sequential(grad[copy_row].view(tokens, k, hidden))
            case["gather_sum_vs_sequential"] = (d_x - expected).abs().max().item() if d_x.numel() else 0.0
            case["gather_sum_vs_eager"] = _rel(d_x, d_x_eager)

            out = torch.randn(tokens * k, hidden, requires_grad=True)
            top_w = torch.rand(tokens, k, requires_grad=True)
            y = moe_dispatch.combine(out, route, top_w, torch.float32, fuse=True)
            y_eager = moe_dispatch._gather_combine(out, copy_row, top_w, torch.float32)
            rows = out.detach()[copy_row].view(tokens, k, hidden)
            case["combine_vs_sequential"] = (y - _sequential(rows, top_w.detach())).abs().max().item() if y.numel() else 0.0
            case["combine_vs_eager"] = _rel(y, y_eager)
            dy = torch.randn(tokens, hidden)
            d_out, d_w = torch.autograd.grad(y, (out, top_w), dy)
            d_out_eager, d_w_eager = torch.autograd.grad(y_eager, (out, top_w), dy)
            case["d_out_equal"] = torch.equal(d_out, d_out_eager)
            case["d_w_rel"] = _rel(d_w, d_w_eager)
            case["dtypes"] = [str(t.dtype) for t in (d_x, y, d_out, d_w)]
            found["fp32"].append(case)

    for dtype in (torch.bfloat16, torch.float16):
        for tokens, k, hidden in ((7, 2, 300), (4, 8, 2500)):
            top_i = torch.stack([torch.randperm(EXPERTS)[:k] for _ in range(tokens)])
            route = moe_dispatch.route(top_i, EXPERTS)
            x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
            grad = torch.randn(tokens * k, hidden, dtype=dtype)
            (d_x,) = torch.autograd.grad(moe_dispatch.dispatch(x, route, k, fuse=True), x, grad)
            (d_x_eager,) = torch.autograd.grad(moe_dispatch.dispatch(x, route, k, fuse=False), x, grad)
            out = torch.randn(tokens * k, hidden, dtype=dtype, requires_grad=True)
            top_w = torch.rand(tokens, k, requires_grad=True)
            y = moe_dispatch.combine(out, route, top_w, dtype, fuse=True)
            y_eager = moe_dispatch._gather_combine(out, route.copy_row, top_w, dtype)
            dy = torch.randn(tokens, hidden, dtype=dtype)
            d_out, d_w = torch.autograd.grad(y, (out, top_w), dy)
            d_out_eager, d_w_eager = torch.autograd.grad(y_eager, (out, top_w), dy)
            found["low"].append({
                "dtype": str(dtype), "shape": [tokens, k, hidden],
                "ulps": [_ulps(d_x, d_x_eager, dtype), _ulps(y, y_eager, dtype), _ulps(d_out, d_out_eager, dtype)],
                "d_w_rel": _rel(d_w, d_w_eager),
                "dtypes": [str(t.dtype) for t in (d_x, y, d_out, d_w)],
                "eager_dtypes": [str(t.dtype) for t in (d_x_eager, y_eager, d_out_eager, d_w_eager)],
            })

    # Only the gradients asked for: the router frozen (no top_w gradient), or the expert outputs a constant.
    tokens, k, hidden = 5, 2, 40
    route = moe_dispatch.route(torch.stack([torch.randperm(EXPERTS)[:k] for _ in range(tokens)]), EXPERTS)
    out, top_w, dy = torch.randn(tokens * k, hidden), torch.rand(tokens, k), torch.randn(tokens, hidden)
    for name, out_grad, w_grad in (("out_only", True, False), ("top_w_only", False, True)):
        o, w = out.clone().requires_grad_(out_grad), top_w.clone().requires_grad_(w_grad)
        wanted = [t for t in (o, w) if t.requires_grad]
        got = torch.autograd.grad(moe_dispatch.combine(o, route, w, torch.float32, fuse=True), wanted, dy)
        expected = torch.autograd.grad(moe_dispatch._gather_combine(o, route.copy_row, w, torch.float32), wanted, dy)
        found["grad_subsets"][name] = max(_rel(g, e) for g, e in zip(got, expected))
    return found


@pytest.fixture(scope="module")
def found():
    path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    done = subprocess.run([sys.executable, __file__], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_fp32_sums_run_in_order_over_the_k_copies(found):
    """The gather-sum and the weighted combine equal a sum over j = 0..k-1 in that order, bit for bit (the order of the
    compiled kernels for k < 8), and the eager functions within 1e-6 of the largest output (CPU may sum k = 8 in another
    order)."""
    for case in found["fp32"]:
        assert case["gather_sum_vs_sequential"] == 0 and case["combine_vs_sequential"] == 0, case
        assert case["gather_sum_vs_eager"] <= 1e-6 and case["combine_vs_eager"] <= 1e-6, case


def test_fp32_combine_backward_equals_autograd(found):
    """The rows' gradient (one product per element) equals autograd's exactly; top_w's (a dot over H summed in another
    order) within 1e-6 of its largest entry; every gradient in its input's dtype."""
    for case in found["fp32"]:
        assert case["d_out_equal"], case
        assert case["d_w_rel"] <= 1e-6, case
        assert case["dtypes"] == ["torch.float32"] * 4, case


def test_bf16_and_fp16_within_one_ulp(found):
    """Rows in bf16 or fp16: every output within one ulp of the eager functions' (the interpreter truncates the final
    cast), in the eager functions' dtypes; top_w's gradient (fp32) within 1e-5."""
    for case in found["low"]:
        assert max(case["ulps"]) <= 1, case
        assert case["d_w_rel"] <= 1e-5, case
        assert case["dtypes"] == case["eager_dtypes"], case


def test_only_the_gradients_asked_for(found):
    """A frozen router (no top_w gradient) or constant expert outputs: the one gradient asked for, as autograd gives it."""
    assert found["grad_subsets"]["out_only"] == 0, found
    assert found["grad_subsets"]["top_w_only"] <= 1e-6, found  # relative to its largest entry, as above


def _exchanged_rows_through_the_kernels(rank: int, world_size: int, chunks: int) -> None:
    """One rank of ``test_rows_from_the_all_to_all_reach_the_kernels``: dispatch, exchange and combine wired as the layer
    wires them at ep = world size, ``fuse`` on (the kernels, under the interpreter) and off (eager)."""
    import torch
    import torch.distributed as dist

    from megablocks_utils.moe import dispatch as moe_dispatch

    tokens, k, hidden, experts = 7, 2, 40, 4
    local = experts // world_size
    torch.manual_seed(rank)
    x = torch.randn(tokens, hidden)
    top_i = torch.stack([torch.randperm(experts)[:k] for _ in range(tokens)])
    top_w = torch.rand(tokens, k)
    # Expert e multiplies its rows by e + 1: a row that reaches the wrong expert, or comes back to the wrong copy, shows.
    my_scale = torch.arange(rank * local, (rank + 1) * local, dtype=torch.float32) + 1

    def compute(rows, counts, counts_host):
        assert counts.tolist() == counts_host
        return rows * torch.repeat_interleave(my_scale, counts, output_size=rows.shape[0]).unsqueeze(-1)

    def layer(fuse: bool):
        xs, ws = x.clone().requires_grad_(), top_w.clone().requires_grad_()
        edges = [tokens * i // chunks for i in range(chunks + 1)]
        parts = [(xs[a:b], top_i[a:b], ws[a:b]) for a, b in zip(edges[:-1], edges[1:])]
        routes = [moe_dispatch.route(i, experts) for _, i, _ in parts]
        routed = [moe_dispatch.dispatch(p, r, k, fuse) for (p, _, _), r in zip(parts, routes)]
        outs = moe_dispatch.exchange(routed, [r.counts for r in routes], world_size, local, dist.group.WORLD, compute)
        y = torch.cat([moe_dispatch.combine(o, r, w, x.dtype, fuse) for o, r, (_, _, w) in zip(outs, routes, parts)])
        dy = torch.linspace(-1, 1, y.numel()).view_as(y)
        return (y.detach(), *torch.autograd.grad(y, (xs, ws), dy)), dy

    (y, d_x, d_w), dy = layer(fuse=True)
    (y_eager, d_x_eager, d_w_eager), _ = layer(fuse=False)
    factor = (top_i + 1).float()  # each copy's expert scale
    expected = ((top_w * factor).unsqueeze(-1) * x.unsqueeze(1)).sum(1)
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5), (y - expected).abs().max()
    assert torch.allclose(d_x, (top_w * factor).sum(1, keepdim=True) * dy, rtol=1e-5, atol=1e-5)
    assert torch.allclose(d_w, factor * (dy @ x.T).diagonal().unsqueeze(-1), rtol=1e-5, atol=1e-5)
    for name, got, eager in (("y", y, y_eager), ("d_x", d_x, d_x_eager), ("d_w", d_w, d_w_eager)):
        assert torch.allclose(got, eager, rtol=1e-5, atol=1e-5), (name, (got - eager).abs().max())


@pytest.mark.parametrize("chunks", [1, 2])
def test_rows_from_the_all_to_all_reach_the_kernels(monkeypatch, chunks):
    """At ep 2 (two gloo ranks) the rows the all-to-all brings back go straight into the combine's kernel, so
    ``exchange`` must hand them over waited on: a functional collective's result not yet waited on has empty storage,
    and the kernel read address 0 (an illegal memory access on GPUs, an error here). Through the kernels, whole or in
    chunks, each token gets the weighted sum of its experts' outputs, and x and top_w the gradients that sum implies,
    as the eager path gives them."""
    from tests.conftest import run_ranks

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by the spawned ranks when they import Triton
    run_ranks(_exchanged_rows_through_the_kernels, 2, chunks)


if __name__ == "__main__":
    print(json.dumps(measure()))
