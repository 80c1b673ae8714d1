"""What this machine supports: ``python -m paddlenlp_fused.check``.

Prints the Paddle, Triton, numpy and CUDA versions, the GPU, whether the CUDA kernel library loads,
and for every op which backends it has and which of them can run here, with the reason for each one
that cannot. It reads the same status the ops dispatch on (``runtime.backend.available_backends`` and
the library's load status): it probes nothing of its own.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Dict, List, Optional, Tuple

# Each public op (or group of ops sharing one dispatch) -> the backends it implements. Kept equal to
# the ``implemented=`` of the ops' ``resolve_backend`` calls by tests/test_check.py.
OP_BACKENDS: Dict[str, Tuple[str, ...]] = {
    "swiglu, geglu": ("triton", "reference"),
    "layer_norm_fn, rms_norm_fn": ("triton", "cuda", "reference"),
    "rmsnorm_gated_fn": ("triton", "reference"),
    "linear_cross_entropy, cce_linear_cross_entropy": ("cuda", "triton", "reference"),
    "flash_contrastive_loss, cal_flash_loss": ("triton", "reference"),
    "fused_dense_func, fused_mlp_func": ("cuda", "triton", "reference"),
    "selective_scan_fn, mamba_inner_fn": ("cuda", "triton", "reference"),
    "causal_conv1d_fn, causal_conv1d_update": ("cuda", "triton", "reference"),
    "causal_conv1d_varlen_states": ("triton", "reference"),
    "selective_state_update": ("triton", "reference"),
    "mamba_chunk_scan_combined": ("reference", "triton"),
    "mamba_split_conv1d_scan_combined, mamba2_state_update": ("triton", "reference"),
    "FusedAdamW": ("triton", "reference"),
}

# Triton 3.6's interpreter (CPU tensors with TRITON_INTERPRET=1) fails on numpy >= 2.4.
INTERPRETER_NUMPY_LIMIT = (2, 4)


def _version(distribution: str) -> Optional[str]:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _paddle_lines() -> Tuple[List[str], Optional[str]]:
    """Report lines about Paddle and the GPU, and the device kind ('gpu'/'cpu'), None without Paddle."""
    from .runtime import backend, versions

    found = versions.installed_paddle()
    if found is None:
        return ["Paddle: not installed (the ops need paddlepaddle or a CUDA build of Paddle)"], None
    name, version = found
    lines = [f"Paddle: {name} {version} (supported {versions.PADDLE_SPEC})"]
    import paddle

    if not paddle.is_compiled_with_cuda():
        lines.append("  CPU build of Paddle: ops run the reference, or Triton's interpreter with TRITON_INTERPRET=1")
    else:
        lines.append(f"  CUDA build of Paddle, CUDA {paddle.version.cuda()}, "
                     f"{paddle.device.cuda.device_count()} GPU(s) visible")
        for i in range(paddle.device.cuda.device_count()):
            major, minor = paddle.device.cuda.get_device_capability(i)
            lines.append(f"  gpu:{i} {paddle.device.cuda.get_device_name(i)}, sm_{major}{minor}")
    return lines, backend.local_device()


def report(device: Optional[str] = None) -> str:
    """The whole report as text; ``device`` ('gpu'/'cpu') overrides the detected one."""
    from .kernels.cuda import library, library_status
    from .runtime import backend, versions

    lines = [f"paddlenlp_fused {_version('paddlenlp_fused') or 'source tree'}, Python {sys.version.split()[0]}"]
    paddle_lines, detected = _paddle_lines()
    lines += paddle_lines

    triton_version = _version("triton")
    if triton_version is None:
        lines.append("Triton: not installed")
    else:
        problem = versions.triton_problem(triton_version)
        lines.append(f"Triton: {triton_version} (supported {versions.TRITON_SPEC})" + (f": {problem}" if problem else ""))

    numpy_version = _version("numpy")
    if numpy_version is not None:
        note = ("" if versions.parse(numpy_version) < INTERPRETER_NUMPY_LIMIT
                else ": Triton 3.6's interpreter fails with numpy >= 2.4 (install numpy<2.4 to run it)")
        lines.append(f"numpy: {numpy_version}{note}")

    ok, why = library_status()
    lines.append(f"CUDA kernel library: {library.library_path()}")
    lines.append(f"  {'loads' if ok else 'unavailable'}: {why}")

    device = device or detected
    if device is None:
        return "\n".join(lines)
    statuses = backend.available_backends(device)
    default = backend.default_backend()
    chosen = "automatic choice" if default == "auto" else f"{default!r} (use_backend / ${backend.ENV_VAR})"
    lines.append(f"Backends for {device.upper()} tensors (backend='auto' means {chosen}):")
    if not any(status.available for status in statuses.values()):
        lines.append(f"  none runs here: {next(iter(statuses.values())).reason}")
    for name, status in statuses.items():
        lines.append(f"  {name:9} {'yes' if status.available else 'no '}  {status.reason}")
    lines.append("Ops (a backend that can run may still decline a particular shape or dtype; auto then "
                 "falls back and warns once):")
    width = max(map(len, OP_BACKENDS))
    for op, implemented in OP_BACKENDS.items():
        runnable = [b for b in implemented if statuses[b].available]
        lines.append(f"  {op:{width}}  has {', '.join(sorted(implemented)):24}  "
                     f"runs here: {', '.join(sorted(runnable)) or 'none'}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m paddlenlp_fused.check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("gpu", "cpu"), default=None,
                        help="report backends for this tensor device instead of this machine's")
    args = parser.parse_args(argv)
    print(report(args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
