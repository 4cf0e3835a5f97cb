"""Drop two known start-up messages of our dependencies, which torchrun would print once per rank.

- torchao, which transformers imports on every ``from_pretrained`` (its quantizer registry), warns
  "Failed to load .../torchao/_C_*.so" when its prebuilt fp8/mxfp8 kernels do not match the machine
  (always on a CPU). None of our code calls those kernels.
- torch warns, for two of torchao's Enums, that registering an Enum as a pytree constant is deprecated:
  a note to torchao's authors.

Only those messages are dropped, by filters on the two loggers (public ``logging`` API; nothing is
patched); everything else they log passes.
"""

import logging

_DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile",),
}


class _DropMessages(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def drop_known_startup_noise() -> None:
    """Install the filters (once; idempotent)."""
    for name, fragments in _DROPPED.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessages) for f in logger.filters):
            logger.addFilter(_DropMessages(fragments))
