"""The gradient norm's Triton sum of squares (``parallel/sum_squares_kernel.py``) on CPU, through Triton's interpreter
(one child process): against float64 sums, for sizes that end mid-block and mid-program, an empty tensor, fp32, fp16
and bf16 tensors together; and its refusal of a tensor it cannot read. tests/gpu/test_grad_norm.py checks the norm on
a GPU, where ``grad_norm_and_clip_coef`` uses it."""

import importlib.util

import pytest
from conftest import run_in_triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (its CPU interpreter runs the kernel; requirements-test.txt installs it)")

CHECKS = """
import json, torch
from megablocks_utils.parallel.sum_squares_kernel import sum_of_squares
g = torch.Generator().manual_seed(0)
tensors = [torch.randn(n, generator=g).to(dtype) for n, dtype in
           ((1, torch.float32), (4095, torch.float16), (32768, torch.bfloat16), (70001, torch.float32), (0, torch.float32))]
tensors.append(torch.randn(3, 5000, generator=g))  # more than one dimension
got = sum_of_squares(tensors)
exact = sum(float(t.double().square().sum()) for t in tensors)
refused = ""
try:
    sum_of_squares([torch.randn(8, 8).t()])
except ValueError as e:
    refused = str(e)
print(json.dumps({"got": float(got), "dtype": str(got.dtype), "shape": list(got.shape), "exact": exact, "refused": refused}))
"""


@pytest.fixture(scope="module")
def found():
    return run_in_triton_interpreter(CHECKS)


def test_sum_of_squares_equals_float64_sums(found):
    """fp32 partials summed in fp32: within 1e-6 of the float64 sum over six tensors of three dtypes; one 0-dim fp32."""
    assert found["dtype"] == "torch.float32" and found["shape"] == []
    assert abs(found["got"] - found["exact"]) <= 1e-6 * found["exact"], found


def test_a_tensor_it_cannot_read_is_refused(found):
    assert "contiguous" in found["refused"], found
