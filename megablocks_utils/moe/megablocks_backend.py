"""moe_backend="megablocks": megablocks' dropless MoE moves the tokens, grouped_gemm multiplies them.

The MoE block is ``ExpertParallelMoE`` with either backend. What stays the same: the model's router
(``TopKRouter``: the model's own rule, softmax in fp32, as transformers computes it), the
load-balancing loss over the global token set (``aux_loss.py``), and the expert weights, the DTensors
``gate_up_proj`` [E/ep, 2I, H] and ``down_proj`` [E/ep, H, I] (Replicate on "dp", Shard(0) on "ep")
that ``shard_moe`` loads. So FSDP leaves them alone, and checkpoints, export, ``sync_expert_grads`` and
``clip_grad_norm_`` do not know which backend ran. What megablocks does (``MegablocksExperts.forward``):

  its ``ParallelDroplessMLP``, the expert half of its ``dMoE``: sort the token copies by expert (its
  CUDA radix sort and histogram), gather them (Triton); with ep > 1 exchange counts and rows with the
  other ranks of our ep process group (``moe_expert_model_parallelism=True``,
  ``expert_parallel_group=mesh.ep_group``), regroup by local expert; run the local experts; send
  back, weight by the router's top-k weights and sum the k copies of each token (Triton).

The local experts. megablocks' GLU (``mlp_type="glu"``) computes ``(act(x w1[e]^T) * (x v1[e]^T)) w2[e]``
with w1, v1, w2 of [E/ep * I, H]: in our layout ``w1[e] = gate_up_proj[e, :I]``,
``v1[e] = gate_up_proj[e, I:]`` and ``w2[e] = down_proj[e]^T``. We run that product on our fused
layout with the grouped GEMM megablocks' ``GroupedGLU`` calls (``grouped_gemm.ops.gmm``):
``h = gmm(x, gate_up_proj, trans_b=True)``, then ``gmm(act(h[:, :I]) * h[:, I:], down_proj, trans_b=True)``:
two GEMMs instead of three, and no copy or transpose of the weights. grouped_gemm is bf16-only; in
fp32 the local experts run as the per-expert loop (``LocalExperts.loop``) and the rest is megablocks'.

Not used from megablocks, and why: its ``LearnedRouter`` (softmax in the activations' dtype, one
routing rule; the model's router is the one that matches transformers); its load-balancing loss
(``moe_loss_weight=0``; it would also keep every layer's scores in a module-global list until cleared);
its own expert weights (a second copy in another layout, and its ``scale_grad`` divides expert
gradients by ep, which ``sync_expert_grads`` already accounts for); its "sparse" MLP (stk's Triton
block-sparse kernels, which megablocks 0.10 refuses on triton >= 3.2).
"""

import importlib.util

import torch
from torch import nn

from megablocks_utils.moe.layer import ExpertParallelExperts

INSTALL_HINT = (
    "it builds only from source, on CUDA: `pip install --no-build-isolation --no-deps -r requirements-megablocks.txt` "
    "with a torch CUDA build and its CUDA toolkit (docs/megablocks.md says which versions build and how "
    "on CUDA 13); or use moe_backend='native'"
)


def check_megablocks(device_type: str | None = None) -> None:
    """Raise a clear error unless megablocks, its CUDA extension and grouped_gemm can run here."""
    if device_type is not None and device_type != "cuda":
        raise ValueError(
            f"moe_backend='megablocks' runs only on CUDA GPUs (its kernels are CUDA and Triton), but this run is on "
            f"{device_type}; use moe_backend='native'"
        )
    if importlib.util.find_spec("megablocks") is None:
        raise ImportError(f"moe_backend='megablocks' needs the megablocks package, which is not installed; {INSTALL_HINT}")
    if importlib.util.find_spec("megablocks_ops") is None:
        raise ImportError(
            "moe_backend='megablocks' needs megablocks' CUDA extension (megablocks_ops), which is missing: megablocks was "
            f"installed without building it (no CUDA torch or no CUDA_HOME at install time); {INSTALL_HINT}"
        )
    if importlib.util.find_spec("grouped_gemm") is None:
        raise ImportError(
            "moe_backend='megablocks' needs the grouped_gemm package (megablocks' grouped MLP; its sparse MLP is refused "
            f"on triton >= 3.2), which is not installed; {INSTALL_HINT}"
        )


def _dropless_mlp(num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, mesh, act_fn) -> nn.Module:
    """megablocks' ``ParallelDroplessMLP`` for one layer, without its own expert weights."""
    if intermediate_size * num_experts < 128:
        # ParallelDroplessMLP sizes a sort from log2(I * E / 128) even when it never uses it.
        raise ValueError(
            f"moe_backend='megablocks' needs intermediate_size * num_experts >= 128 (megablocks' block size), got "
            f"{intermediate_size} * {num_experts}; use moe_backend='native' for so small a model"
        )
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import ParallelDroplessMLP

    expert_parallel = mesh.ep_size > 1
    args = Arguments(
        hidden_size=hidden_size,
        ffn_hidden_size=intermediate_size,
        bias=False,  # the MoE output has no bias in any supported model
        activation_fn=act_fn,
        moe_num_experts=num_experts,
        moe_top_k=top_k,
        moe_loss_weight=0.0,  # our aux loss (aux_loss.py) is the one used
        moe_expert_model_parallelism=expert_parallel,
        expert_parallel_group=mesh.ep_group if expert_parallel else None,
        mlp_type="glu",
        mlp_impl="grouped",
        fp16=False,
        bf16=False,
        device="meta",  # its placeholder weights, dropped below, take no memory
    )
    # With ep dividing E, megablocks gives ep-group rank r the experts [r E/ep, (r+1) E/ep), whole
    # (hidden sharding degree 1): the same experts shard_moe loaded on ep rank r.
    mlp = ParallelDroplessMLP(args)
    del mlp.mlp  # megablocks' GroupedGLU with its own (meta) w1, v1, w2; MegablocksExperts computes instead
    return mlp


class MegablocksExperts(ExpertParallelExperts):
    """This rank's experts of one layer, with megablocks' dropless MoE doing the token movement.

    Same weights, names and contract as ``ExpertParallelExperts`` (``forward(x, top_i, top_w)``):
    only the forward differs (module docstring). ``force_loop`` runs the local experts as the
    per-expert loop instead of grouped_gemm, as in the native layer; ``compile_elementwise`` compiles the
    weights' cast backward on CUDA, as there (the rest of the forward is megablocks').
    """

    def __init__(
        self,
        num_experts: int,
        mesh,
        act_fn: str,
        *,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        force_loop: bool = False,
        compile_elementwise: bool = True,
    ):
        super().__init__(num_experts, mesh, act_fn, force_loop=force_loop, compile_elementwise=compile_elementwise)
        self.dropless = _dropless_mlp(num_experts, top_k, hidden_size, intermediate_size, mesh, self.local.act_fn)
        # ParallelDroplessMLP calls ``self.mlp(rows grouped by local expert, rows per local expert)``;
        # a plain attribute (not a submodule), so the weights stay ours alone.
        self.dropless.mlp = self._local_experts

    def _local_experts(self, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # In expert-parallel mode megablocks hands over counts already on the host; otherwise this
        # is the layer's one host sync, as in the native layer.
        counts_host = tokens_per_expert.tolist()
        return self.compute(x, tokens_per_expert, counts_host)

    def compute(self, x: torch.Tensor, counts: torch.Tensor, counts_host: list[int]) -> torch.Tensor:
        w_gate_up, w_down = self._local_weights(x.dtype)
        if self.local.force_loop or not (x.is_cuda and x.dtype == torch.bfloat16):
            return self.local.loop(x, counts_host, (w_gate_up, w_down))
        from grouped_gemm.ops import gmm

        batch_sizes = torch.tensor(counts_host, dtype=torch.int64)  # grouped_gemm wants them on the host
        gate, up = gmm(x, w_gate_up, batch_sizes, trans_b=True).chunk(2, dim=-1)
        return gmm(self.local.act_fn(gate) * up, w_down, batch_sizes, trans_b=True)

    def route_and_compute(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [T, H], top_i/top_w [T, k] -> [T, H]: megablocks' dropless forward with our routing (the base class's
        ``forward`` calls it, under checkpoint with ``recompute``)."""
        # scores (for megablocks' own load-balancing loss) are not needed: moe_loss_weight=0.
        return self.dropless(x, None, top_w, top_i)

