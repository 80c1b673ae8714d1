"""Backend choice: which implementation of an op runs.

Every op takes ``backend`` in ``{"auto", "triton", "cuda", "reference"}``. ``"auto"`` defers to the
process default (``use_backend(...)`` context, else ``$PADDLENLP_FUSED_BACKEND``, else automatic
choice). Automatic choice on a GPU tensor takes CUDA when the library is built and supports the case,
else Triton; on a CPU tensor Triton in interpreter mode (``TRITON_INTERPRET=1``), else the reference.
Asking explicitly for a backend that cannot run raises ``BackendUnavailableError`` naming what is
missing; automatic choice that has to fall back on a GPU warns once per op and reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import warnings
from typing import Callable, Dict, NamedTuple, Optional, Sequence

from . import versions

BACKENDS = ("triton", "cuda", "reference")
ENV_VAR = "PADDLENLP_FUSED_BACKEND"

_override: contextvars.ContextVar[Optional[str]] = contextvars.ContextVar("paddlenlp_fused_backend", default=None)
_warned: set = set()


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run this call."""


class BackendStatus(NamedTuple):
    available: bool
    reason: str


def _check_name(name: str, where: str) -> str:
    if not isinstance(name, str) or name not in ("auto",) + BACKENDS:
        raise ValueError(f"{where}: expected one of 'auto', 'triton', 'cuda', 'reference', got {name!r}")
    return name


def default_backend() -> str:
    """The backend that ``backend="auto"`` means in this context."""
    name = _override.get()
    if name is not None:
        return name
    return _check_name(os.environ.get(ENV_VAR, "auto") or "auto", f"${ENV_VAR}")


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops inside the block on ``name`` wherever they are called with ``backend="auto"``.
    A forward that fleet's ``recompute`` re-runs in the backward, after the block has closed, runs
    on the backend of the block again (``_carry_into_recompute``)."""
    name = _check_name(name, "use_backend(name)")
    _carry_into_recompute()
    token = _override.set(name)
    try:
        yield
    finally:
        _override.reset(token)


_recompute_carries = False


def _carry_into_recompute() -> None:
    """Make fleet's ``recompute`` carry the ``use_backend`` choice into the forward it re-runs in
    the backward, through its custom state (saved with the RNG states at the forward, set around
    the re-run: with ``preserve_rng_state=True``, its default). Composed with a state registered
    before or after this, which fleet's manager otherwise allows only once."""
    global _recompute_carries
    if _recompute_carries:
        return
    _recompute_carries = True
    try:
        from paddle.distributed.fleet.recompute.recompute import custom_state_manager as manager
    except ImportError:  # pragma: no cover - a Paddle without fleet's recompute
        return

    others = {"custom_get_state_func": [], "custom_set_state_func": []}  # registered by others, in order

    def get_state():
        return _override.get(), [get() for get in others["custom_get_state_func"]]

    def set_state(state):
        _override.set(state[0])
        for set_other, other_state in zip(others["custom_set_state_func"], state[1]):
            set_other(other_state)

    for attribute, ours in (("custom_get_state_func", get_state), ("custom_set_state_func", set_state)):
        if getattr(manager, attribute) is not None:
            others[attribute].append(getattr(manager, attribute))
        setattr(manager, attribute, ours)
        setattr(manager, "set_" + attribute, others[attribute].append)


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


_interpret_mode: Optional[bool] = None


def interpreter_enabled() -> bool:
    """Whether Triton runs in interpreter mode in this process, decided once, at the first ask
    (the first op call or backend query): Triton picks interpreted or compiled kernels when their
    modules are imported, so a later change of TRITON_INTERPRET cannot switch them."""
    global _interpret_mode
    if _interpret_mode is None:
        _interpret_mode = _env_interpret()
    return _interpret_mode


def interpreter_mode_changed() -> Optional[str]:
    """Why the current TRITON_INTERPRET does not hold for this process, or None."""
    mode = interpreter_enabled()
    if _env_interpret() == mode:
        return None
    now = "set" if _env_interpret() else "unset"
    return (f"TRITON_INTERPRET was {now} after paddlenlp_fused decided Triton's mode (interpreter "
            f"{'on' if mode else 'off'}) at its first use; it stays {'on' if mode else 'off'} in this process: "
            f"set TRITON_INTERPRET before importing paddlenlp_fused")


def _triton_status(device: str) -> BackendStatus:
    try:
        import triton
    except ImportError as exc:  # pragma: no cover - triton is an install requirement
        return BackendStatus(False, f"triton is not importable ({exc})")
    problem = versions.triton_problem(triton.__version__)
    if problem:
        return BackendStatus(False, problem)
    changed = interpreter_mode_changed()
    if device == "gpu":
        if interpreter_enabled():
            return BackendStatus(False, "Triton is in interpreter mode (TRITON_INTERPRET=1), which runs CPU "
                                        "tensors only" + (f" ({changed})" if changed else ""))
        return BackendStatus(True, f"triton {triton.__version__} on the GPU")
    if interpreter_enabled():
        return BackendStatus(True, f"triton {triton.__version__} in interpreter mode (TRITON_INTERPRET=1)")
    return BackendStatus(False, changed or "Triton runs CPU tensors only in interpreter mode: set TRITON_INTERPRET=1 "
                                           "before importing paddlenlp_fused")


def _cuda_status(device: str) -> BackendStatus:
    if device != "gpu":
        return BackendStatus(False, "the CUDA backend needs GPU tensors")
    from ..kernels.cuda import library_status

    return BackendStatus(*library_status())


def backend_status(name: str, device: str) -> BackendStatus:
    if name == "reference":
        return BackendStatus(True, "pure Paddle")
    if name == "triton":
        return _triton_status(device)
    if name == "cuda":
        return _cuda_status(device)
    raise ValueError(f"backend: unknown backend {name!r}")


def local_device() -> str:
    """'gpu' when Paddle sees a CUDA device, else 'cpu'."""
    import paddle

    if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
        return "gpu"
    return "cpu"


def no_gpu_reason() -> Optional[str]:
    """Why this process has no GPU tensors (a CPU build of Paddle, or no visible GPU), or None."""
    import paddle

    if not paddle.is_compiled_with_cuda():
        return "no GPU here: this Paddle is a CPU build (not compiled with CUDA)"
    if paddle.device.cuda.device_count() == 0:
        return "no GPU here: Paddle is compiled with CUDA but sees no GPU (driver, CUDA_VISIBLE_DEVICES)"
    return None


def available_backends(device: Optional[str] = None) -> Dict[str, BackendStatus]:
    """Each backend with whether it can run on ``device`` ('gpu'/'cpu', default: this machine's)
    and why (not). For 'gpu' on a machine without one, none can: there are no GPU tensors to run on."""
    device = device or local_device()
    statuses = {name: backend_status(name, device) for name in BACKENDS}
    missing = no_gpu_reason() if device == "gpu" else None
    if missing:  # the backend's own problem, if it has one, is still worth knowing
        statuses = {name: BackendStatus(False, missing if status.available else f"{missing}; also {status.reason}")
                    for name, status in statuses.items()}
    return statuses


def _norm_order(N: int) -> tuple:
    """LayerNorm / RMSNorm by hidden size N: Triton first where it is faster for both norms
    (1024 < N <= 4096, N > 8192), CUDA at N <= 1024 and N = 8192."""
    return ("triton", "cuda") if 1024 < N <= 4096 or N > 8192 else ("cuda", "triton")


# ``auto`` on GPU tensors: the backends each op tries, in this order (the first that is built and
# supports the call runs; measurements behind the choices: benchmarks/NOTES.md). A tuple, or a
# function of the call's case (``gpu_order(op, **case)``). Ops not listed: DEFAULT_GPU_ORDER.
DEFAULT_GPU_ORDER = ("cuda", "triton")
AUTO_ORDER = {
    "layer_norm": _norm_order,  # case: N, the hidden size
    "rms_norm": _norm_order,
    "selective_scan": ("triton", "cuda"),  # (and mamba_inner, which runs the same scans)
    "causal_conv1d": ("triton", "cuda"),
}


def gpu_order(op: str, **case) -> tuple:
    """The GPU backends ``auto`` tries for ``op``, in order (see AUTO_ORDER)."""
    order = AUTO_ORDER.get(op, DEFAULT_GPU_ORDER)
    return tuple(order(**case) if callable(order) else order)


def resolve_backend(op: str, requested: Optional[str], device: str, implemented: Sequence[str],
                    unsupported: Optional[Callable[[str], Optional[str]]] = None,
                    prefer: Optional[Sequence[str]] = None) -> str:
    """Pick the backend for one call of ``op``.

    ``implemented``: backends the op has. ``unsupported(name)`` returns why that backend cannot take
    this particular case (shape, width, dtype), or None. ``prefer``: GPU order for automatic choice
    (default ``gpu_order(op)``).
    """
    name = _check_name(requested if requested is not None else "auto", f"{op}(backend)")
    if name == "auto":
        name = default_backend()
    if name != "auto":
        if name not in implemented:
            raise BackendUnavailableError(f"{op}: no {name!r} implementation; this op has {list(implemented)}")
        status = backend_status(name, device)
        if not status.available:
            raise BackendUnavailableError(f"{op}: backend {name!r} cannot run: {status.reason}")
        why = unsupported(name) if unsupported else None
        if why:
            raise BackendUnavailableError(f"{op}: backend {name!r} does not support this call: {why}")
        return name

    if device == "gpu":
        order = list(prefer if prefer is not None else gpu_order(op))
    else:  # on a CPU the one kernel backend is Triton's interpreter
        order = ["triton"] if interpreter_enabled() else []
    skipped = []
    for candidate in order:
        if candidate not in implemented:
            continue
        status = backend_status(candidate, device)
        why = None if not status.available else (unsupported(candidate) if unsupported else None)
        if status.available and not why:
            if skipped:
                _warn_once(op, skipped, candidate)
            return candidate
        skipped.append((candidate, why or status.reason))
    if device == "gpu":
        _warn_once(op, skipped, "reference")
    return "reference"


def _warn_once(op: str, skipped, chosen: str) -> None:
    key = (op, tuple(skipped), chosen)
    if key in _warned:
        return
    _warned.add(key)
    reasons = "; ".join(f"{name}: {why}" for name, why in skipped)
    warnings.warn(f"paddlenlp_fused.{op}: falling back to the {chosen} backend ({reasons})", RuntimeWarning,
                  stacklevel=3)
