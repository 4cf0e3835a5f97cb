"""SwiGLU and the down projection with SwiGLU's output made again in the backward (``experts.silu_mul_down``, the
scripts' ``recompute_swiglu``) on CPU, through Triton's interpreter (one child process; torch runs the grouped GEMM on
CPU in fp32): the output and the gradients of gate_up and of the down weight equal the two steps it replaces (SwiGLU,
then the grouped GEMM, through autograd), for both weight layouts, the weight's gradient returned to autograd or added
into ``.grad`` over two micro-steps (``WeightGradInto``), with and without a bound of valid rows (the static exchange's
padding past it); and what it saves for the backward holds no [rows, I] tensor, where the two steps keep SwiGLU's output.
tests/gpu/test_moe_layer.py checks it in bf16 inside the layer on a GPU."""

import importlib.util

import pytest
from conftest import run_in_triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton (its CPU interpreter runs the kernels; requirements-test.txt installs it)")

CHECKS = """
import json, torch
import torch.nn.functional as F
from megablocks_utils.moe import experts
from megablocks_utils.moe.weight_grad import WeightGradInto

experts.fused = lambda fn: fn  # the unbounded forward is torch.compile'd on GPUs; eager here, the same arithmetic
torch.manual_seed(0)
counts = torch.tensor([9, 0, 20, 8])  # an empty expert; rows end mid-tile
offs = torch.cumsum(counts, 0, dtype=torch.int32)
valid_rows, padded_rows, hidden, inter = 37, 44, 16, 24  # CPU's grouped GEMM wants rows of 16-byte multiples


def reference(gate_up, w, transpose_weight, grad_out):
    # SwiGLU then the grouped GEMM through autograd: what silu_mul_down replaces
    gate_up = gate_up.detach().requires_grad_()
    w = w.detach().requires_grad_()
    gate, up = gate_up[:valid_rows].chunk(2, dim=-1)
    out = F.grouped_mm(F.silu(gate) * up, w.transpose(-2, -1) if transpose_weight else w, offs=offs)
    out.backward(grad_out[:valid_rows])
    return out, gate_up.grad[:valid_rows], w.grad


def saved_shapes(fn):
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        fn()
    return shapes


found = {}
for transpose_weight in (True, False):
    w_shape = (4, hidden, inter) if transpose_weight else (4, inter, hidden)
    for bounded in (True, False):
        rows = padded_rows if bounded else valid_rows
        valid = offs[-1:] if bounded else None
        key = f"{'stored_HI' if transpose_weight else 'stored_IH'}_{'bounded' if bounded else 'whole'}"
        gate_up = 3 * torch.randn(rows, 2 * inter)
        w = torch.randn(w_shape)
        grads_out = [torch.randn(rows, hidden) for _ in range(2)]
        expected = [reference(gate_up, w, transpose_weight, g) for g in grads_out]
        # the weight's gradient to autograd
        x = gate_up.clone().requires_grad_()
        wa = w.clone().requires_grad_()
        bounds, forward_kernel = [], experts._silu_mul_forward  # the bound each SwiGLU pass is given, forward and remake
        experts._silu_mul_forward = lambda g, v: bounds.append(None if v is None else int(v)) or forward_kernel(g, v)
        out = experts.silu_mul_down(x, wa, offs, valid, None, transpose_weight)
        out.backward(grads_out[0])
        experts._silu_mul_forward = forward_kernel
        found[key + "_bounds"] = bounds
        rel = lambda got, want: float((got - want).abs().max() / want.abs().max())
        found[key + "_autograd"] = {"out": rel(out[:valid_rows], expected[0][0]), "gate_up": rel(x.grad[:valid_rows], expected[0][1]),
                                    "weight": rel(wa.grad, expected[0][2])}
        # the weight's gradient into .grad: written by the first micro-step, added to by the second
        param = torch.nn.Parameter(w.clone())
        into = WeightGradInto(param, divisor=1.0, fuse=False)
        for g in grads_out:
            x = gate_up.clone().requires_grad_()
            experts.silu_mul_down(x, param.detach(), offs, valid, into, transpose_weight).backward(g)
        found[key + "_into"] = {"weight": rel(param.grad, expected[0][2] + expected[1][2])}
        # what the forward saves: no tensor of SwiGLU's output's shape, where the two steps keep one
        x, wa = gate_up.clone().requires_grad_(), w.clone().requires_grad_()
        ours = saved_shapes(lambda: experts.silu_mul_down(x, wa, offs, valid, None, transpose_weight))
        two_steps = saved_shapes(lambda: experts.grouped_mm(experts.silu_mul(x, valid), wa.transpose(-2, -1) if transpose_weight else wa, offs))
        found[key + "_saved"] = {"ours": [list(s) for s in ours], "two_steps": [list(s) for s in two_steps],
                                 "swiglu_output": [rows, inter]}
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def found():
    return run_in_triton_interpreter(CHECKS)


CASES = [f"{layout}_{rows}" for layout in ("stored_HI", "stored_IH") for rows in ("bounded", "whole")]


@pytest.mark.parametrize("case", CASES)
def test_output_and_gradients_equal_swiglu_then_the_grouped_gemm(found, case):
    got = found[case + "_autograd"]
    assert max(got.values()) < 1e-6, got  # relative to the largest value: fp32, summed in another order at most


@pytest.mark.parametrize("case", CASES)
def test_the_weight_gradient_is_written_then_added_into_grad(found, case):
    got = found[case + "_into"]
    assert got["weight"] < 1e-6, got


@pytest.mark.parametrize("case", CASES)
def test_swiglus_output_is_not_saved_for_the_backward(found, case):
    got = found[case + "_saved"]
    assert got["swiglu_output"] in got["two_steps"]  # the check can see it
    assert got["swiglu_output"] not in got["ours"], got["ours"]


@pytest.mark.parametrize("case", CASES)
def test_the_remade_swiglu_covers_the_rows_the_forward_did(found, case):
    """The backward makes SwiGLU's output again over the forward's rows, by the forward's own kernel (the same bits on a
    GPU): bounded by the valid rows where the forward was, whole where it was."""
    expected = [37, 37] if case.endswith("bounded") else [None, None]
    assert found[case + "_bounds"] == expected, found[case + "_bounds"]
