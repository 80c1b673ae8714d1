"""Constructor argument checks shared by the layers: a ValueError/TypeError naming the argument, what
was expected and what came, when the layer is built rather than at its first forward."""

from __future__ import annotations

import math
import numbers

from ..runtime.backend import BACKENDS

BACKEND_CHOICES = ("auto",) + BACKENDS


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def positive_int(name: str, value, optional: bool = False):
    """``value`` as an int >= 1 (None passes through when ``optional``)."""
    if optional and value is None:
        return None
    if not _is_int(value):
        raise TypeError(f"{name}: expected {'None or ' if optional else ''}an int >= 1, got {value!r} "
                        f"({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return int(value)


def nonnegative_int(name: str, value):
    if not _is_int(value):
        raise TypeError(f"{name}: expected an int >= 0, got {value!r} ({type(value).__name__})")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0, got {value}")
    return int(value)


def real(name: str, value, low=None, high=None, low_open: bool = False, optional: bool = False):
    """``value`` as a finite float in [low, high] (``(low, high]`` with ``low_open``); None passes
    when ``optional``."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected {'None or ' if optional else ''}a float, got {value!r} "
                        f"({type(value).__name__})")
    number = float(value)
    below = low is not None and (number <= low if low_open else number < low)
    above = high is not None and number > high
    if not math.isfinite(number) or below or above:
        lo = "" if low is None else (f" > {low}" if low_open else f" >= {low}")
        hi = "" if high is None else f" <= {high}"
        raise ValueError(f"{name}: expected a finite float{lo}{' and' if lo and hi else ''}{hi}, got {value!r}")
    return number


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {value!r}")
    return value


def choice(name: str, value, options):
    if not isinstance(value, str) or value not in options:
        raise ValueError(f"{name}: expected one of {list(options)}, got {value!r}")
    return value


def backend(value):
    return choice("backend", value, BACKEND_CHOICES)


def checkpoint_level(value, levels):
    if isinstance(value, bool) or value not in levels:
        raise ValueError(f"checkpoint_lvl: expected one of {list(levels)}, got {value!r}")
    return int(value)
