"""The Paddle and Triton versions this package supports: the one place they are declared.

``check_versions()`` runs at ``import paddlenlp_fused``. It reads the installed distributions'
metadata (no import of Paddle or Triton, so the package import stays cheap) and raises
``ImportError`` for a Paddle older than the supported range; a newer, untested Paddle only warns.
A Triton outside its range leaves the package importable: the Triton backend then reports itself
unavailable with the reason (``triton_status``), and ``auto`` takes another backend.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings
from typing import Optional, Tuple

# [min, max). Paddle 3.0 and 3.1 lack paddle.empty/zeros(device=...), which the ops use; 3.2 and
# 3.3 pass tests/test_paddle_api.py (CI runs it on PADDLE_OLDEST in a second environment).
PADDLE_SUPPORTED = ((3, 2), (3, 4))
PADDLE_OLDEST = "3.2.0"  # the wheel CI installs to check the low end
# [min, max): the Triton the kernels are compiled and tested with
TRITON_SUPPORTED = ((3, 6), (3, 7))
PADDLE_DISTRIBUTIONS = ("paddlepaddle", "paddlepaddle-gpu")


def _spec(bounds) -> str:
    (lo_major, lo_minor), (hi_major, hi_minor) = bounds
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


PADDLE_SPEC = _spec(PADDLE_SUPPORTED)
TRITON_SPEC = _spec(TRITON_SUPPORTED)


@functools.lru_cache(maxsize=None)  # the backend choice asks about Triton's version at every op call
def parse(version: str) -> Tuple[int, int]:
    """(major, minor) of a version string such as '3.3.1', '3.2.0.post120', '3.6.0+git1234'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if not match:
        raise ValueError(f"version: expected 'MAJOR.MINOR...', got {version!r}")
    return int(match.group(1)), int(match.group(2))


def installed_paddle() -> Optional[Tuple[str, str]]:
    """(distribution, version) of the installed Paddle wheel, or None."""
    for name in PADDLE_DISTRIBUTIONS:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def paddle_problem(version: str) -> Optional[str]:
    """Why this Paddle version cannot be used, or None. A source build reports 0.0.0: accepted."""
    found = parse(version)
    if found == (0, 0):
        return None
    if found < PADDLE_SUPPORTED[0]:
        return (f"paddlenlp_fused needs Paddle {PADDLE_SPEC}, found {version} (it calls Paddle APIs that "
                f"Paddle {found[0]}.{found[1]} lacks, e.g. paddle.empty(device=...)): upgrade paddlepaddle")
    return None


def paddle_untested(version: str) -> Optional[str]:
    found = parse(version)
    if found != (0, 0) and found >= PADDLE_SUPPORTED[1]:
        return f"paddlenlp_fused is tested with Paddle {PADDLE_SPEC}, found {version}"
    return None


def triton_problem(version: str) -> Optional[str]:
    """Why this Triton version cannot run our kernels, or None."""
    lo, hi = TRITON_SUPPORTED
    if not lo <= parse(version) < hi:
        return f"triton {version} is outside the supported range {TRITON_SPEC}"
    return None


def check_versions() -> None:
    """Raise ImportError for an unsupported Paddle; warn for an untested newer one."""
    found = installed_paddle()
    if found is None:  # kernels-only use (the GPU suite's torch provider): nothing to check
        return
    name, version = found
    problem = paddle_problem(version)
    if problem:
        raise ImportError(f"{problem} ({name} {version} is installed)")
    untested = paddle_untested(version)
    if untested:
        warnings.warn(untested, RuntimeWarning, stacklevel=3)
