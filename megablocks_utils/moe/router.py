"""``TopKRouter``: the model's routing rule, from hidden states to each token's top-k experts and weights."""

import torch
import torch.nn.functional as F
from torch import nn


class TopKRouter(nn.Module):
    """Router logits -> (scores for the load-balancing loss, top-k weights, top-k experts).

    ``mode`` is the model table's ``router``: "softmax_topk" (Mixtral, Qwen, OLMoE; renormalised if
    asked), "topk_softmax" (Granite, gpt-oss: softmax over the k largest logits), "sigmoid_group_topk"
    (DeepSeek-V3, GLM-4.5) or "softmax_group_topk" (DeepSeek-V2): see ``MoESpec.router``. The first
    value is the fp32 softmax over all experts, or for sigmoid routing the sigmoid scores normalised to
    sum to 1 (DeepSeek-V3's sequence-wise balance loss uses these, should a load-balancing loss be asked for).

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
