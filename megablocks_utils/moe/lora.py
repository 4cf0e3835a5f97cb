"""LoRA on every expert: per-expert A and B stacked like the expert weights, run on the same permuted rows.

For one projection of expert e (``gate_up_proj`` or ``down_proj``, input width ``in``, output width ``out``) the
adapter holds

    A [E, r, in]    B [E, out, r]    (DTensors Shard(0) over ep, like the expert weights)

and the projection of expert e's rows x becomes  x W_e + s * (dropout(x) A_e^T) B_e^T,  s = alpha / r. That is the
function PEFT's ``ParamWrapper`` (``LoraConfig(target_parameters=...)``) computes by adding s * B_e A_e to W_e;
``model/lora.py`` maps the tensors to its keys. Here the rows are the ones the base weights' grouped GEMM already
sees (sorted by local expert after the all-to-all), so an adapter is two more grouped GEMMs, [rows, in] x [El, in, r]
and [rows, r] x [El, r, out]: no per-expert loop on the GPU and no [E, out, in] delta. Each ep rank holds only its
local experts' A and B; FSDP shards them over dp with the weights, and where FSDP leaves the experts out (dp = 1)
the layer's cast divides their gradients as it does the weights' (``ExpertParallelExperts._local_weights``).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

PROJECTIONS = ("gate_up_proj", "down_proj")  # the order transformers registers them in (PEFT nests its wrappers by it)
GROUPED_MM_ALIGN = 8  # grouped GEMM strides must be multiples of 16 bytes: r a multiple of 8 in bf16


class StackedAdapter(nn.Module):
    """One projection's adapters for this rank's experts: ``lora_A`` [E, r, in] and ``lora_B`` [E, out, r]."""

    def __init__(self, lora_A: torch.Tensor, lora_B: torch.Tensor):
        super().__init__()
        self.lora_A = nn.Parameter(lora_A)
        self.lora_B = nn.Parameter(lora_B)


class ExpertLoRA(nn.Module):
    """The adapters of one MoE layer's experts, a child of ``ExpertParallelExperts`` (``experts.lora``), so that they
    live where the experts live: in the experts' optimizer group, under the experts' FSDP, on the ep mesh."""

    def __init__(self, adapters: dict[str, StackedAdapter], r: int, alpha: float, dropout: float):
        super().__init__()
        self.names = [name for name in PROJECTIONS if name in adapters]
        for name in self.names:
            setattr(self, name, adapters[name])
        self.r = r
        self.scaling = alpha / r
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def tensors(self) -> list[torch.Tensor]:
        """A and B of each adapted projection, in ``PROJECTIONS`` order (the layer casts them with its weights)."""
        return [t for name in self.names for t in (getattr(self, name).lora_A, getattr(self, name).lora_B)]

    def add(self, name: str, out: torch.Tensor, x: torch.Tensor, local: tuple[torch.Tensor, ...], gemm) -> torch.Tensor:
        """``out`` (projection ``name`` of rows ``x``) plus the adapter's s * (dropout(x) A^T) B^T.

        ``local``: ``tensors()`` as local blocks in the compute dtype; ``gemm(a, w)``: the layer's product of rows
        with per-expert weights [El, k, n] (grouped over the local experts, or one expert's in the loop)."""
        if name not in self.names:
            return out
        i = 2 * self.names.index(name)
        a, b = local[i].transpose(-2, -1), local[i + 1].transpose(-2, -1)  # [El, in, r], [El, r, out]
        pad = -self.r % GROUPED_MM_ALIGN
        if pad and x.is_cuda:  # zero ranks change nothing and keep grouped_mm's strides aligned
            a, b = F.pad(a, (0, pad)), F.pad(b, (0, 0, 0, pad))
        return out + gemm(gemm(self.dropout(x), a) * self.scaling, b)


def stacked_adapter(full_A: torch.Tensor, full_B: torch.Tensor, mesh, device, dtype) -> StackedAdapter:
    """This ep rank's experts' slice of all experts' A [E, r, in] and B [E, out, r], as DTensors Shard(0) over ep.

    Slicing the same full tensors on every rank gives every (dp, ep) layout the same adapters."""
    local = full_A.shape[0] // mesh.ep_size
    rows = slice(mesh.ep_rank * local, (mesh.ep_rank + 1) * local)

    def shard(t: torch.Tensor) -> DTensor:
        return DTensor.from_local(t[rows].to(device, dtype).contiguous(), mesh.ep, [Shard(0)], run_check=False)

    return StackedAdapter(shard(full_A), shard(full_B))
