"""The local experts' computation: rows already grouped by expert through each expert's gated MLP.

Grouped GEMMs over all local experts at once (CUDA sm80+, bf16), or one pair of GEMMs per expert
elsewhere (the reference the grouped path is tested against). The weights are given per call: the layer
(``layer.ExpertParallelExperts``) holds them under transformers' names and casts them first (``cast.py``).
"""

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from megablocks_utils.moe.fused import fused
from megablocks_utils.moe.quantized import QuantizedWeight
from megablocks_utils.moe.weight_grad import WeightGradInto, grouped_mm, grouped_mm_grad_into


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM kernels need CUDA sm80+ and bf16; elsewhere we loop over experts."""
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused [rows, 2I] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    """``_silu_mul`` as one kernel each way: the backward our Triton kernel (``swiglu_kernel.py``: gate, up and the
    gradient read once, where the compiled backward reads two of them twice); the forward compiled (``fused``), or
    where ``valid`` is given our Triton forward, both over the rows below it only."""

    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(gate_up, valid)
        return _silu_mul_forward(gate_up, valid)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from megablocks_utils.moe.swiglu_kernel import silu_mul_backward  # Triton: imported where a GPU runs it

        gate_up, valid = ctx.saved_tensors
        return silu_mul_backward(gate_up, grad, valid), None


def silu_mul(gate_up: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU on the fused [rows, 2I] projection as one kernel each way (CUDA; ``compile_elementwise``). ``valid``: the
    rows the GEMMs around it cover (a device int); the rows past it (activations and gradients) are left unwritten."""
    return _SiluMul.apply(gate_up, valid)


class _SiluMulDown(torch.autograd.Function):
    """SwiGLU, then the down projection, saving gate_up only: the backward makes SwiGLU's output again (the forward's
    own kernel, so the same bits) instead of keeping it for the down GEMM's weight gradient. That output is
    2 x k x I bytes a token and layer (Mixtral-8x7B: 57 KB, ~7 GiB a 4,096-token micro-batch over 32 layers); making it
    again is one element-wise pass over gate_up (1-2% of a step on one H200, 2026-11-29: BENCHMARKS.md's memory table).
    ``w_down`` as stored ([E, H, I], used as ``h @ w_e^T`` with ``transpose_weight``; or [E, I, H]); ``into``: where its
    gradient goes (``weight_grad.WeightGradInto``), or None: returned to autograd."""

    @staticmethod
    def forward(ctx, gate_up, w_down, offs, valid, into, transpose_weight):
        ctx.save_for_backward(gate_up, w_down, offs, valid)
        ctx.into, ctx.transpose_weight = into, transpose_weight
        hidden = _silu_mul_forward(gate_up, valid)
        return grouped_mm(hidden, w_down.transpose(-2, -1) if transpose_weight else w_down, offs)

    @staticmethod
    def backward(ctx, grad_out):
        from megablocks_utils.moe.swiglu_kernel import silu_mul_backward  # Triton: imported where a GPU runs it

        gate_up, w_down, offs, valid = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        hidden = _silu_mul_forward(gate_up, valid)
        grad_hidden = grouped_mm(grad_out, w_down if ctx.transpose_weight else w_down.transpose(-2, -1), offs)
        a, b = (grad_out, hidden) if ctx.transpose_weight else (hidden, grad_out)  # w_e's gradient: a_e^T @ b_e
        grad_w = None
        if ctx.into is not None:
            ctx.into.add(a, b, offs)
        elif ctx.needs_input_grad[1]:
            grad_w = grouped_mm(a.t(), b, offs)
        del hidden
        grad_gate_up = silu_mul_backward(gate_up, grad_hidden, valid) if ctx.needs_input_grad[0] else None
        return grad_gate_up, grad_w, None, None, None, None


def _silu_mul_forward(gate_up: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """``_SiluMul``'s forward: compiled, or our Triton kernel over the rows below ``valid``."""
    if valid is None:
        return fused(_silu_mul)(gate_up)
    from megablocks_utils.moe.swiglu_kernel import silu_mul_forward  # Triton: imported where a GPU runs it

    return silu_mul_forward(gate_up, valid)


def silu_mul_down(gate_up: torch.Tensor, w_down: torch.Tensor, offs: torch.Tensor, valid: torch.Tensor | None,
                  into: WeightGradInto | None, transpose_weight: bool) -> torch.Tensor:
    """``grouped_mm(silu_mul(gate_up, valid), w_down)`` (``w_down`` as stored, see ``_SiluMulDown``) without keeping
    SwiGLU's output for the backward (the layer's ``recompute_swiglu``). CUDA grouped GEMMs."""
    return _SiluMulDown.apply(gate_up, w_down, offs, valid, into, transpose_weight)


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: gate clamped from above, up on both sides, a sigmoid of gain alpha,
    and up shifted by one (the same operations in the same order as transformers' ``GptOssExperts``)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _gpt_oss_glu(gate_up: torch.Tensor, alpha: float, limit: float, interleaved: bool) -> torch.Tensor:
    """The fused [rows, 2I] projection -> [rows, I] through gpt-oss's clamped SwiGLU (compiled as one kernel each way
    on CUDA: ``fused``; eager, its strided split and clamps were ~150 ms of a gpt-oss-20b step, bench/profile_steps.py)."""
    return _clamped_swiglu(*_split_gate_up(gate_up, interleaved), alpha, limit)


def _split_gate_up(gate_up: torch.Tensor, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up from the fused projection: alternating columns (``interleaved``) or the two halves."""
    if interleaved:
        return gate_up[..., ::2], gate_up[..., 1::2]
    return gate_up.chunk(2, dim=-1)


def expert_one_hot(counts: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, E] in ``dtype``: 1 where a row (grouped by expert, ``counts`` rows each) belongs to the expert.
    No host sync (``output_size`` is given)."""
    experts = torch.arange(len(counts), device=counts.device)
    row_expert = torch.repeat_interleave(experts, counts, output_size=rows)
    return (row_expert.unsqueeze(1) == experts).to(dtype)


def add_expert_bias(rows: torch.Tensor, one_hot: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``rows + bias[row_expert]`` as one GEMM with the add in its epilogue: ``addmm(rows, one_hot, bias)``.
    Each output is the row's value plus exactly one bias entry, summed in fp32 and rounded once, as the indexed add;
    the bias gradient is ``one_hot.T @ grad``, the per-expert sum accumulated in fp32 by the GEMM (autograd's
    index backward scatter-adds thousands of rows into a few, serially on CUDA; an fp32 segment sum cost a copy)."""
    return torch.addmm(rows, one_hot, bias)


# The largest ep at which the layers' ``recompute_swiglu`` has run on GPUs (tests/gpu, one H200): above it the setting
# stays off and the run says so (parallel/activation_checkpointing.py). Raise it where tests/gpu has passed with it.
RECOMPUTE_SWIGLU_RAN_AT_EP = 1


def makes_swiglu_again(local: "LocalExperts", fuse: bool, local_experts: int, adapters: bool) -> bool:
    """Whether ``recompute_swiglu`` applies: SiLU * up as our kernels (``fuse``, CUDA), several local experts (one takes
    plain GEMMs) and no LoRA on the experts (its down adapter reads SwiGLU's output, so that is kept)."""
    return fuse and local.is_silu and local_experts > 1 and not adapters


def _one_expert(rows: torch.Tensor, w, bias: torch.Tensor | None, e: int, transposed: bool) -> torch.Tensor:
    """``rows`` through expert ``e``'s weight and bias as transformers computes each layout: [out, in] (``F.linear``),
    [in, out] (``transposed``: x @ W + b), or held quantized (``QuantizedWeight``, dequantized inside its GEMM)."""
    if isinstance(w, QuantizedWeight):
        out = w.matmul(rows, expert=e)
    elif transposed:
        out = rows @ w[e]
    else:
        return F.linear(rows, w[e], bias[e] if bias is not None else None)
    return out + bias[e] if bias is not None else out


class LocalExperts:
    """How this rank's experts compute: [rows, H] grouped by expert -> [rows, H].

    Each expert is ``down(glu(gate_up(x)))``. Weights, in ``ExpertParallelExperts.expert_tensors()`` order
    (gate_up, down, then the biases where the model has them), come with each call. ``transposed``: weights
    of [E, H, 2I] and [E, I, H] (x @ W) instead of [E, 2I, H] and [E, H, I]; ``interleaved``: gate and up in
    alternating columns; ``act_fn``: a transformers activation name, or "gpt_oss_swiglu" (clamped, with
    ``alpha`` and ``limit``). ``force_loop``: the per-expert loop even where grouped GEMMs run (to test one
    against the other).
    """

    def __init__(
        self,
        act_fn: str,
        *,
        transposed: bool = False,
        interleaved: bool = False,
        alpha: float | None = None,
        limit: float | None = None,
        force_loop: bool = False,
    ):
        self.transposed = transposed
        self.interleaved = interleaved
        if act_fn == "gpt_oss_swiglu":
            if alpha is None or limit is None:
                raise ValueError("act_fn='gpt_oss_swiglu' needs alpha and limit (config.swiglu_alpha, config.swiglu_limit)")
            self.act_fn = None
            self.clamped_swiglu = (float(alpha), float(limit))
        else:
            self.act_fn = ACT2FN[act_fn]
            self.clamped_swiglu = None
        self.is_silu = act_fn == "silu" and not interleaved
        self.force_loop = force_loop

    def __call__(
        self, x: torch.Tensor, counts: torch.Tensor, weights: tuple[torch.Tensor, ...], counts_host: list[int] | None = None, *,
        fuse: bool = False, lora=None, adapters: tuple[torch.Tensor, ...] = (), grads_into: tuple[WeightGradInto, ...] | None = None,
        padded: bool = False, recompute_swiglu: bool = False,
    ) -> torch.Tensor:
        """``counts`` rows of ``x`` per local expert through their experts. ``counts_host`` (``counts`` as a list)
        is needed only by the per-expert loop; without it the loop reads ``counts`` itself, a host sync that the
        grouped GEMM path never makes. ``fuse``: the GLU (SiLU * up, or gpt-oss's clamped SwiGLU) as one compiled
        kernel (CUDA). ``lora``/``adapters``: the experts' LoRA (moe/lora.py) and the local blocks of its tensors,
        added after each projection. ``grads_into`` (only where ``uses_grouped_gemms``): gate_up's and down's gradients
        added by the GEMMs' backward into their parameters (``weight_grad.py``), whose weights then come without
        autograd edge. ``padded``: rows past the counts' sum follow (the static exchange's), which the grouped path's
        SwiGLU then leaves alone. ``recompute_swiglu``: the backward makes SwiGLU's output again rather than keep it
        (``silu_mul_down``), where it applies (``makes_swiglu_again``)."""
        if not self.loops(x):
            return self.grouped(x, counts, weights, fuse, lora, adapters, grads_into, padded, recompute_swiglu)
        if grads_into is not None:
            raise ValueError("grads_into needs the grouped GEMMs (uses_grouped_gemms)")
        return self.loop(x, counts.tolist() if counts_host is None else counts_host, weights, lora, adapters)

    def uses_grouped_gemms(self, x: torch.Tensor, counts: torch.Tensor) -> bool:
        """Whether these rows go through torch's grouped GEMM: CUDA sm80+ bf16, more than one local expert (one
        takes plain GEMMs), and not ``force_loop``."""
        return grouped_mm_supported(x) and not self.force_loop and len(counts) > 1

    def loops(self, x: torch.Tensor) -> bool:
        """Whether these rows take the per-expert loop (which splits them by counts read on the host), not the grouped
        GEMM or, with one local expert, its plain GEMMs (which read the counts on the device)."""
        return self.force_loop or not grouped_mm_supported(x)

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The fused [rows, 2I] projection -> [rows, I]: the GLU of the model's activation."""
        if self.clamped_swiglu is not None:
            return _gpt_oss_glu(gate_up, *self.clamped_swiglu, self.interleaved)
        gate, up = _split_gate_up(gate_up, self.interleaved)
        return self.act_fn(gate) * up

    def grouped(self, x: torch.Tensor, counts: torch.Tensor, weights: tuple[torch.Tensor, ...], fuse: bool, lora=None,
                adapters: tuple[torch.Tensor, ...] = (), grads_into: tuple[WeightGradInto, ...] | None = None,
                padded: bool = False, recompute_swiglu: bool = False) -> torch.Tensor:
        """All local experts in one grouped GEMM per projection; ``counts`` stays on the device (no host sync)."""
        has_bias = len(weights) == 4
        w_gate_up, w_down = weights[:2]
        quantized = isinstance(w_gate_up, QuantizedWeight)
        if not self.transposed and not quantized:
            w_gate_up, w_down = w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1)
        if len(counts) == 1:
            # One local expert (ep = number of experts): plain GEMMs, 8% faster than grouped_mm with one group
            # (13.26 vs 12.29 ms forward + backward at Mixtral width, bench/results/parity_throughput_megablocks_h100-h200_2026-11-20-21/records.md#kernel_h200jsonl).
            gemm = lambda a, w: a @ w[0]  # noqa: E731
            add_bias = lambda rows, bias: rows + bias[0]  # noqa: E731
        else:
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
            gemm = lambda a, w: grouped_mm(a, w, offs)  # noqa: E731
            if has_bias:
                one_hot = expert_one_hot(counts, x.shape[0], x.dtype)
                add_bias = lambda rows, bias: add_expert_bias(rows, one_hot, bias)  # noqa: E731
        gemm_gate_up = gemm_down = gemm
        if quantized:  # the frozen base dequantized inside its GEMMs (moe/quantized.py); the adapters as they are
            group = {"offs": offs} if len(counts) > 1 else {"expert": 0}
            gemm_gate_up = gemm_down = lambda a, w: w.matmul(a, **group)  # noqa: E731
        if grads_into is not None and len(counts) == 1:
            raise ValueError("grads_into needs the grouped GEMMs (uses_grouped_gemms): one local expert takes plain GEMMs")
        if grads_into is not None:  # the weights as stored ([E, 2I, H] unless transposed), their gradients into place
            gemm_gate_up = lambda a, w: grouped_mm_grad_into(a, weights[0], offs, grads_into[0], not self.transposed)  # noqa: E731
            gemm_down = lambda a, w: grouped_mm_grad_into(a, weights[1], offs, grads_into[1], not self.transposed)  # noqa: E731
        gate_up = gemm_gate_up(x, w_gate_up)
        if adapters:  # two more grouped GEMMs on the same rows: x @ A_e, then @ B_e (no delta weight)
            gate_up = lora.add("gate_up_proj", gate_up, x, adapters, gemm)
        if has_bias:
            gate_up = add_bias(gate_up, weights[2])
        valid = offs[-1:] if padded and len(counts) > 1 else None
        if recompute_swiglu and not quantized and makes_swiglu_again(self, fuse, len(counts), bool(adapters)):
            out = silu_mul_down(gate_up, weights[1], offs, valid, grads_into[1] if grads_into is not None else None,
                                not self.transposed)
            return add_bias(out, weights[3]) if has_bias else out
        if fuse and self.is_silu:
            # The grouped GEMMs stop at their last offset, so the rows past it (the static exchange's padding) are
            # never read, either way; one expert's plain GEMMs read every row (their weight gradients sum them). Rows
            # without padding keep the compiled forward and the unbounded backward (faster at Qwen3's width: the
            # bounded backward took 0.137 against 0.093 ms a call on one H200, 2026-11-29: bench/swiglu_bench.py,
            # retired, in git history at e823338).
            hidden = silu_mul(gate_up, valid)
        elif fuse and self.clamped_swiglu is not None:
            hidden = fused(_gpt_oss_glu)(gate_up, *self.clamped_swiglu, self.interleaved)
        else:
            hidden = self.activate(gate_up)
        out = gemm_down(hidden, w_down)
        if adapters:
            out = lora.add("down_proj", out, hidden, adapters, gemm)
        return add_bias(out, weights[3]) if has_bias else out

    def loop(self, x: torch.Tensor, counts_host: list[int], weights: tuple[torch.Tensor, ...], lora=None,
             adapters: tuple[torch.Tensor, ...] = ()) -> torch.Tensor:
        """The reference computation: one pair of GEMMs per local expert (any device, any dtype)."""
        w_gate_up, w_down = weights[:2]
        b_gate_up, b_down = weights[2:] if len(weights) == 4 else (None, None)
        outputs = []
        for e, rows in enumerate(torch.split(x, counts_host)):
            one = lambda a, w, e=e: a @ w[e]  # noqa: E731  (an adapter's product for this expert)
            gate_up = _one_expert(rows, w_gate_up, b_gate_up, e, self.transposed)
            if adapters:
                gate_up = lora.add("gate_up_proj", gate_up, rows, adapters, one)
            hidden = self.activate(gate_up)
            out = _one_expert(hidden, w_down, b_down, e, self.transposed)
            outputs.append(lora.add("down_proj", out, hidden, adapters, one) if adapters else out)
        hidden_size = w_down.shape[-1] if self.transposed else w_down.shape[1]
        return torch.cat(outputs) if outputs else x.new_zeros(0, hidden_size)
