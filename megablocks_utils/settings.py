"""Command-line overrides for the settings block at the top of a training script (nanoGPT style)."""

import sys


class SettingsError(ValueError):
    pass


def _parse(name: str, text: str, default):
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"--{name} expects true or false, got {text!r}")
    if default is None or isinstance(default, str):
        return None if text.lower() == "none" and default is None else text
    try:
        return type(default)(text)
    except ValueError:
        raise SettingsError(f"--{name} expects a {type(default).__name__}, got {text!r}") from None


def apply_overrides(settings: dict, argv: list[str] | None = None, known_extra: set[str] = frozenset()) -> list[str]:
    """Override ``settings`` in place from ``--name value`` / ``--name=value`` arguments.

    Returns the arguments whose names are in ``known_extra`` (left for another parser); any other
    unknown name is an error that lists the valid ones.
    """
    argv = sys.argv[1:] if argv is None else argv
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SettingsError(f"unexpected argument {arg!r}; settings are given as --name value")
        name, _, value = arg[2:].partition("=")
        takes_value = not _
        if name in known_extra:
            rest.append(arg)
            if takes_value and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                rest.append(argv[i + 1])
                i += 1
            i += 1
            continue
        if name not in settings:
            raise SettingsError(f"unknown setting --{name}; valid settings: {', '.join(sorted(settings))}")
        if takes_value:
            if i + 1 >= len(argv):
                raise SettingsError(f"--{name} needs a value")
            value = argv[i + 1]
            i += 1
        settings[name] = _parse(name, value, settings[name])
        i += 1
    return rest
