"""Peers timed beside our kernels, loaded module by module from the pinned files that
``fetch_peers.py`` puts in ``.whl/`` (or from an installed copy).

``mamba_ssm`` and ``flash_attn`` import their CUDA extensions in their package ``__init__``, and
those do not build on the GPU machine; Liger-Kernel's ``__init__`` runs its backend dispatch. So no
package ``__init__`` is executed: ``load("mamba_ssm.ops.triton.ssd_combined")`` registers each
enclosing package as an empty module whose ``__path__`` is the package's folder, then imports the
Triton module itself (and what it imports). Nothing of the peers is kept in this repository.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import tarfile
import tempfile
import types
import zipfile

WHEEL_DIR = pathlib.Path(__file__).resolve().parent.parent / ".whl"
# top-level package -> the pinned file fetch_peers.py downloads
PINNED = {
    "cut_cross_entropy": "cut_cross_entropy-25.1.1-py3-none-any.whl",
    "liger_kernel": "liger_kernel-0.6.4-py3-none-any.whl",  # the one Liger of every case (linear CE too)
    "inf_cl": "inf_cl-1.2.1-py3-none-any.whl",
    "mamba_ssm": "mamba_ssm-2.3.2.post1.tar.gz",
    "flash_attn": "flash_attn-2.8.3.post2.tar.gz",
    "causal_conv1d": "causal_conv1d-1.7.0.tar.gz",
}
_EXTRACTED = pathlib.Path(tempfile.gettempdir()) / "paddlenlp_fused_peers"


def _installed_dir(top: str):
    """The folder of an installed copy (``pip install --target`` on PYTHONPATH, a CUDA build), found
    without importing it."""
    module = sys.modules.get(top)
    if module is not None:
        return pathlib.Path(list(module.__path__)[0])
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _extract(top: str, archive: pathlib.Path) -> pathlib.Path:
    """The package folder of ``archive`` (a wheel or an sdist), extracted once under the temp dir."""
    root = _EXTRACTED / archive.name
    if not (root / top).is_dir():
        _EXTRACTED.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".partial-", dir=_EXTRACTED))
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(staging, [n for n in zf.namelist() if n.startswith(f"{top}/")])
        else:  # sdist: <name>-<version>/<top>/...
            with tarfile.open(archive) as tf:
                members = [m for m in tf.getmembers() if m.name.split("/")[1:2] == [top]]
                tf.extractall(staging, members, filter="data")
            staging = staging / members[0].name.split("/")[0]
        staging.rename(root)  # whole, so a run stopped half-way leaves no partial package behind
    return root / top


def package_dir(top: str) -> pathlib.Path:
    found = _installed_dir(top)
    if found is not None:
        return found
    archive = WHEEL_DIR / PINNED[top]
    if not archive.is_file():
        raise ImportError(f"{top}: neither installed nor {archive} (run benchmarks/fetch_peers.py where PyPI "
                          "is reachable and carry .whl)")
    return _extract(top, archive)


def load(module: str):
    """Import ``module`` of a peer without running any enclosing package's ``__init__``."""
    parts = module.split(".")
    root = package_dir(parts[0])
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        if name not in sys.modules:
            stub = types.ModuleType(name)
            stub.__path__ = [str(root.joinpath(*parts[1:i]))]
            sys.modules[name] = stub
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], stub)
    return importlib.import_module(module)


def describe(top: str) -> str:
    """Where a peer came from, for the JSON: the installed version, or the pinned file."""
    try:
        from importlib.metadata import version

        return f"{top} {version(top)} (installed)"
    except Exception:  # not installed: the pinned archive in .whl
        return PINNED[top]
