"""The experts' weight gradient added in the grouped GEMM's backward (``moe/weight_grad.py``, its Triton kernel
``moe/weight_grad_kernel.py``) on CPU, through Triton's interpreter: the kernel against float64 sums (fresh, adding,
divided, empty groups, an output of other strides), and three micro-steps of ``grouped_mm_grad_into`` against
autograd through torch's grouped GEMM, for both weight layouts, a DTensor weight (its gradient a DTensor of the same
placements) and fp32 weights divided by 2; and the layer's wiring (``owns_weight_grads``) with CPU's fp32 grouped GEMM
standing in for CUDA's.

The interpreter is switched on when Triton is imported (``TRITON_INTERPRET=1``), so the checks run in one child
process (this file as a script) and each test asserts one claim on its JSON report. The interpreter's bf16 dot is
wrong (it reads the bits as integers), so the CPU checks compute in fp32 and fp16; tests/gpu/test_moe_layer.py checks
bf16 on a GPU. requirements-test.txt installs Triton; without it these tests skip.
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
    reason="needs triton (its CPU interpreter runs the kernel; requirements-test.txt installs it); "
    "tests/gpu/test_moe_layer.py covers the kernel on a GPU",
)


def _kernel_checks(torch) -> dict:
    from megablocks_utils.moe.weight_grad_kernel import grouped_weight_grad

    torch.manual_seed(0)
    counts = torch.tensor([5, 0, 70, 33], dtype=torch.int32)  # an empty group, groups that end mid-block
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows, m, n = int(counts.sum()), 40, 24
    small = (16, 32, 16, 1, 1)  # blocks smaller than the matrices: edges in every direction

    def reference(a, b):
        starts = [0, *offs[:-1].tolist()]
        return torch.stack([a[s:e].double().t() @ b[s:e].double() for s, e in zip(starts, offs.tolist())])

    found = {}
    for dtype in (torch.float32, torch.float16):
        a, b = torch.randn(rows, m).to(dtype), torch.randn(rows, n).to(dtype)
        start = torch.randn(4, m, n).to(dtype)
        exact = reference(a, b)
        for accumulate in (False, True):
            for divisor in (1.0, 2.0, 3.0):
                out = grouped_weight_grad(a, b, offs, start.clone(), accumulate=accumulate, divisor=divisor, config=small)
                # the unfused steps' roundings: the GEMM's output, the division, the add
                rounded = (exact.to(dtype).double() / divisor).to(dtype).double()
                expected = (start.double() + rounded).to(dtype) if accumulate else rounded.to(dtype)
                key = f"{str(dtype)[6:]}_{'add' if accumulate else 'fresh'}_div{divisor:g}"
                diff = (out.double() - expected.double()).abs()
                found[key] = {"rel": float(diff.max() / expected.double().abs().max()),
                              "empty_group": bool(torch.equal(out[1], (start[1] if accumulate else torch.zeros_like(out[1]))))}
        # dividing by 2 and 4 (times the reciprocal) and by 3 (IEEE division): bit for bit torch's division of the
        # undivided sums, as the unfused cast's backward divides them
        undivided = grouped_weight_grad(a, b, offs, start.clone(), accumulate=False, config=small)
        found[f"{str(dtype)[6:]}_divided_bits"] = {
            f"{d:g}": bool(torch.equal(grouped_weight_grad(a, b, offs, start.clone(), accumulate=False, divisor=d, config=small),
                                       (undivided.float() / d).to(dtype))) for d in (2.0, 4.0, 3.0)}
    from megablocks_utils.moe.weight_grad_kernel import _division

    found["division_paths"] = {f"{d:g}": list(_division(d)) for d in (1.0, 2.0, 4.0, 8.0, 0.5, 3.0, 6.0)}
    a, b = torch.randn(rows, m), torch.randn(rows, n)
    strided = torch.zeros(4, n, m).transpose(1, 2)  # [4, m, n] of other strides
    grouped_weight_grad(a, b, offs, strided, accumulate=True, config=small)
    found["strided_rel"] = float((strided.double() - reference(a, b)).abs().max() / reference(a, b).abs().max())
    return found


def _function_checks(torch) -> dict:
    """Three micro-steps of x @ w_e (and x @ w_e^T) with the gradient added in place, against autograd."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from megablocks_utils.moe.weight_grad import WeightGradInto, gradients_written, grouped_mm, grouped_mm_grad_into

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(1)
    counts = torch.tensor([16, 0, 48, 32], dtype=torch.int32)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    found = {}
    for transpose_weight in (False, True):
        for name, dtensor, divisor, weight_dtype in (("tensor", False, 1, torch.float32), ("dtensor", True, 1, torch.float32),
                                                      ("divided", False, 2, torch.float32)):
            shape = (4, 32, 16) if transpose_weight else (4, 16, 32)  # [E, N, K] used as x @ w^T, or [E, K, N]
            weight = torch.randn(shape, dtype=weight_dtype) * 0.1
            xs = [torch.randn(96, 16) for _ in range(3)]
            gs = [torch.randn(96, 32) for _ in range(3)]
            ours = torch.nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]) if dtensor else weight.clone())
            theirs = torch.nn.Parameter(weight.clone())
            into = WeightGradInto(ours, divisor, False)
            grads_x = []
            for x, g in zip(xs, gs):
                x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
                local = ours.to_local().detach() if dtensor else ours.detach()
                grouped_mm_grad_into(x_ours, local, offs, into, transpose_weight).backward(g)
                w = theirs.transpose(-2, -1) if transpose_weight else theirs
                grouped_mm(x_theirs, w, offs).backward(g)
                grads_x.append(bool(torch.equal(x_ours.grad, x_theirs.grad)))
            grad = ours.grad.to_local() if dtensor else ours.grad
            expected = theirs.grad / divisor  # divided by 2: exact in fp32, so dividing the sum or each term is the same
            key = f"{name}_{'nk' if transpose_weight else 'kn'}"
            found[key] = {"rel": float((grad - expected).abs().max() / expected.abs().max()), "grads_x_equal": all(grads_x),
                          "dtensor_grad": (isinstance(ours.grad, DTensor) and ours.grad.placements == ours.placements) if dtensor else None,
                          "empty_expert_zero": bool((grad[1] == 0).all())}
            # A step's first micro-step under gradients_written: the existing (stale) gradient written over, not added to
            written = set()
            with gradients_written(written):
                grouped_mm_grad_into(xs[0].clone().requires_grad_(), local, offs, into, transpose_weight).backward(gs[0])
            theirs.grad = None
            grouped_mm(xs[0], theirs.transpose(-2, -1) if transpose_weight else theirs, offs).backward(gs[0])
            rewritten = ours.grad.to_local() if dtensor else ours.grad
            found[f"written_{key}"] = {"rel": float((rewritten - theirs.grad / divisor).abs().max() / theirs.grad.abs().max()),
                                       "registered": written == {id(ours)}, "in_place": rewritten.data_ptr() == grad.data_ptr()}
    dist.destroy_process_group()
    return found


def _layer_checks(torch) -> dict:
    """The layer's wiring (``ExpertParallelExperts.owns_weight_grads``), with CPU's fp32 grouped GEMM standing in for
    CUDA's: three micro-steps with ``weight_grads_in_gemm`` on and off, Mixtral's layout and gpt-oss's (transposed,
    interleaved, biases), and when the layer must leave the gradients to autograd."""
    from types import SimpleNamespace

    from megablocks_utils.moe import experts as moe_experts
    from megablocks_utils.moe.layer import ExpertParallelExperts

    moe_experts.grouped_mm_supported = lambda x: True  # CPU's grouped GEMM takes fp32: the CUDA path's code on CPU
    torch.manual_seed(3)
    found = {}
    layouts = {"mixtral": ("silu", {}, [(4, 64, 32), (4, 32, 32)]),
               "gpt_oss": ("gpt_oss_swiglu", {"transposed": True, "interleaved": True, "bias": True, "alpha": 1.702, "limit": 7.0},
                           [(4, 32, 64), (4, 32, 32), (4, 64), (4, 32)])}
    for name, (act, options, shapes) in layouts.items():
        weights = [0.1 * torch.randn(shape) for shape in shapes]
        x = torch.randn(3, 64, 32)
        top_i = torch.randint(0, 3, (3, 64, 2))  # expert 3 gets no rows
        top_w = torch.rand(3, 64, 2).softmax(-1)
        grads, owned = {}, {}
        for on in (True, False):
            layer = ExpertParallelExperts(4, SimpleNamespace(ep_size=1), act, compile_elementwise=False, **options)
            layer.set_weights(*(torch.nn.Parameter(w.clone()) for w in weights))
            layer.weight_grads_in_gemm = on
            owned[on] = layer.owns_weight_grads(x[0], torch.zeros(4))
            for i in range(3):
                layer(x[i].clone().requires_grad_(), top_i[i], top_w[i]).square().sum().backward()
            grads[on] = {n: p.grad for n, p in layer.named_parameters()}
        with torch.no_grad():
            no_grad_owned = layer.owns_weight_grads(x[0], torch.zeros(4))
        layer.gate_up_proj.requires_grad_(False)  # frozen weights (LoRA): autograd's path, which then computes no dW
        frozen_owned = layer.owns_weight_grads(x[0], torch.zeros(4))
        found[name] = {"owned_on": owned[True], "owned_off": owned[False], "no_grad": no_grad_owned, "frozen": frozen_owned,
                       "rel": max(float((grads[True][n] - grads[False][n]).abs().max() / grads[False][n].abs().max()) for n in grads[False]),
                       "empty_expert_zero": bool((grads[True]["gate_up_proj"][3] == 0).all())}
    return found


def _measure() -> dict:
    import torch

    return {"kernel": _kernel_checks(torch), "function": _function_checks(torch), "layer": _layer_checks(torch)}


@pytest.fixture(scope="module")
def found():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, CUDA_VISIBLE_DEVICES="")
    result = subprocess.run([sys.executable, os.path.abspath(__file__)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_kernel_rounds_as_the_unfused_steps(found):
    """Fresh and adding, divided by 1, 2 and 3: the float64 sums rounded as the GEMM's output, the division and the add
    round them; only the order of the fp32 sums is free (fp32 to 1e-6, fp16 within an fp16 unit, 1e-3). An empty group's
    gradient is zeros (fresh) or what was there (adding)."""
    kernel = found["kernel"]
    for key, got in kernel.items():
        if key in ("strided_rel", "division_paths") or key.endswith("_divided_bits"):
            continue
        assert got["rel"] <= (1e-6 if key.startswith("float32") else 1e-3), (key, got)
        assert got["empty_group"], (key, got)
    assert kernel["strided_rel"] <= 1e-6, kernel


def test_a_power_of_two_divisor_gives_the_bits_of_division(found):
    """Dividing by 2 or 4 (the kernel multiplies by the exact reciprocal) and by 3 (IEEE division in the kernel): the
    same bits as torch dividing the undivided gradient in fp32 and rounding it, in fp32 and fp16; powers of two (0.5
    to 8) take the multiply, 3 and 6 the division, 1 neither."""
    for dtype in ("float32", "float16"):
        assert found["kernel"][f"{dtype}_divided_bits"] == {"2": True, "4": True, "3": True}, found["kernel"]
    # which path each divisor takes: none for 1, the reciprocal's multiply for powers of two, IEEE division otherwise
    assert found["kernel"]["division_paths"] == {"1": [1.0, 0], "2": [0.5, 1], "4": [0.25, 1], "8": [0.125, 1], "0.5": [2.0, 1],
                                                 "3": [3.0, 2], "6": [6.0, 2]}, found["kernel"]["division_paths"]


def test_gradient_added_in_place_equals_autograds(found):
    """Three micro-steps through ``grouped_mm_grad_into``: the weight's gradient what autograd accumulates through torch's
    grouped GEMM (fp32, to 1e-6), in both layouts, on a tensor and on a DTensor (its gradient a DTensor of the weight's
    placements), and divided by 2; the rows' gradients bit for bit; an expert without rows gets zeros."""
    function = {k: v for k, v in found["function"].items() if not k.startswith("written_")}
    assert len(function) == 6, function
    for key, got in function.items():
        assert got["rel"] <= 1e-6 and got["grads_x_equal"] and got["empty_expert_zero"], (key, got)
        if key.startswith("dtensor"):
            assert got["dtensor_grad"], (key, got)


def test_a_first_micro_step_writes_the_gradient_over_where_asked(found):
    """Under ``gradients_written`` (a graph's first micro-step of a step) a stale gradient is written over in place with
    the micro-step's own (fp32, 1e-6), and the parameter is named as written (so the graphs do not zero it)."""
    written = {k: v for k, v in found["function"].items() if k.startswith("written_")}
    assert len(written) == 6, written
    for key, got in written.items():
        assert got["rel"] <= 1e-6 and got["registered"] and got["in_place"], (key, got)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    print(json.dumps(_measure()))


def test_the_layer_adds_its_weight_gradients_in_the_gemm_only_where_it_owns_them(found):
    """The layer with CPU's grouped GEMM standing in for CUDA's: three micro-steps' gradients with the weight gradients
    added in the GEMM equal autograd's (fp32, 1e-6), in Mixtral's and gpt-oss's layouts (an expert without rows: zeros);
    the layer takes them only with the switch on, gradients enabled and weights that need one."""
    for name, got in found["layer"].items():
        assert got["owned_on"] and not got["owned_off"] and not got["no_grad"] and not got["frozen"], (name, got)
        assert got["rel"] <= 1e-6 and got["empty_expert_zero"], (name, got)
