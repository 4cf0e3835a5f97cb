"""megablocks_utils.quiet: the two known start-up messages are dropped, everything else those loggers say passes."""

import logging

import megablocks_utils  # noqa: F401  (installs the filters)


class ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_known_startup_noise_is_dropped_and_nothing_else():
    """(A handler on each logger itself: torch's loggers do not propagate to the root, so caplog would not see them.)"""
    loggers = [logging.getLogger(n) for n in ("torchao", "torch.utils._pytree")]
    handler = ListHandler()
    for logger in loggers:
        logger.addHandler(handler)
    try:
        torchao, pytree = loggers
        child = logging.getLogger("torchao.quantization")  # propagates to torchao's handler, past its filter
        torchao.warning("Failed to load %s: %s", "/x/torchao/_C_mxfp8.so", "Could not load this library")
        pytree.warning("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "<enum 'E'>")
        torchao.warning("Skipping import of cpp extensions")
        pytree.warning("a different warning")
        child.warning("Failed to load from a child logger")
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert handler.messages == ["Skipping import of cpp extensions", "a different warning", "Failed to load from a child logger"], handler.messages


def test_the_main_command_starts_without_them():
    """What a CPU run printed before on every rank, gone from a fresh interpreter that imports torchao the way
    transformers does."""
    import subprocess
    import sys

    code = "import megablocks_utils, torchao, transformers.quantizers.auto"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Failed to load" not in result.stderr and "is an Enum subclass" not in result.stderr, result.stderr[-2000:]
