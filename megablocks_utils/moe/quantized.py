"""Frozen base weights held quantized (LoRA's ``quantize_base``), and the GEMMs that read them.

Two formats, each stored as [..., out, in] (rows are outputs, scales run along the inputs) whatever layout the model
keeps its bf16 weights in:
- "fp8": float8 e4m3 with one fp32 scale per 128 x 128 block (``weight_scale_inv``: value = fp8 x scale), the layout
  Qwen3's and GLM-4.5's FP8 checkpoints are released in; a bf16 checkpoint is quantized to it at load.
- "mxfp4": gpt-oss's experts as released: two e2m1 values a byte (low nibble first), one power-of-two scale (a biased
  exponent byte) per 32 inputs (``*_blocks`` [..., out, in / 32, 16] and ``*_scales`` [..., out, in / 32]).

A GEMM dequantizes the weight to the compute dtype just before it runs (one element-wise pass, compiled on CUDA) and
its backward dequantizes it again for the input's gradient: autograd keeps the quantized bytes, never a bf16 copy, so a
layer's bf16 weights live only while its GEMM runs. The base is frozen: no weight gradient. On a GPU the FP8 experts'
grouped GEMMs take one of two ways (``QuantizedWeight.gemm``, ``EXPERT_GEMMS``, both in ``fp8_gemm_kernel.py``):
- "kernel": each weight tile scaled to bf16 in registers inside our Triton GEMM, no bf16 copy written;
- "dequantize": one pass writes the layer's bf16 weight, then torch's bf16 grouped GEMM (the copy lives while it runs);
- "auto" (what the scripts run): "dequantize" where the experts have ``DEQUANTIZE_FIRST_ROWS`` rows each on average,
  "kernel" below. The pass costs the weight's bytes once per GEMM, whatever the rows; the kernel costs about 0.6x a bf16
  GEMM's time more, per row. The fit check counts the copy where "auto" makes it (``memory_counts.frozen_bytes``).
"""

import torch
import torch.nn.functional as F
from torch import nn

from megablocks_utils.moe.fused import fused
from megablocks_utils.moe.weight_grad import grouped_mm

FORMATS = ("fp8", "mxfp4")
EXPERT_GEMMS = ("auto", "kernel", "dequantize")
# Between the two widths measured (one H200, bench/fp8_gemm_bench.py, forward and input gradient of both GEMMs, routing
# even): Qwen3-30B-A3B's 256 rows per expert 1.64 ms in the kernel against 2.06 dequantized first; Mixtral-8x7B's 1,024
# rows 13.6 against 9.8 (bench/reports/fp8_expert_kernel_orientation_h200_2026-12-02.md).
DEQUANTIZE_FIRST_ROWS = 512
FP8_BLOCK = 128  # the released checkpoints' weight_block_size, both ways
FP8_MAX = 448.0  # float8 e4m3's largest value
MXFP4_GROUP = 32  # inputs sharing one scale
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # e2m1 by code


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def quantize_fp8(w: torch.Tensor, chunk: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., out, in] -> (float8 e4m3 [..., out, in], fp32 scales [..., ceil(out / 128), ceil(in / 128)]): each
    128 x 128 block scaled so its largest magnitude is 448. ``chunk`` leading slices at a time (an fp32 copy of those
    only)."""
    *lead, n, k = w.shape
    flat = w.reshape(-1, n, k)
    nb, kb = _blocks(n, FP8_BLOCK), _blocks(k, FP8_BLOCK)
    data = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=w.device)
    scale = torch.empty(flat.shape[0], nb, kb, dtype=torch.float32, device=w.device)
    for i in range(0, flat.shape[0], chunk):
        part = F.pad(flat[i:i + chunk].float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
        part = part.view(-1, nb, FP8_BLOCK, kb, FP8_BLOCK)
        s = part.abs().amax(dim=(2, 4)) / FP8_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block: any scale
        q = (part / s[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        data[i:i + chunk] = q.view(-1, nb * FP8_BLOCK, kb * FP8_BLOCK)[:, :n, :k]
        scale[i:i + chunk] = s
    return data.view(*lead, n, k), scale.view(*lead, nb, kb)


def _dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    *lead, n, k = data.shape
    if n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0:  # a view per block: one fused pass on CUDA
        blocks = data.view(*lead, n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK).float()
        return (blocks * scale[..., :, None, :, None]).to(dtype).view(*lead, n, k)
    full = scale.repeat_interleave(FP8_BLOCK, dim=-2)[..., :n, :].repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]
    return (data.float() * full).to(dtype)


def _dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    *lead, n, g, b = blocks.shape
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).int()  # [..., n, g, 16, 2]: the low nibble first
    values = lut[codes].view(*lead, n, g, 2 * b)
    values = torch.ldexp(values, scales.int().sub(127)[..., None].float())
    return values.to(dtype).view(*lead, n, g * 2 * b)


def dequantize(fmt: str, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight [..., out, in] in ``dtype`` (on CUDA one compiled kernel: ``fused``)."""
    fn = _dequantize_fp8 if fmt == "fp8" else _dequantize_mxfp4
    return (fused(fn) if data.is_cuda else fn)(data, scale, dtype)


def _product(x: torch.Tensor, w_t: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """x @ w_t: grouped over the row groups ending at ``offs`` (w_t [E, in, out]), or one matrix (w_t [in, out])."""
    return grouped_mm(x, w_t, offs) if offs is not None else x @ w_t


def _in_kernel(x: torch.Tensor, fmt: str, offs: torch.Tensor | None) -> bool:
    """Whether the grouped GEMM dequantizes inside our Triton kernel (``fp8_gemm_kernel.py``): FP8 experts on a GPU in
    bf16. Elsewhere (CPU, one expert's or a linear layer's matrix, MXFP4) the weight is dequantized first."""
    return x.is_cuda and offs is not None and fmt == "fp8" and x.dtype == torch.bfloat16


def dequantizes_first(gemm: str, rows: float, experts: float) -> bool:
    """Whether FP8 experts' grouped GEMM over ``rows`` rows (all ``experts``) writes the bf16 weight first (``gemm``: one
    of ``EXPERT_GEMMS``)."""
    if gemm not in EXPERT_GEMMS:
        raise ValueError(f"expert gemm {gemm!r}: choose one of {EXPERT_GEMMS}")
    return gemm == "dequantize" or (gemm == "auto" and rows >= DEQUANTIZE_FIRST_ROWS * experts)


def _frozen_product(x: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor | None,
                    transpose: bool, gemm: str = "auto") -> torch.Tensor:
    """x @ W^T (``transpose``) or x @ W, for W [.., out, in] held quantized."""
    if _in_kernel(x, fmt, offs):  # Triton: imported where a GPU runs it
        from megablocks_utils.moe.fp8_gemm_kernel import dequantize_fp8_blocks, fp8_grouped_mm

        if dequantizes_first(gemm, x.shape[0], data.shape[0]):
            w = dequantize_fp8_blocks(data, scale, x.dtype)
            return grouped_mm(x, w.transpose(-2, -1) if transpose else w, offs)
        return fp8_grouped_mm(x, data, scale, offs, transpose)
    w = dequantize(fmt, data, scale, x.dtype)
    return _product(x, w.transpose(-2, -1) if transpose else w, offs)


class _FrozenMatmul(torch.autograd.Function):
    """x @ W^T with W [.., out, in] dequantized from (``data``, ``scale``) here and again in the backward: the saved
    tensors are the quantized ones. Only the input's gradient (the weight is frozen)."""

    @staticmethod
    def forward(ctx, x, data, scale, offs, fmt, gemm):
        ctx.fmt, ctx.gemm = fmt, gemm
        ctx.save_for_backward(data, scale, offs)
        return _frozen_product(x, fmt, data, scale, offs, transpose=True, gemm=gemm)

    @staticmethod
    def backward(ctx, grad):
        data, scale, offs = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 6
        return _frozen_product(grad.contiguous(), ctx.fmt, data, scale, offs, transpose=False, gemm=ctx.gemm), *(None,) * 5


def frozen_matmul(x: torch.Tensor, fmt: str, data: torch.Tensor, scale: torch.Tensor, offs: torch.Tensor | None = None,
                  gemm: str = "auto") -> torch.Tensor:
    """x [rows, in] @ W^T for a quantized W [out, in], or grouped (``offs``: the row groups' ends) over W [E, out, in];
    ``gemm``: how FP8 experts' grouped GEMMs run on a GPU (``EXPERT_GEMMS``)."""
    return _FrozenMatmul.apply(x, data, scale, offs, fmt, gemm)


class QuantizedWeight(nn.Module):
    """One frozen weight held quantized: ``data`` and ``scale`` buffers in ``fmt`` (out of every state dict: a LoRA
    checkpoint holds what trains, the base comes from the model directory again). ``transposed``: the model keeps
    this weight as [..., in, out] (``shape`` and ``dequantized`` answer in the model's layout; the GEMMs read
    [..., out, in])."""

    def __init__(self, fmt: str, data: torch.Tensor, scale: torch.Tensor, transposed: bool = False):
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"quantized format {fmt!r}: choose one of {FORMATS}")
        self.fmt = fmt
        self.transposed = transposed
        self.gemm = "auto"  # how the grouped GEMMs run on a GPU: EXPERT_GEMMS
        self.register_buffer("data", data, persistent=False)
        self.register_buffer("scale", scale, persistent=False)

    @property
    def out_in(self) -> tuple[int, int]:
        """(out, in) of one matrix."""
        n = self.data.shape[-3] if self.fmt == "mxfp4" else self.data.shape[-2]
        k = self.data.shape[-2] * self.data.shape[-1] * 2 if self.fmt == "mxfp4" else self.data.shape[-1]
        return n, k

    @property
    def shape(self) -> torch.Size:
        lead = self.data.shape[:-3] if self.fmt == "mxfp4" else self.data.shape[:-2]
        n, k = self.out_in
        return torch.Size((*lead, k, n) if self.transposed else (*lead, n, k))

    @property
    def device(self) -> torch.device:
        return self.data.device

    requires_grad = False  # frozen: the experts' and linears' gradient paths read this

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def matmul(self, x: torch.Tensor, offs: torch.Tensor | None = None, expert: int | None = None) -> torch.Tensor:
        """x @ W^T: grouped over experts by ``offs``, one expert's matrix (``expert``), or the one matrix."""
        if expert is not None:
            return frozen_matmul(x, self.fmt, self.data[expert], self.scale[expert])
        return frozen_matmul(x, self.fmt, self.data, self.scale, offs, self.gemm)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` and the model's layout."""
        w = dequantize(self.fmt, self.data, self.scale, dtype)
        return w.transpose(-2, -1).contiguous() if self.transposed else w

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={tuple(self.shape)}"


def quantize_weight(w: torch.Tensor, transposed: bool = False) -> QuantizedWeight:
    """A bf16 (or fp32) weight in the model's layout -> its FP8 ``QuantizedWeight``."""
    out_in = w.transpose(-2, -1) if transposed else w
    return QuantizedWeight("fp8", *quantize_fp8(out_in), transposed=transposed)


class QuantizedLinear(nn.Module):
    """A frozen ``nn.Linear`` whose weight is held quantized (``weight``: a ``QuantizedWeight``); the bias, if any, stays
    as it was. LoRA adapts it as it adapts a Linear (``model/lora.py``: the hook adds the adapter to its output)."""

    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.out_in
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.weight.matmul(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "QuantizedLinear":
        bias = nn.Parameter(linear.bias.detach(), requires_grad=False) if linear.bias is not None else None
        return cls(quantize_weight(linear.weight.detach()), bias)

    def to_linear(self, dtype: torch.dtype) -> nn.Linear:
        """The plain ``nn.Linear`` in ``dtype`` (for the merged export)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(self.weight.dequantized(dtype), requires_grad=False)
        if self.bias is not None:
            linear.bias = self.bias
        return linear
