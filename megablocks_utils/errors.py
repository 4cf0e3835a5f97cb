"""What can go wrong in a run, as the errors the package raises and the scripts catch: the ground floor.

Every module may import this one, and it imports nothing of the package, so an error never ties two rooms
together. Each message says what was wrong and what to do about it.

Bad input (``InputError`` and its kinds): something the user gave cannot work. The scripts check for it before
anything heavy runs, rank 0 prints the message alone (``config/inputs.fail``) and every rank exits with code 2.
A run that has started stops with ``CheckpointError`` (a checkpoint that cannot be saved or used) or
``NonFiniteStep`` (a loss or gradient norm that is not finite, under ``nonfinite = "stop"``).
A command's own error stays with its command (``tools/plot.py``'s ``PlotError``).
"""


class InputError(ValueError):
    """Something the user gave (a file, a directory, a setting) that cannot work, stated with the fix."""


class SettingsError(InputError):
    """A setting's value that breaks its rule (``config/settings.py``), one line naming the flag."""


class DataError(InputError):
    """A problem with the data file, stated with what to do about it."""


class AttentionChoiceError(InputError):
    """A kernel asked for that cannot run this model on this device."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, with what to do about it."""


class NonFiniteStep(RuntimeError):
    """The run must stop at ``step``; the message says what was not finite."""

    def __init__(self, step: int, message: str):
        super().__init__(message)
        self.step = step
