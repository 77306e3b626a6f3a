"""One exception type for mistakes a user can fix, and the one-line checks every layer makes.

Anything raised as ``UserError`` reaches the user as a single line that names the option and the
fix (train.py and the scripts catch it and exit with status 2); everything else is a bug and keeps
its traceback. This is the bottom layer: kernels/, data/, model/ and training/ may all import it,
and it imports nothing of theirs.
"""
import importlib
import math
from typing import Iterable


class UserError(Exception):
    """A wrong option, input or environment, with a message that says what to do."""


def first_line(err: BaseException, width: int = 300) -> str:
    """The first non-blank line of ``err``'s message, cut to ``width`` characters; its type's name when
    the message is empty (``str(err).splitlines()[0]`` fails on an empty message)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0][:width] if lines else type(err).__name__


def check_choice(option: str, value, choices: Iterable[str]) -> None:
    """``option=value`` must be one of ``choices``."""
    choices = tuple(choices)
    if value not in choices:
        raise UserError(f"{option}={value!r} is not one of {', '.join(choices)}")


def check_finite(option: str, value) -> None:
    """A float ``option=value`` must be a number: NaN and infinity are refused (``value < 0`` is false for NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{option}={value} is not a finite number; give a value such as 0.1")


def check_positive(option: str, value, allow_zero: bool = False, kind: str = "number") -> None:
    """``option=value`` must be finite and > 0 (or >= 0 with ``allow_zero``); ``kind`` names it in the message."""
    check_finite(option, value)
    if value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{option}={value} must be {'>= 0' if allow_zero else f'a positive {kind}'}")


def import_optional(module: str, needed_for: str, pip: str):
    """``module`` imported, or UserError: ``needed_for`` needs it, and the ``pip`` command that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise UserError(f"{needed_for} needs the {module.split('.')[0]} package: `{pip}`") from err
