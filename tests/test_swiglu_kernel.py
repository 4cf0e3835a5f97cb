"""The SwiGLU backward's Triton kernel (``moe/swiglu_kernel.py``, the experts' ``silu_mul`` on CUDA) on CPU, through
Triton's interpreter (one child process): against autograd of ``silu(gate) * up`` in float64, for fp32 (1e-6) and
bf16 (a bf16 rounding: 2^-8), relative to the largest gradient, rows and widths that end mid-tile, a gradient that is not
contiguous; shapes that do not fit are refused. tests/gpu/test_moe_layer.py checks it on a GPU inside the layer."""

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
        if key == "refused":
            continue
        dtype, shape = key.split("_")
        rows, width = map(int, shape.split("x"))
        assert got["dtype"] == f"torch.{dtype}" and got["shape"] == [rows, 2 * width], (key, got)
        assert got["rel"] <= (1e-6 if dtype == "float32" else 2**-8), (key, got)


def test_shapes_that_do_not_fit_are_refused(found):
    assert "do not fit" in found["refused"], found
