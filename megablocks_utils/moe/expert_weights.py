"""This rank's expert weights of one MoE layer, and how the forward reads them: ``ExpertWeights``.

The weights are stored as transformers 5 stores its fused experts, sharded over ep. The forward reads their local
blocks in the compute dtype, the gradients divided on the way back (``cast.py``); or, where the layer adds gate_up's
and down's gradients into ``.grad`` itself, the blocks without an autograd edge and where each gradient goes
(``weight_grad.py``). ``layer.ExpertParallelExperts`` is these weights with the forward that routes tokens through them.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from megablocks_utils.moe.cast import cast_weights, divide_fuses
from megablocks_utils.moe.quantized import QuantizedWeight
from megablocks_utils.moe.weight_grad import WeightGradInto


class ExpertWeights(nn.Module):
    """This rank's experts' weights of one layer, stored fused like transformers 5 does.

    ``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] are DTensors sharded on dim 0 over "ep";
    the names match transformers' fused layout so state dicts line up with ``MixtralExperts``,
    ``Qwen2MoeExperts`` and the other fused expert modules of transformers 5. A model table row may
    ask for transformers' other layouts (``architectures.MoESpec``): ``transposed`` weights ([E, H, 2I] and
    [E, I, H]), gate and up in alternating columns (``interleaved``), and per-expert biases
    ``gate_up_proj_bias`` [E, 2I] and ``down_proj_bias`` [E, H], sharded like the weights (gpt-oss).

    ``grad_divisor``: what the cast's backward divides the gradients by (experts FSDP leaves out). ``lora``: the
    experts' adapters, read like the weights. ``compile_elementwise``: on CUDA, the cast's gradient division compiled
    (``fused.py``). ``weight_grads_in_gemm`` (on by default): where the layer owns its weights' gradients
    (``ExpertParallelExperts.owns_weight_grads``: grouped GEMMs, no FSDP on the experts) the GEMMs' backward adds
    gate_up's and down's gradients into ``.grad`` itself (``weight_grad.py``) instead of autograd's fresh gradient
    and ``add_`` at every micro-step.
    """

    def __init__(self, *, bias: bool = False, compile_elementwise: bool = True):
        super().__init__()
        self.has_bias = bias
        self.compile_elementwise = compile_elementwise
        # Experts FSDP leaves out (parallelize: dp = 1): their gradients divided by world size in the cast's backward.
        self.grad_divisor = 1
        self.lora = None  # finetuning="lora": the experts' adapters (moe/lora.py ExpertLoRA), added by model/lora.py
        # The grouped GEMMs' backward adds the weights' gradients into .grad itself (owns_weight_grads); off: autograd's.
        self.weight_grads_in_gemm = True

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

    def set_quantized_weights(self, gate_up_proj: QuantizedWeight, down_proj: QuantizedWeight) -> None:
        """Hold gate_up and down frozen and quantized (LoRA's ``quantize_base``: ``moe/quantized.py``), this rank's
        experts only; the biases, where the model has them, stay as ``set_weights`` gave them."""
        for name, weight in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
            if name in self._parameters:
                del self._parameters[name]
            setattr(self, name, weight)

    @property
    def quantized(self) -> bool:
        """Whether gate_up and down are held quantized (``set_quantized_weights``)."""
        return isinstance(self._modules.get("gate_up_proj"), QuantizedWeight)

    def dequantize_weights(self, dtype: torch.dtype) -> None:
        """Quantized gate_up and down back to frozen parameters in ``dtype`` (DTensors over ep, as ``set_weights``
        makes them): for the merged export."""
        if not self.quantized:
            return
        mesh = self.mesh.ep
        for name in ("gate_up_proj", "down_proj"):
            local = self._modules.pop(name).dequantized(dtype)
            setattr(self, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False), requires_grad=False))

    def expert_tensors(self) -> tuple[torch.Tensor, ...]:
        """(gate_up_proj, down_proj), then the biases where there are any."""
        if self.has_bias:
            return self.gate_up_proj, self.down_proj, self.gate_up_proj_bias, self.down_proj_bias
        return self.gate_up_proj, self.down_proj

    @torch.compiler.disable  # DTensor.to_local under torch 2.11's dynamo reads DeviceMesh internals it lacks
    def _local_weights(self, dtype: torch.dtype, tensors=None) -> tuple[torch.Tensor, ...]:
        """``expert_tensors()``' (or ``tensors``') local blocks in ``dtype``, their gradients divided by
        ``grad_divisor`` on the way back."""
        tensors = self.expert_tensors() if tensors is None else tensors
        if isinstance(tensors[0], QuantizedWeight):  # frozen, read as they are by the GEMMs (moe/quantized.py)
            return tuple(tensors[:2]) + (self._local_weights(dtype, tensors[2:]) if len(tensors) > 2 else ())
        local = [w.to_local() if isinstance(w, DTensor) else w for w in tensors]
        return cast_weights(local, dtype, self.grad_divisor, self.compile_elementwise)

    def _weights_grads_into(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[WeightGradInto, ...]]:
        """The weights for ``owns_weight_grads``: gate_up's and down's local blocks in ``x``'s dtype without autograd
        edge, the biases as ``_local_weights`` gives them, and where gate_up's and down's gradients go."""
        projections = (self.gate_up_proj, self.down_proj)
        with torch.no_grad():
            weights = self._local_weights(x.dtype, projections)
        if self.has_bias:
            weights += self._local_weights(x.dtype, self.expert_tensors()[2:])
        fuse = divide_fuses(self.grad_divisor, self.compile_elementwise, x.is_cuda)
        return weights, tuple(WeightGradInto(w, self.grad_divisor, fuse) for w in projections)
