"""Token-level causal-LM loss as a sum, so micro-batches and ranks can share one global denominator.

Two ways to the same sum of next-token cross-entropy over the label positions that are not IGNORE_INDEX:

``causal_lm_loss_sum(logits, labels)``: from the full logits the model returns. It holds, per row and vocabulary
entry, the bf16 logits, their fp32 copy and the fp32 log-softmax that cross-entropy saves, then the fp32 gradient:
12 bytes (Qwen3-30B-A3B, 4096 rows x 151,936 entries: 7 GiB), and it cost 19.4 ms of a 505 ms step on one H200
(BENCHMARKS.md, issue #29).

``LossHead`` (``install_loss_head``, the scripts' ``chunked_loss``): the model's lm_head, which during a
``forward_with_loss`` forward returns the summed loss instead of the logits, computed over chunks of rows
(``loss_chunk_rows``), so the logits of all rows never exist at once, in any dtype.

Why inside lm_head's forward: under FSDP2 the root module (the CausalLM) gathers lm_head's weight in its pre-forward
and reshards it after its forward (``parallelize`` asks every module to); the whole weight exists only during the
root's forward. Calling ``model.model(...)`` and then using ``lm_head.weight`` would read a shard, or miss FSDP's
hooks. The head is an ``nn.Linear`` holding lm_head's own Parameter object under the same name ``lm_head.weight``,
so state dicts, checkpoints, the export, tied embeddings (``lm_head.weight is embed_tokens.weight``) and FSDP's
wrapping are unchanged, and outside ``forward_with_loss`` (generation, PEFT's checks) it returns logits as before.
The model hands the loss on where it would hand on logits (``out.logits``): in transformers 5.23 every supported
model's forward returns lm_head's output unchanged, except Granite's, which divides it by ``config.logits_scaling``
(the model table's ``logits_scaling_attr``): Granite keeps the full-logits loss. ``forward_with_loss`` checks that
``out.logits`` is the tensor the head returned, so a model that changes it stops with a message rather than training
on a wrong loss.

Why the gradients are computed in the forward (as Liger-Kernel's fused linear cross-entropy does) rather than the
logits recomputed in the backward: recomputing would add a fourth lm_head-sized GEMM (2 x rows x hidden x vocab
FLOP: about 2.5 TFLOP, some 3.5 ms, per 4096-row micro-batch at Qwen3's shape on an H200), more than the element-wise
work the chunking saves. Computed in the forward, the backward only multiplies them by the incoming gradient (a
scalar) and never needs the weight, so FSDP may have resharded it. Kept from forward to backward: the weight's
gradient (vocab x hidden, in the weight's dtype: the size of the gradient lm_head's backward makes anyway) and the
hidden states' gradient (rows x hidden). Only the gradients autograd asks for are computed (a frozen lm_head under
LoRA gets none); under no_grad (the eval loss) only the loss.

Numerics: each chunk's logits are lm_head's GEMM in the compute dtype (bf16 on GPUs, rounded as lm_head rounds its
output), then fp32 for the log-sum-exp, the target's logit and the softmax; the logits' gradient (softmax minus
one-hot, zero on ignored rows) is rounded to the compute dtype, as the plain backward rounds it before lm_head's
GEMMs (the target's entry twice: the softmax, then minus one). Two more differences from the plain path, both within
bf16's rounding: the incoming gradient (world_size / label tokens) scales the GEMMs' outputs instead of their input,
and the weight's gradient adds up chunk by chunk in the weight's dtype (one rounding per chunk, where one GEMM over all
rows rounds once; ``LOGITS_PER_CHUNK`` says how much that costs). In fp32 (CPU) the loss and both gradients equal the
plain path to ~1e-6 (tests/test_chunked_loss.py). Nothing here reads a tensor on the host: the chunks follow from
shapes alone.
"""

import torch
import torch.nn.functional as F
from torch import nn

from megablocks_utils.data.records import IGNORE_INDEX
from megablocks_utils.moe.fused import fused

# The most logits one chunk may hold. A chunk holds its logits and their gradient in the compute dtype (4 bytes per
# entry in bf16, the element-wise step compiled on GPUs: ``fused``; uncompiled, an fp32 copy and an fp32 temporary
# besides: about 12), where the plain loss holds 12 bytes per entry of every row. Fewer chunks are better for the
# weight's gradient, which adds up in the weight's dtype, one rounding per chunk: in bf16 on CPU, 2, 3, 4 and 8
# chunks of 4096 rows left it 1.2x, 1.4x, 1.6x and 2.1x as far from the fp32 result as one GEMM over all rows.
# At 2**29 a 4096-row micro-batch is 2 chunks of 2048 rows at Qwen3's 151,936-entry vocabulary (1.2 GiB a chunk,
# compiled) and at gpt-oss's 201,088, and one chunk at Mixtral's 32,000; each chunk's GEMMs stay thousands of rows
# deep (full speed).
LOGITS_PER_CHUNK = 2**29


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum (not mean) of next-token cross-entropy over label positions that are not IGNORE_INDEX."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")


def count_label_tokens(labels: torch.Tensor) -> int:
    """How many positions ``causal_lm_loss_sum`` counts."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def loss_chunk_rows(rows: int, vocab: int) -> int:
    """Rows per chunk of the chunked loss over ``rows`` rows and ``vocab`` entries: as few chunks as keep each within
    ``LOGITS_PER_CHUNK`` logits, of equal size (the last one may be shorter)."""
    most = max(1, LOGITS_PER_CHUNK // vocab)
    chunks = -(-rows // most)
    return -(-rows // chunks)


def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """[batch, seq] labels -> the target of each position, flattened: the next position's label, IGNORE_INDEX at the
    end of each row. The shift moves the labels (integers), never the hidden states."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX).reshape(-1)


# ----------------------------------------------------------------------------- one chunk's element-wise step
def _chunk_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's cross-entropy in fp32 (0 where the target is IGNORE_INDEX)."""
    x = logits.float()
    picked = x.gather(1, targets.clamp(min=0).unsqueeze(1)).squeeze(1)
    return torch.where(targets != IGNORE_INDEX, torch.logsumexp(x, dim=1) - picked, 0.0)


def _chunk_loss_and_softmax(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's cross-entropy in fp32, and its softmax in the logits' dtype (zero rows where the target is IGNORE_INDEX).

    The softmax minus the one-hot of the target is the logits' gradient; the one-hot is subtracted by the caller, in
    one entry per row, so this step stays element-wise (compiled: one pass over the logits for the log-sum-exp, one
    reading them again and writing the result; nothing in fp32 is stored).
    """
    x = logits.float()
    valid = targets != IGNORE_INDEX
    lse = torch.logsumexp(x, dim=1, keepdim=True)
    picked = x.gather(1, targets.clamp(min=0).unsqueeze(1))
    loss = torch.where(valid, (lse - picked).squeeze(1), 0.0)
    softmax = (x - lse).exp_().masked_fill_(~valid.unsqueeze(1), 0.0)
    return loss, softmax.to(logits.dtype)


def _step(fn, device: torch.device, fuse: bool):
    return fused(fn) if fuse and device.type == "cuda" else fn


@torch.profiler.record_function("chunked_loss")  # a profile's name for its kernels (bench/profile_steps.py)
def _loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int, fuse: bool) -> torch.Tensor:
    """The loss alone (no autograd): the eval loss's forward."""
    step = _step(_chunk_loss, hidden.device, fuse)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        total = total + step(F.linear(hidden[rows], weight), targets[rows]).sum()
    return total


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows of cross_entropy(hidden @ weight.T, targets), chunk by chunk, its gradients made in the forward."""

    @staticmethod
    @torch.profiler.record_function("chunked_loss")
    def forward(ctx, hidden, weight, targets, chunk_rows: int, fuse: bool):
        want_hidden, want_weight = ctx.needs_input_grad[:2]
        step = _step(_chunk_loss_and_softmax, hidden.device, fuse)
        grad_hidden = hidden.new_empty(hidden.shape) if want_hidden else None  # contiguous: row slices are mm outputs
        grad_weight = None
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            h, t = hidden[rows], targets[rows]
            logits = F.linear(h, weight)  # lm_head's GEMM, in its dtype
            loss, grad = step(logits, t)
            del logits
            total = total + loss.sum()
            # minus the one-hot: one entry per row (a valid row's target; column 0 of an ignored row, which gets 0)
            grad.scatter_add_(1, t.clamp(min=0).unsqueeze(1), -(t != IGNORE_INDEX).unsqueeze(1).to(grad.dtype))
            if want_hidden:
                torch.mm(grad, weight, out=grad_hidden[rows])
            if want_weight:
                grad_weight = grad.t() @ h if grad_weight is None else grad_weight.addmm_(grad.t(), h)
            del grad
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.used = False
        return total

    @staticmethod
    def backward(ctx, grad_total):
        if ctx.used:  # the saved gradients were scaled in place by the first backward
            raise RuntimeError("the chunked loss's backward runs once per forward (no retain_graph); use --chunked_loss false")
        ctx.used = True
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_total)
        if grad_weight is not None:
            grad_weight.mul_(grad_total)
        return grad_hidden, grad_weight, None, None, None


def chunked_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int,
                     fuse: bool = True) -> torch.Tensor:
    """sum of cross_entropy(hidden @ weight.T, targets) over the rows whose target is not IGNORE_INDEX, in chunks of
    ``chunk_rows`` rows; ``hidden`` [rows, hidden], ``weight`` [vocab, hidden], ``targets`` [rows]. ``fuse``: on CUDA,
    each chunk's element-wise step compiled into one kernel each way (``moe/fused.py``)."""
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows, fuse)
    return _loss_sum(hidden, weight, targets, chunk_rows, fuse)


# ----------------------------------------------------------------------------- the loss inside the model's forward
class _LossRequest:
    """What ``forward_with_loss`` asks of a LossHead during one forward: the targets; and the loss the head returned."""

    def __init__(self, targets: torch.Tensor):
        self.targets = targets
        self.loss = None


_request: _LossRequest | None = None  # set only while forward_with_loss runs the model


class LossHead(nn.Linear):
    """lm_head (same weight, same name) that, inside ``forward_with_loss``, returns the summed loss of the request's
    targets instead of the logits (``chunked_loss_sum``); anywhere else it is lm_head."""

    def __init__(self, weight: nn.Parameter, fuse: bool, chunk_rows: int | None = None):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = weight  # the Parameter itself: tied embeddings stay tied, FSDP and checkpoints see one name
        self.fuse = fuse
        self.chunk_rows = chunk_rows  # None: loss_chunk_rows (tests set a few rows)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        request = _request
        if request is None:
            return super().forward(hidden_states)
        if request.loss is not None:
            raise RuntimeError("lm_head ran twice in one forward_with_loss forward; the chunked loss expects one call")
        if hidden_states.shape[:-1].numel() != request.targets.numel():
            raise ValueError(f"lm_head got hidden states {tuple(hidden_states.shape)} for {request.targets.numel()} label "
                             "positions; the chunked loss needs every position (no logits_to_keep)")
        hidden, weight = hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight
        device = hidden.device.type
        if torch.is_autocast_enabled(device):  # Trainer's bf16: lm_head's GEMM would run in autocast's dtype
            dtype = torch.get_autocast_dtype(device)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        chunk_rows = self.chunk_rows or loss_chunk_rows(hidden.shape[0], self.out_features)
        with torch.autocast(device, enabled=False):
            request.loss = chunked_loss_sum(hidden, weight, request.targets, chunk_rows, self.fuse)
        return request.loss


def install_loss_head(model: nn.Module, *, fuse: bool = True) -> str:
    """Make ``model``'s lm_head a ``LossHead`` over the same weight, in place, before FSDP wraps the model.

    Returns "" when done, else why not (for the script to print): the model then keeps its lm_head and
    ``forward_with_loss`` computes the loss from its full logits. ``fuse``: compile the chunks' element-wise step on
    CUDA (the scripts pass ``compile_dense``)."""
    from megablocks_utils.model.architectures import spec_for

    head = model.get_output_embeddings()
    scaling = spec_for(model.config).logits_scaling_attr
    if scaling:  # divided even by 1.0: a new tensor, not the head's
        return (f"loss from full logits: {model.config.model_type} divides lm_head's output by config.{scaling}, so the "
                "loss cannot be computed inside lm_head")
    if type(head) is not nn.Linear or head.bias is not None:
        what = "a Linear with a bias" if type(head) is nn.Linear else type(head).__name__
        return f"loss from full logits: lm_head is {what}, not a plain Linear"
    if head._forward_hooks:
        return "loss from full logits: lm_head has a forward hook (a LoRA adapter on lm_head) that changes its logits"
    model.set_output_embeddings(LossHead(head.weight, fuse))
    return ""


def forward_with_loss(model: nn.Module, model_inputs: dict, labels: torch.Tensor):
    """The model's forward on ``model_inputs`` and the summed next-token loss of ``labels`` (``causal_lm_loss_sum``'s
    value): computed inside the forward by the model's ``LossHead`` where it has one, else from ``out.logits``.
    Returns (loss sum, the model's output); with a LossHead, ``out.logits`` is the loss sum, not logits."""
    global _request
    request, outer = _LossRequest(next_token_targets(labels)), _request
    _request = request
    try:
        out = model(**model_inputs)
    finally:
        _request = outer
    if request.loss is None:  # no LossHead: lm_head gave the logits
        return causal_lm_loss_sum(out.logits, labels), out
    if out.logits is not request.loss:
        raise RuntimeError(f"{type(model).__name__} changed lm_head's output before returning it as logits, so the loss "
                           "computed inside lm_head is not the model's; run with --chunked_loss false")
    return request.loss, out
