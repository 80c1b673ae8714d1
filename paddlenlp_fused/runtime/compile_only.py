"""Compile Triton kernels for a GPU that is not there.

``compile_only(capability)`` makes Triton's active driver one that targets ``GPUTarget("cuda",
capability, 32)``, reports that GPU's shared-memory and thread limits, and launches nothing. Inside
it, calling a launcher with ``SpecTensor`` arguments specialises, compiles (to cubin, through ptxas)
and size-checks every kernel, and every autotune config, exactly as a real launch would, with no
GPU and no torch. Not for interpreter mode (``TRITON_INTERPRET=1`` replaces kernels by Python).
"""

from __future__ import annotations

import contextlib
from typing import List

# Per-block limits of the targets we build for (CUDA programming guide, compute capabilities).
_DEVICE_LIMITS = {
    80: {"max_shared_mem": 163 * 1024, "multiprocessor_count": 108, "max_num_regs": 65536, "warpSize": 32},
    90: {"max_shared_mem": 227 * 1024, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32},
}
CAPABILITIES = tuple(sorted(_DEVICE_LIMITS))


def _make_driver(capability: int, records: List[dict]):
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase
    from triton.backends.nvidia.driver import ty_to_cpp

    limits = _DEVICE_LIMITS[capability]

    class _Utils:
        @staticmethod
        def get_device_properties(device):
            return dict(limits)

        @staticmethod
        def load_binary(name, kernel, shared, device):
            records.append({"name": name, "capability": capability, "shared": shared})
            # (module, function, n_regs, n_spills, n_max_threads)
            return None, None, 0, 0, 1024

    class _NoLaunch:
        def __init__(self, src, metadata):
            pass

        def __call__(self, *args, **kwargs):
            return None

    class CompileOnlyDriver(DriverBase):
        utils = _Utils()
        launcher_cls = _NoLaunch

        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            return ty_to_cpp(ty)

        def get_current_target(self):
            return GPUTarget("cuda", capability, 32)

        def get_current_device(self):
            return capability  # one kernel cache per target

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return divmod(capability, 10)

        def get_active_torch_device(self):
            return None

        def get_benchmarker(self):
            def run_once(kernel_call, quantiles=None, **_):
                kernel_call()  # compiles this autotune config
                return [1.0, 1.0, 1.0] if quantiles else 1.0

            return run_once

    return CompileOnlyDriver()


@contextlib.contextmanager
def compile_only(capability: int):
    """Within the block, Triton launches compile for sm_<capability> and run nothing.
    Yields the list of compiled kernels ({name, capability, shared}), filled as they load. Autotune
    results are cached per kernel, not per target: compile each capability in its own process."""
    if capability not in _DEVICE_LIMITS:
        raise ValueError(f"capability: expected one of {CAPABILITIES}, got {capability!r}")
    from triton import knobs
    from triton.runtime import driver

    if knobs.runtime.interpret:
        raise RuntimeError("compile_only needs compiled Triton: unset TRITON_INTERPRET")
    records: List[dict] = []
    previous = driver._active
    driver.set_active(_make_driver(capability, records))
    try:
        yield records
    finally:
        driver._active = previous

