"""The SwiGLU backward's Triton kernel (``moe/swiglu_kernel.py``, the experts' ``silu_mul`` on CUDA) on CPU, through
Triton's interpreter (one child process): against autograd of ``silu(gate) * up`` in float64, for fp32 (1e-6) and
bf16 (a bf16 rounding: 2^-8), relative to the largest gradient, rows and widths that end mid-tile, a gradient that is not
contiguous; a bound of valid rows (the static exchange's padding past it left unwritten); shapes that do not fit are
refused. The bounded forward likewise against float64. tests/gpu/test_moe_layer.py checks it on a GPU inside the layer."""

import importlib.util

import pytest
from conftest import run_in_triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (its CPU interpreter runs the kernel; requirements-test.txt installs it)")

CHECKS = """
import json, torch
import torch.nn.functional as F
from megablocks_utils.moe.swiglu_kernel import silu_mul_backward
found = {}
for dtype, rows, width in ((torch.float32, 37, 200), (torch.bfloat16, 20, 128), (torch.float32, 1, 5)):
    g = torch.Generator().manual_seed(rows)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    grad = torch.randn(width, rows, generator=g).to(dtype).t()  # not contiguous
    exact = gate_up.double().requires_grad_()
    gate, up = exact.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(grad.double())
    got = silu_mul_backward(gate_up, grad)
    err = (got.double() - exact.grad).abs().max() / exact.grad.abs().max()  # near-zero derivatives: no element-wise ratio
    found[f"{str(dtype)[6:]}_{rows}x{width}"] = {"rel": float(err), "dtype": str(got.dtype), "shape": list(got.shape)}
# valid: the rows below it exactly as without it (a bound mid-tile: 16 rows a tile), the rows past it not written
g = torch.Generator().manual_seed(5)
gate_up, grad = 3 * torch.randn(37, 400, generator=g), torch.randn(37, 200, generator=g)
full = silu_mul_backward(gate_up, grad)
unset = torch.empty_like
torch.empty_like = lambda t, **kw: torch.full_like(t, 7.0, **kw)  # the output's memory before the kernel: all 7
bounded = silu_mul_backward(gate_up, grad, torch.tensor([20], dtype=torch.int32))
torch.empty_like = unset
found["valid"] = {"equal_below": bool(torch.equal(bounded[:20], full[:20])), "untouched_past": bool((bounded[20:] == 7).all())}
# the forward (where the rows are bounded): against float64 below the bound, the rows past it not written
from megablocks_utils.moe.swiglu_kernel import silu_mul_forward
for dtype, rows, width, bound in ((torch.float32, 37, 200, 37), (torch.bfloat16, 37, 200, 20), (torch.float32, 1, 5, 1)):
    g = torch.Generator().manual_seed(rows + bound)
    gate_up = (3 * torch.randn(rows, 2 * width, generator=g)).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    unset = torch.empty
    torch.empty = lambda *a, **kw: torch.full(a[0] if len(a) == 1 else a, 7.0, **kw)  # the output's memory: all 7
    try:
        got = silu_mul_forward(gate_up, torch.tensor([bound], dtype=torch.int32))
    finally:
        torch.empty = unset
    err = (got[:bound].double() - exact[:bound]).abs().max() / exact[:bound].abs().max()
    found[f"forward_{str(dtype)[6:]}_{rows}x{width}_{bound}"] = {
        "rel": float(err), "dtype": str(got.dtype), "shape": list(got.shape), "untouched_past": bool((got[bound:] == 7).all())}
try:
    silu_mul_forward(torch.zeros(4, 9), torch.tensor([4]))
    found["forward_refused"] = ""
except ValueError as e:
    found["forward_refused"] = str(e)
try:
    silu_mul_backward(torch.zeros(4, 10), torch.zeros(4, 4))
    found["refused"] = ""
except ValueError as e:
    found["refused"] = str(e)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def found():
    return run_in_triton_interpreter(CHECKS)


def test_the_backward_equals_autograds_in_float64(found):
    for key, got in found.items():
        if key in ("refused", "valid") or key.startswith("forward"):
            continue
        dtype, shape = key.split("_")
        rows, width = map(int, shape.split("x"))
        assert got["dtype"] == f"torch.{dtype}" and got["shape"] == [rows, 2 * width], (key, got)
        assert got["rel"] <= (1e-6 if dtype == "float32" else 2**-8), (key, got)


def test_shapes_that_do_not_fit_are_refused(found):
    assert "do not fit" in found["refused"], found


def test_valid_rows_bound_the_work_and_leave_the_rest_unwritten(found):
    assert found["valid"] == {"equal_below": True, "untouched_past": True}, found


def test_the_bounded_forward_is_one_rounding_from_float64_and_leaves_the_padding_unwritten(found):
    forward = {k: v for k, v in found.items() if k.startswith("forward_") and k != "forward_refused"}
    assert len(forward) == 3, found
    for key, got in forward.items():
        _, dtype, shape, bound = key.split("_")
        rows, width = map(int, shape.split("x"))
        assert got["dtype"] == f"torch.{dtype}" and got["shape"] == [rows, width], (key, got)
        # bf16: Triton's interpreter converts fp32 to bf16 by truncation (up to 2^-7 of a value; a GPU rounds to
        # nearest: tests/gpu/test_moe_layer.py compares it with the compiled forward there)
        assert got["rel"] <= (1e-6 if dtype == "float32" else 2**-7), (key, got)
        assert got["untouched_past"], (key, got)
    assert "does not fit" in found["forward_refused"], found
