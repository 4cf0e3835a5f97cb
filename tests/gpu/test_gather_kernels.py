"""The gathers' Triton kernels (megablocks_utils/moe/gather_kernels.py) on one GPU, against the compiled kernels they
replace (``dispatch.FUSED_GATHERS = "compiled"``), wired as the layer uses them (``dispatch`` and ``combine`` with
``fuse``): the dispatch's gather-sum backward, the combine's forward and its backward (the expert outputs' and the
router weights' gradients).

Shapes: Qwen3-30B-A3B's (4096 tokens, k = 8, H = 2048) and Mixtral's (k = 2, H = 4096) in bf16 and fp32, and odd ones
(k = 1, 3, 6; widths that end mid-block; no tokens), routed by top-k over 128 experts; one shape whose row offsets pass
2^31 elements. One measuring process, one test per claim.
"""

import pytest
import torch

from .launch import gpus, host_sync_error, run_on_gpus

pytestmark = gpus(1)

SHAPES = {"qwen3": (4096, 8, 2048), "mixtral": (4096, 2, 4096), "k3": (1000, 3, 1000), "k1": (7, 1, 33), "k6": (33, 6, 2050)}
EXPERTS = 128
FAR = (137_500, 8, 2048)  # 1.1 M copy rows x 2048: the last rows start past 2^31 elements


def bf16_ulps(got: torch.Tensor, expected: torch.Tensor, terms: torch.Tensor) -> tuple[float, float]:
    """(largest difference in bf16 ulps, share of elements that differ). The ulp is the expected value's, or where the
    sum cancels below 1/256 of ``terms`` (the sum of its terms' magnitudes) that of terms / 256: two fp32 sums in
    another order differ by a few fp32 ulps of the terms, which is many bf16 ulps of a result near zero."""
    got, expected = got.double(), expected.double()
    magnitude = torch.maximum(expected.abs(), terms.double() / 256)
    scale = torch.exp2(torch.floor(torch.log2(magnitude.clamp(min=1e-30))) - 7)
    differ = got != expected
    return float(((got - expected).abs() / scale).max()), float(differ.double().mean())


def rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1e-30))


def measure(rank, world):
    from megablocks_utils.moe import dispatch as moe_dispatch

    def inputs(tokens, k, hidden, dtype):
        top_i = torch.rand(tokens, EXPERTS, device="cuda").topk(k, dim=-1).indices
        top_w = torch.rand(tokens, k, device="cuda").softmax(-1)  # fp32, as the router gives them
        route = moe_dispatch.route(top_i, EXPERTS)
        x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        grad = torch.randn(tokens * k, hidden, device="cuda", dtype=dtype)  # the dispatch's output gradient
        out = torch.randn(tokens * k, hidden, device="cuda", dtype=dtype)  # expert outputs in expert order
        dy = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
        return route, top_w, x, grad, out, dy

    def run(kind, route, top_w, x, grad, out, dy):
        """(gather-sum, combine, the combine's rows gradient, its router weights gradient) through ``kind`` kernels."""
        moe_dispatch.FUSED_GATHERS = kind
        k = top_w.shape[1]
        x = x.detach().requires_grad_()
        (d_x,) = torch.autograd.grad(moe_dispatch.dispatch(x, route, k, True), x, grad)
        out, top_w = out.detach().requires_grad_(), top_w.detach().requires_grad_()
        y = moe_dispatch.combine(out, route, top_w, dy.dtype, True)
        d_out, d_w = torch.autograd.grad(y, (out, top_w), dy)
        return d_x, y.detach(), d_out, d_w

    def truth(route, top_w, x, grad, out, dy):
        """The same in fp64 on the same inputs, and the sums of the terms' magnitudes of d_x and y."""
        num_tokens, k = top_w.shape
        rows = out.double()[route.copy_row].view(num_tokens, k, -1)
        grads = grad.double()[route.copy_row].view(num_tokens, k, -1)
        weighted = rows * top_w.double().unsqueeze(-1)
        d_w = (rows * dy.double().unsqueeze(1)).sum(-1)
        return grads.sum(1), weighted.sum(1), d_w, grads.abs().sum(1), weighted.abs().sum(1)

    torch.manual_seed(0)
    found = {"bf16": {}, "fp32": {}}
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        for name, shape in SHAPES.items():
            tensors = inputs(*shape, dtype)
            run("compiled", *tensors)  # warm-up: compiles (and recompiles for a new shape) outside the comparison
            ours, compiled = run("triton", *tensors), run("compiled", *tensors)
            exact = truth(*tensors)
            case = {"d_out_equal": torch.equal(ours[2], compiled[2]), "d_w_vs_compiled": rel(ours[3], compiled[3]),
                    "d_w_vs_truth": [rel(ours[3], exact[2]), rel(compiled[3], exact[2])],
                    "dtypes": [str(t.dtype) for t in ours] == [str(t.dtype) for t in compiled]}
            if dtype == torch.bfloat16:
                case["d_x_ulps"], case["y_ulps"] = bf16_ulps(ours[0], compiled[0], exact[3]), bf16_ulps(ours[1], compiled[1], exact[4])
            else:
                case["d_x_vs_compiled"], case["y_vs_compiled"] = rel(ours[0], compiled[0]), rel(ours[1], compiled[1])
            found[key][name] = case

    # No tokens: empty results of the right shapes, nothing launched.
    d_x, y, d_out, d_w = run("triton", *inputs(0, 8, 2048, torch.bfloat16))
    found["empty_shapes"] = [list(t.shape) for t in (d_x, y, d_out, d_w)]

    # Row offsets past 2^31 elements: the last tokens' rows against plain indexing.
    tokens, k, hidden = FAR
    moe_dispatch.FUSED_GATHERS = "triton"
    route, top_w, _, grad, out, dy = inputs(tokens, k, hidden, torch.bfloat16)
    from megablocks_utils.moe import gather_kernels

    d_x = gather_kernels.gather_sum(grad, route.copy_row, k)
    y = gather_kernels.combine(out, route.copy_row, top_w, torch.bfloat16)
    d_out, d_w = gather_kernels.combine_backward(dy, route.copy_row, top_w, out, (out.shape[0], out.dtype))
    far = torch.nonzero(route.copy_row.view(tokens, k).amax(1) * hidden >= 2**31).flatten()[:64]
    copies = route.copy_row.view(tokens, k)[far].flatten()
    found["far_tokens"] = far.numel()
    found["far_d_x"] = rel(d_x[far], moe_dispatch._gather_sum(grad, copies, k))
    found["far_y"] = rel(y[far], moe_dispatch._gather_combine(out, copies, top_w[far], torch.bfloat16))
    weighted = (dy[far].float().unsqueeze(1) * top_w[far].unsqueeze(-1)).to(torch.bfloat16)
    found["far_d_out_equal"] = torch.equal(d_out[copies], weighted.view(-1, hidden))
    found["far_d_w"] = rel(d_w[far], (out[copies].float().view(-1, k, hidden) * dy[far].float().unsqueeze(1)).sum(-1))
    del route, top_w, grad, out, dy, d_x, y, d_out, d_w

    # No host sync in the forward or the backward once the kernels are compiled.
    tensors = inputs(*SHAPES["qwen3"], torch.bfloat16)
    run("triton", *tensors)
    found["host_sync"] = host_sync_error(lambda: run("triton", *tensors))
    return found


@pytest.fixture(scope="module")
def found():
    return run_on_gpus(measure, 1)[0]


def test_bf16_sums_are_the_compiled_sums_to_a_rounding(found):
    """The gather-sum and the combine sum in fp32 and round once to bf16, as the compiled kernels do; where their fp32
    sums differ in the last bits (another order of adds, a multiply-add contracted differently) the bf16 result can
    round the other way: at most one bf16 ulp, in at most 0.1% of the elements."""
    for name, case in found["bf16"].items():
        for key in ("d_x_ulps", "y_ulps"):
            ulps, share = case[key]
            assert ulps <= 1 and share <= 1e-3, (name, key, case)


def test_fp32_sums_are_the_compiled_sums(found):
    """In fp32 the two differ only by the order of the k adds: within 1e-6 of the largest output."""
    for name, case in found["fp32"].items():
        assert case["d_x_vs_compiled"] <= 1e-6 and case["y_vs_compiled"] <= 1e-6, (name, case)


def test_combine_backward(found):
    """The expert outputs' gradient is one product rounded once (w * dy in fp32, to the rows' dtype): bit for bit the
    compiled one. The router weights' gradient (an fp32 dot over H, summed in another order) within 1e-5 of the
    compiled one and no further from the fp64 truth than 1e-5; every gradient in the compiled path's dtype."""
    for key in ("bf16", "fp32"):
        for name, case in found[key].items():
            assert case["d_out_equal"] and case["dtypes"], (key, name, case)
            assert case["d_w_vs_compiled"] <= 1e-5 and max(case["d_w_vs_truth"]) <= 1e-5, (key, name, case)


def test_no_tokens(found):
    assert found["empty_shapes"] == [[0, 2048], [0, 2048], [0, 2048], [0, 8]], found["empty_shapes"]


def test_row_offsets_past_2_31_elements(found):
    """Tokens whose copy rows start past 2^31 elements of the [tokens * k, H] tensor: each kernel's result for them
    equals plain indexing (bf16: within a rounding of the fp32 sums)."""
    assert found["far_tokens"] == 64, found
    assert found["far_d_out_equal"], found
    assert max(found["far_d_x"], found["far_y"]) <= 2**-7 and found["far_d_w"] <= 1e-5, found


def test_no_host_sync(found):
    assert found["host_sync"] == "", f"a host sync in the gathers: {found['host_sync']}"
