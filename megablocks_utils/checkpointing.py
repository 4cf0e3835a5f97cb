"""Activation checkpointing per decoder layer (placeholder until selective lands)."""

from torch import nn

ACTIVATION_CHECKPOINTING = ("none", "full")


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation_checkpointing={mode!r} is unknown; choose one of {ACTIVATION_CHECKPOINTING}")
    if mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
