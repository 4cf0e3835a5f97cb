"""The native dropless expert-parallel MoE layer.

One token's trip through a layer:
  route (the model's top-k rule, see ``TopKRouter``) -> sort token copies by expert -> all-to-all to the ep
  rank that owns the expert -> grouped GEMM over the local experts -> all-to-all back -> weight by
  the router scores and sum the k copies of each token.

No capacity factor: every token copy is computed, an expert with zero tokens is fine.
Expert weights are DTensors sharded (Shard(0)) over the ep mesh; under FSDP2 (``parallelize.py``) they
are gathered over dp before the forward, which uses their local block. Their gradient is therefore
this ep group's contribution only: FSDP's reduce-scatter (or ``sync_expert_grads`` for FSDP1) sums it
over dp and scales it the way FSDP scales dense gradients (``grads.py``).
"""

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

# all_to_all_single_autograd is torch's functional collective with a backward (the reverse
# all-to-all); it lives in this underscore module, and torch has no public autograd all-to-all
# that takes a DeviceMesh or group with uneven splits otherwise.
from torch.distributed._functional_collectives import (
    all_to_all_single,
    all_to_all_single_autograd,
)
from torch.distributed.tensor import DTensor
from transformers.activations import ACT2FN

from megablocks_utils.parallel.mesh import MoEMesh


class TopKRouter(nn.Module):
    """Router logits -> (scores for the load-balancing loss, top-k weights, top-k experts).

    ``mode`` is the model table's ``router``: "softmax_topk" (Mixtral, Qwen, OLMoE; renormalised if
    asked), "topk_softmax" (Granite, gpt-oss: softmax over the k largest logits), "sigmoid_group_topk"
    (DeepSeek-V3, GLM-4.5) or "softmax_group_topk" (DeepSeek-V2): see ``MoESpec.router``. The first value is the fp32 softmax over all
    experts, or for sigmoid routing the sigmoid scores normalised to sum to 1 (DeepSeek-V3's
    sequence-wise balance loss uses these, should a load-balancing loss be asked for).

    A score bias (a buffer named ``score_bias``: the model's ``e_score_correction_bias``, or
    ``ADDED_BIAS`` that ``balance.add_routing_bias`` gives other models) is added to the scores the
    experts are ranked by (probabilities; Granite: logits) for the choice only: the weights stay the
    unbiased scores. It stays fp32 whatever the model's dtype, as transformers keeps it.
    ``bias``: the logits have a learned bias (gpt-oss), a parameter unlike the score bias.
    """

    MODES = ("softmax_topk", "topk_softmax", "sigmoid_group_topk", "softmax_group_topk")
    ADDED_BIAS = "routing_bias"  # the bias of models whose router has none of its own (not exported)

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        mode: str = "softmax_topk",
        *,
        num_groups: int = 1,
        topk_groups: int = 1,
        scaling: float = 1.0,
        score_bias: str | None = None,
        bias: bool = False,
    ):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"router mode {mode!r} is unknown; choose one of {self.MODES}")
        if num_experts % num_groups != 0 or not 1 <= topk_groups <= num_groups:
            raise ValueError(
                f"n_group={num_groups} must divide the {num_experts} experts and topk_group={topk_groups} be in "
                f"1..n_group; fix config.json"
            )
        self.top_k = top_k
        self.renormalize = renormalize
        self.mode = mode
        self.num_groups, self.topk_groups, self.scaling = num_groups, topk_groups, scaling
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None
        self.bias_name = None
        if score_bias is not None:
            self.add_score_bias(score_bias)

    def add_score_bias(self, name: str) -> None:
        """Register the per-expert selection bias (zeros, fp32) under ``name``."""
        self.register_buffer(name, torch.zeros(self.weight.shape[0], dtype=torch.float32, device=self.weight.device))
        self.bias_name = name

    @property
    def score_bias(self) -> torch.Tensor | None:
        return getattr(self, self.bias_name) if self.bias_name is not None else None

    def keep_bias_fp32(self) -> None:
        """Undo a ``module.to(bf16)`` on the bias: steps of 1e-3 vanish in bf16 next to values near 1."""
        if self.bias_name is not None:
            setattr(self, self.bias_name, self.score_bias.float())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        bias = self.score_bias
        if self.mode == "sigmoid_group_topk":
            return self._sigmoid_group_topk(x, bias)
        if self.mode == "softmax_group_topk":
            return self._softmax_group_topk(x, bias)
        logits = F.linear(x, self.weight, self.bias).float()
        probs = torch.softmax(logits, dim=-1)
        if self.mode == "topk_softmax":
            if bias is None:
                top_logits, top_i = torch.topk(logits, self.top_k, dim=-1)
            else:
                top_i = torch.topk(logits + bias, self.top_k, dim=-1)[1]
                top_logits = logits.gather(1, top_i)
            return probs, torch.softmax(top_logits, dim=-1), top_i
        if bias is None:
            top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:
            top_i = torch.topk(probs + bias, self.top_k, dim=-1)[1]
            top_w = probs.gather(1, top_i)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w, top_i

    def _keep_best_groups(self, choice: torch.Tensor, group_score: str) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``topk_groups`` best groups set to -inf; a group
        scores the sum of its 2 best experts ("top2_sum", DeepSeek-V3) or its best one ("max", DeepSeek-V2)."""
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, self.num_groups, num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if group_score == "top2_sum" else grouped.amax(dim=-1)
        groups = torch.topk(group_scores, self.topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1.0).bool()
        return choice.masked_fill(~keep.repeat_interleave(num_experts // self.num_groups, dim=1), float("-inf"))

    def _softmax_group_topk(self, x: torch.Tensor, bias: torch.Tensor | None):
        # transformers masks the other groups' scores to 0, not -inf: the same choice, as softmax scores are > 0
        # (and -inf keeps an added routing bias from reviving them).
        logits = F.linear(x.float(), self.weight.float())  # fp32 inputs too, as transformers computes it
        probs = torch.softmax(logits, dim=-1)
        choice = probs if bias is None else probs + bias
        if self.num_groups > 1:
            choice = self._keep_best_groups(choice, "max")
        top_i = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        top_w = probs.gather(1, top_i)
        if self.renormalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w * self.scaling, top_i

    def _sigmoid_group_topk(self, x: torch.Tensor, bias: torch.Tensor | None):
        logits = F.linear(x.float(), self.weight.float())  # fp32 inputs too, as transformers computes it
        scores = logits.sigmoid()
        choice = self._keep_best_groups(scores if bias is None else scores + bias, "top2_sum")
        top_i = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        top_w = scores.gather(1, top_i)
        if self.renormalize:
            top_w = top_w / (top_w.sum(dim=-1, keepdim=True) + 1e-20)
        return scores / scores.sum(dim=-1, keepdim=True), top_w * self.scaling, top_i


def grouped_mm_supported(x: torch.Tensor) -> bool:
    """torch's grouped GEMM kernels need CUDA sm80+ and bf16; elsewhere we loop over experts."""
    return x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 8


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "grouped_mm"):  # public since torch 2.12
        return F.grouped_mm(a, b, offs=offs)
    return torch._grouped_mm(a, b, offs=offs)  # the same kernel under its older name


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused [rows, 2I] projection: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's expert activation: gate clamped from above, up on both sides, a sigmoid of gain alpha,
    and up shifted by one (the same operations in the same order as transformers' ``GptOssExperts``)."""
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _weigh(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each expert output row times its fp32 router weight (the product in fp32, as transformers does)."""
    return (out * weights.unsqueeze(-1)).to(dtype)


def _gather_combine(out: torch.Tensor, copy_row: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's k expert outputs (rows ``copy_row`` [T * k] of ``out``) weighted and summed in fp32.

    The compiled form of weighting + ``index_add``: one kernel that gathers a token's k rows and writes
    the token once, instead of a zero fill, a weighting pass and bf16 atomic adds. Its backward is a
    gather too (each copy row belongs to exactly one token), so it needs no atomics either.
    """
    num_tokens, k = top_w.shape
    rows = out[copy_row].view(num_tokens, k, out.shape[-1])
    return (rows * top_w.unsqueeze(-1)).sum(dim=1).to(dtype)


@functools.cache
def _fused(fn):
    """``fn`` compiled: on CUDA its element-wise steps run as one generated kernel each way (forward and
    backward) instead of several passes over [tokens * k, 2I] or [tokens * k, H]. Compiled on first use,
    so CPU runs never load the compiler.

    Row counts change every step. torch.compile's automatic dynamic shapes make only the dimension that
    changed (the rows) symbolic and keep the width a constant. ``dynamic=True`` (every dimension symbolic)
    made the SwiGLU kernel 2.7x slower (forward + backward 3.77 ms vs 1.39 ms at 16384 x 28672 on an
    H200, bench/kernel_bench.py): with a symbolic width each element pays a 64-bit division for its column."""
    return torch.compile(fn)


def _gather_sum(grad: torch.Tensor, copy_row: torch.Tensor, k: int) -> torch.Tensor:
    """Row t of the result: the sum, in fp32, of rows ``copy_row[t * k : (t + 1) * k]`` of ``grad``."""
    return grad[copy_row].view(-1, k, grad.shape[-1]).float().sum(dim=1).to(grad.dtype)


class _Dispatch(torch.autograd.Function):
    """``x[token_of_copy]`` (each token's k copies, in expert order) with a gather for its backward.

    Autograd's backward of the indexing is a scatter-add into x (index_put with accumulate: on CUDA a sort
    and a serial pass over duplicate indices). Each token's k copies sit at known rows (``copy_row``), so the
    gradient of a token is the sum of those k rows: a gather, summed in fp32 (as that kernel accumulates).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, token_of_copy: torch.Tensor, copy_row: torch.Tensor, k: int, fuse: bool) -> torch.Tensor:
        ctx.save_for_backward(copy_row)
        ctx.k, ctx.fuse = k, fuse
        return x[token_of_copy]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (copy_row,) = ctx.saved_tensors
        return (_fused(_gather_sum) if ctx.fuse else _gather_sum)(grad, copy_row, ctx.k), None, None, None, None


class _ExpertBias(torch.autograd.Function):
    """``rows + bias[row_expert]`` for rows grouped by expert (``counts`` rows each), with a segment sum for
    the bias gradient: autograd's scatter-add of thousands of rows into a few expert rows runs serially over
    the duplicates on CUDA. Summed in fp32; no host sync (``unsafe``: the counts are ours, and sum to the rows)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, bias: torch.Tensor, row_expert: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(counts)
        ctx.bias_dtype = bias.dtype
        return rows + bias[row_expert]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (counts,) = ctx.saved_tensors
        grad_bias = torch.segment_reduce(grad.float(), "sum", lengths=counts, axis=0, unsafe=True)
        return grad, grad_bias.to(ctx.bias_dtype), None, None


def _divide_cast(grad: torch.Tensor, divisor: float, dtype: torch.dtype) -> torch.Tensor:
    return (grad.float() / divisor).to(dtype)


class _CastDivided(torch.autograd.Function):
    """``weight.to(dtype)``; the backward casts the gradient back to the
    weight's dtype divided by ``divisor``, in one pass: what FSDP's reduce would do (fp32, then the weight's
    dtype) for experts it leaves out (dp = 1: nothing summed, only the division by world size). ``fuse``: one
    compiled kernel (CUDA, power-of-two divisor: multiplying by its exact reciprocal, as the compiler may, then
    changes no bit); else eager ops."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, dtype: torch.dtype, divisor: float, fuse: bool) -> torch.Tensor:
        ctx.weight_dtype, ctx.divisor, ctx.fuse = weight.dtype, divisor, fuse
        return weight.to(dtype) if weight.dtype != dtype else weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.divisor == 1:
            return grad.to(ctx.weight_dtype), None, None, None
        divide = _fused(_divide_cast) if ctx.fuse else _divide_cast
        return divide(grad, ctx.divisor, ctx.weight_dtype), None, None, None


class ExpertParallelExperts(nn.Module):
    """This rank's experts of one layer, stored fused like transformers 5 does.

    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] are DTensors sharded on dim 0 over "ep";
    the names match transformers' fused layout so state dicts line up with ``MixtralExperts``,
    ``Qwen2MoeExperts`` and the other fused expert modules of transformers 5. A model table row may
    ask for transformers' other layouts (``models.MoESpec``): ``transposed`` weights ([E, H, 2I] and
    [E, I, H]), gate and up in alternating columns (``interleaved``), and per-expert biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H], sharded like the weights (gpt-oss).
    ``act_fn`` is a transformers activation name, or "gpt_oss_swiglu" (clamped, with ``alpha`` and ``limit``).
    """

    def __init__(
        self,
        num_experts: int,
        mesh: MoEMesh,
        act_fn: str,
        *,
        transposed: bool = False,
        interleaved: bool = False,
        bias: bool = False,
        alpha: float | None = None,
        limit: float | None = None,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.mesh = mesh
        # Read once: the forward then calls no DeviceMesh method for it (torch 2.11's dynamo fails tracing them, which
        # compiling a whole decoder layer would do; the group comes from ``_ep_group``, outside compile).
        self.ep_size = mesh.ep_size
        self.num_local_experts = num_experts // mesh.ep_size
        self.transposed = transposed
        self.interleaved = interleaved
        self.has_bias = bias
        if act_fn == "gpt_oss_swiglu":
            if alpha is None or limit is None:
                raise ValueError("act_fn='gpt_oss_swiglu' needs alpha and limit (config.swiglu_alpha, config.swiglu_limit)")
            self.act_fn = None
            self.clamped_swiglu = (float(alpha), float(limit))
        else:
            self.act_fn = ACT2FN[act_fn]
            self.clamped_swiglu = None
        self.force_loop = False  # tests set this to check grouped GEMM against the reference loop
        # Experts FSDP leaves out (parallelize: dp = 1): their gradients divided by world size in the cast's backward.
        self.grad_divisor = 1
        self.is_silu = act_fn == "silu" and not interleaved
        self.compile_elementwise = True  # on CUDA, torch.compile the SiLU*up and the weighted combine of the k outputs
        self.overlap_chunks = 1  # ep > 1: tokens in this many chunks, one's all-to-all beside another's experts (forward)
        self.lora = None  # finetuning="lora": the experts' adapters (moe/lora.py ExpertLoRA), added by model/lora.py

    def fuse_elementwise(self, t: torch.Tensor) -> bool:
        return self.compile_elementwise and t.is_cuda

    def set_weights(
        self, gate_up_proj: DTensor, down_proj: DTensor, gate_up_proj_bias: DTensor | None = None, down_proj_bias: DTensor | None = None
    ) -> None:
        self.gate_up_proj = nn.Parameter(gate_up_proj)
        self.down_proj = nn.Parameter(down_proj)
        if (gate_up_proj_bias is not None) != self.has_bias or (down_proj_bias is not None) != self.has_bias:
            raise ValueError(f"these experts {'need' if self.has_bias else 'take no'} biases (the model table's expert_bias)")
        if self.has_bias:
            self.gate_up_proj_bias = nn.Parameter(gate_up_proj_bias)
            self.down_proj_bias = nn.Parameter(down_proj_bias)

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """(gate_up_proj, down_proj), then the biases where there are any."""
        if self.has_bias:
            return self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias
        return self.gate_up_proj, self.down_proj

    @torch.compiler.disable  # torch 2.11's dynamo fails on DeviceMesh internals
    def _ep_group(self) -> "torch.distributed.ProcessGroup":
        # Looked up when used, not kept on the module, so the model holds no ProcessGroup past
        # destroy_process_group (suspected, not shown, in one aborted shutdown after SIGTERM).
        return self.mesh.ep_group

    @torch.compiler.disable  # DTensor.to_local under torch 2.11's dynamo reads DeviceMesh internals it lacks
    def _local_weights(self, dtype: torch.dtype, tensors=None) -> tuple[torch.Tensor, ...]:
        """``expert_tensors()``' (or ``tensors``') local blocks in ``dtype``, their gradients divided by ``grad_divisor``
        on the way back."""
        local = [w.to_local() if isinstance(w, DTensor) else w for w in (self.expert_tensors() if tensors is None else tensors)]
        if local[0].dtype == dtype and self.grad_divisor == 1:
            return tuple(local)
        divisor = self.grad_divisor
        fuse = self.fuse_elementwise(local[0]) and divisor & (divisor - 1) == 0
        return tuple(_CastDivided.apply(w, dtype, float(divisor), fuse) for w in local)

    def _split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.interleaved:
            return gate_up[..., ::2], gate_up[..., 1::2]
        return gate_up.chunk(2, dim=-1)

    def _activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The fused [rows, 2I] projection -> [rows, I]: the GLU of the model's activation."""
        gate, up = self._split(gate_up)
        if self.clamped_swiglu is not None:
            return _clamped_swiglu(gate, up, *self.clamped_swiglu)
        return self.act_fn(gate) * up

    def compute(self, x: torch.Tensor, counts: torch.Tensor, counts_host: list[int] | None = None) -> torch.Tensor:
        """Run the local experts on rows of ``x`` already grouped by local expert.

        ``counts_host`` (``counts`` as a list) is needed only by the per-expert loop; without it the loop reads
        ``counts`` itself, a host sync that the grouped GEMM path never makes.
        """
        weights = self._local_weights(x.dtype)
        adapters = self._local_weights(x.dtype, self.lora.tensors()) if self.lora is not None else ()
        if grouped_mm_supported(x) and not self.force_loop:
            w_gate_up, w_down = weights[:2]
            if not self.transposed:
                w_gate_up, w_down = w_gate_up.transpose(-2, -1), w_down.transpose(-2, -1)
            if len(counts) == 1:
                # One local expert (ep = number of experts): plain GEMMs, 8% faster than grouped_mm with one group
                # (13.26 vs 12.29 ms forward + backward at Mixtral width, bench/results/kernel_h200.jsonl).
                gemm = lambda a, w: a @ w[0]  # noqa: E731
                add_bias = lambda rows, bias: rows + bias[0]  # noqa: E731
            else:
                offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
                gemm = lambda a, w: _grouped_mm(a, w, offs)  # noqa: E731
                if self.has_bias:  # each row's expert, without a host sync
                    row_expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
                    add_bias = lambda rows, bias: _ExpertBias.apply(rows, bias, row_expert, counts)  # noqa: E731
            gate_up = gemm(x, w_gate_up)
            if adapters:
                gate_up = self.lora.add("gate_up_proj", gate_up, x, adapters, gemm)
            if self.has_bias:
                gate_up = add_bias(gate_up, weights[2])
            if self.fuse_elementwise(gate_up) and self.is_silu:
                hidden = _fused(_silu_mul)(gate_up)
            else:
                hidden = self._activate(gate_up)
            out = gemm(hidden, w_down)
            if adapters:
                out = self.lora.add("down_proj", out, hidden, adapters, gemm)
            return add_bias(out, weights[3]) if self.has_bias else out
        return self.expert_loop(x, counts.tolist() if counts_host is None else counts_host, *weights, adapters=adapters)

    def expert_loop(
        self,
        x: torch.Tensor,
        counts_host: list[int],
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        b_gate_up: torch.Tensor | None = None,
        b_down: torch.Tensor | None = None,
        adapters: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """The reference computation: one pair of GEMMs per local expert (any device, any dtype). ``adapters``:
        the local blocks of ``self.lora.tensors()``."""
        outputs = []
        for e, rows in enumerate(torch.split(x, counts_host)):
            one = lambda a, w, e=e: a @ w[e]  # noqa: E731  (the adapters' product for this expert)
            if self.transposed:  # x @ W + b, as transformers computes these layouts
                gate_up = rows @ w_gate_up[e]
                gate_up = gate_up + b_gate_up[e] if b_gate_up is not None else gate_up
            else:
                gate_up = F.linear(rows, w_gate_up[e], b_gate_up[e] if b_gate_up is not None else None)
            if adapters:
                gate_up = self.lora.add("gate_up_proj", gate_up, rows, adapters, one)
            hidden = self._activate(gate_up)
            if self.transposed:
                out = hidden @ w_down[e]
                out = out + b_down[e] if b_down is not None else out
            else:
                out = F.linear(hidden, w_down[e], b_down[e] if b_down is not None else None)
            outputs.append(self.lora.add("down_proj", out, hidden, adapters, one) if adapters else out)
        hidden_size = w_down.shape[-1] if self.transposed else w_down.shape[1]
        return torch.cat(outputs) if outputs else x.new_zeros(0, hidden_size)

    def forward(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_i/top_w [T, k] -> [T, H] (the same contract as transformers' experts).

        With ``overlap_chunks`` = C > 1 (and ep > 1) the tokens go through in C consecutive chunks whose
        collectives are issued so that one chunk's all-to-all can run while another's experts compute (every
        dispatch first, then each chunk's experts and its return trip): the same result, one host sync.
        """
        num_tokens, k = top_i.shape
        ep = self.ep_size
        pieces = 1 if ep == 1 else max(1, min(self.overlap_chunks, num_tokens))
        if pieces == 1:  # x whole: a slice's backward would allocate and fill a zero gradient of all of x
            parts = [(x, top_i, top_w)]
        else:
            edges = [num_tokens * i // pieces for i in range(pieces + 1)]
            parts = [(x[a:b], top_i[a:b], top_w[a:b]) for a, b in zip(edges[:-1], edges[1:])]
        routes = [self._route(part_i) for _, part_i, _ in parts]
        routed = [_Dispatch.apply(part_x, r.token_of_copy, r.copy_row, k, self.fuse_elementwise(x)) for (part_x, _, _), r in zip(parts, routes)]
        if ep == 1:  # no host sync: the grouped GEMM reads the counts on the GPU
            outs = [self.compute(routed[0], routes[0].counts)]
        else:
            outs = self._exchange(routed, [r.counts for r in routes])
        combined = [self._combine(out, r, part_w, x.dtype) for out, r, (_, _, part_w) in zip(outs, routes, parts)]
        return combined[0] if pieces == 1 else torch.cat(combined)

    def _route(self, top_i: torch.Tensor) -> "_Route":
        """Token copies sorted by expert: the order, each copy's token, each token's copy rows, tokens per expert."""
        k = top_i.shape[1]
        flat_expert = top_i.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        # copy_row[t * k + j]: the row (in expert order) of token t's j-th choice.
        copy_row = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # Tokens per expert; bincount would sync with the host on CUDA (its length depends on the largest index).
        counts = flat_expert.new_zeros(self.num_experts).scatter_add_(0, flat_expert, torch.ones_like(flat_expert))
        return _Route(order, order // k, copy_row, counts)

    def _exchange(self, routed: list[torch.Tensor], counts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each chunk's rows (expert order) to the ep ranks owning their experts, through the local experts, and
        back: the outputs in the order the rows were sent. One count exchange and host sync for all chunks."""
        ep, local, group, chunks = self.ep_size, self.num_local_experts, self._ep_group(), len(routed)
        # send[r, c, e]: chunk c's copies for rank r's local expert e; recv[s, c, e]: rank s's for my expert e.
        send = torch.stack(counts).view(chunks, ep, local).transpose(0, 1)
        recv = all_to_all_single(send.reshape(-1), None, None, group).view(ep, chunks, local)
        # Rows per chunk and peer rank, sent and received ([c][rank] each): the one host sync of the layer.
        send_splits, recv_splits = torch.stack([send.sum(-1).T, recv.sum(-1).T]).tolist()
        received = [all_to_all_single_autograd(rows, recv_splits[c], send_splits[c], group) for c, rows in enumerate(routed)]
        outs = []
        for c in range(chunks):
            recv_counts = recv[:, c, :].reshape(-1)  # source-major: [s * local + e]
            # Received rows are source-major; the experts want them expert-major.
            slot = torch.repeat_interleave(
                torch.arange(ep * local, device=recv_counts.device), recv_counts.to(torch.long), output_size=sum(recv_splits[c])
            )
            regroup = torch.argsort((slot % local) * ep + slot // local, stable=True)
            expert_out = self.compute(received[c][regroup], recv[:, c, :].sum(0))
            source_major = torch.empty_like(expert_out).index_copy(0, regroup, expert_out)
            outs.append(all_to_all_single_autograd(source_major, send_splits[c], recv_splits[c], group))
        return outs

    def _combine(self, out: torch.Tensor, route: "_Route", top_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each token's k expert outputs (``out``: rows in expert order) weighted by its router weights and summed."""
        if self.fuse_elementwise(out):
            return _fused(_gather_combine)(out, route.copy_row, top_w, dtype)
        weights = top_w.reshape(-1)[route.order]
        num_tokens = top_w.shape[0]
        return out.new_zeros(num_tokens, out.shape[-1], dtype=dtype).index_add(0, route.token_of_copy, _weigh(out, weights, dtype))


class _Route(NamedTuple):
    order: torch.Tensor  # token copies (token-major, t * k + j) sorted by expert
    token_of_copy: torch.Tensor  # each sorted copy's token
    copy_row: torch.Tensor  # each token copy's row in expert order
    counts: torch.Tensor  # token copies per expert [E]


class ExpertParallelMoE(nn.Module):
    """A dropless expert-parallel replacement for a transformers MoE block (``layer.mlp`` and the like).

    The router lives under the model's own attribute name (``router_attr``: "gate", "router") and a
    shared expert, if the model has one, stays transformers' own module under its own name, so
    parameter names match the single-process model. ``router`` is the router whatever its name.

    While ``record_router`` is on, the forward keeps this layer's router probabilities and choices
    for the load-balancing loss (see ``aux_loss.py``); ``shard_moe`` turns it on at each model
    forward and the loss turns it off, so recomputation under activation checkpointing records
    nothing and routes exactly as the first pass did (routing is a pure function of the input).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        mesh,
        act_fn: str,
        *,
        router_attr: str = "gate",
        router_mode: str = "softmax_topk",
        router_options: dict | None = None,
        router_bias: bool = False,
        returns_scores: bool = False,
        experts: ExpertParallelExperts | None = None,
    ):
        super().__init__()
        self.router_attr = router_attr
        router = TopKRouter(hidden_size, num_experts, top_k, renormalize, router_mode, bias=router_bias, **(router_options or {}))
        setattr(self, router_attr, router)
        # The experts' forward is the backend: this module's own (moe_backend="native") or megablocks'
        # (megablocks_backend.MegablocksExperts, a subclass holding the same weights).
        self.experts = experts if experts is not None else ExpertParallelExperts(num_experts, mesh, act_fn)
        # gpt-oss's decoder layer unpacks (hidden states, router scores) from its MoE block.
        self.returns_scores = returns_scores
        self.shared_expert_attr = None
        self.shared_gate_attr = None
        self.record_router = False
        self.router_probs = None
        self.router_choices = None

    @property
    def top_k_router(self) -> TopKRouter:
        return getattr(self, self.router_attr)

    def add_shared_expert(self, attr: str, expert: nn.Module, gate_attr: str | None = None, gate: nn.Module | None = None) -> None:
        """Add ``expert(x)`` (times ``sigmoid(gate(x))`` if a gate is given) to every token's output."""
        self.shared_expert_attr = attr
        setattr(self, attr, expert)
        if gate is not None:
            self.shared_gate_attr = gate_attr
            setattr(self, gate_attr, gate)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        probs, top_w, top_i = self.top_k_router(x)
        if self.record_router:
            self.router_probs, self.router_choices = probs, top_i
        out = self.experts(x, top_i, top_w)
        if self.shared_expert_attr is not None:
            shared = getattr(self, self.shared_expert_attr)(x)
            if self.shared_gate_attr is not None:
                shared = torch.sigmoid(getattr(self, self.shared_gate_attr)(x)) * shared
            out = out + shared
        if self.returns_scores:
            return out.reshape(shape), top_w
        return out.reshape(shape)
