"""Peers timed beside our kernels, loaded module by module from the pinned files that
``fetch_peers.py`` puts in ``.whl/`` (or from an installed copy).

``mamba_ssm`` and ``flash_attn`` import their CUDA extensions in their package ``__init__``, and
those do not build on the GPU machine; Liger-Kernel's ``__init__`` runs its backend dispatch. So no
package ``__init__`` is executed: ``load("mamba_ssm.ops.triton.ssd_combined")`` registers each
enclosing package as an empty module whose ``__path__`` is the package's folder, then imports the
Triton module itself (and what it imports). Nothing of the peers is kept in this repository.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import pathlib
import stat
import sys
import tarfile
import tempfile
import types
import zipfile
from typing import NamedTuple

WHEEL_DIR = pathlib.Path(__file__).resolve().parent.parent / ".whl"


class Pinned(NamedTuple):
    filename: str
    sha256: str


# top-level package -> the pinned file fetch_peers.py downloads: the newest release of each peer
PINNED = {
    "cut_cross_entropy": Pinned("cut_cross_entropy-25.1.1-py3-none-any.whl",
                                "e46f26d348f6a67927d17e65c5a212e795be13dcad5b10a77a200d6b8102d9d1"),
    "liger_kernel": Pinned("liger_kernel-0.8.5-py3-none-any.whl",  # the one Liger of every case (linear CE too)
                           "60789cd576af073ab9b192b570d2597fd0cdad489cd62fb44fb16256d43754c9"),
    "inf_cl": Pinned("inf_cl-1.2.1-py3-none-any.whl",
                     "c9657b6ddd592a08ce41906eb81f865f4d7ddafda2287215702be1e0e5bd8acf"),
    "mamba_ssm": Pinned("mamba_ssm-2.3.2.post1.tar.gz",
                        "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"),
    "flash_attn": Pinned("flash_attn-2.8.3.post2.tar.gz",
                         "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b"),
    "causal_conv1d": Pinned("causal_conv1d-1.7.0.tar.gz",
                            "3202758494eaa7b597ce1c282dfa188889506bfcb92cad3c407d26736bfcd32b"),
}


def sha256_of(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_dir() -> pathlib.Path:
    """This user's folder for extracted peers: ``$XDG_CACHE_HOME`` (else ``~/.cache``)
    ``/paddlenlp_fused/peers``, made private. Python is imported from it, so a folder another user
    could have planted (a fixed name under the shared temp folder, say) is refused."""
    base = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")
    root = base / "paddlenlp_fused" / "peers"
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = root.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ImportError(f"{root}: not a private folder of this user (owner uid {info.st_uid}, "
                          f"mode {stat.filemode(info.st_mode)}); remove it or set XDG_CACHE_HOME")
    return root


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


def _extract(top: str, archive: pathlib.Path, sha256: str) -> pathlib.Path:
    """The package folder of ``archive`` (a wheel or an sdist) whose content hash is ``sha256``,
    extracted once into this user's cache under a folder named by that hash."""
    root = cache_dir() / f"{archive.name}-{sha256[:16]}"
    if not (root / top).is_dir():
        staging = pathlib.Path(tempfile.mkdtemp(prefix=".partial-", dir=root.parent))
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
    pinned = PINNED[top]
    archive = WHEEL_DIR / pinned.filename
    if not archive.is_file():
        raise ImportError(f"{top}: neither installed nor {archive} (run benchmarks/fetch_peers.py where the "
                          "package index is reachable and carry .whl)")
    digest = sha256_of(archive)
    if digest != pinned.sha256:
        raise ImportError(f"{archive}: sha256 {digest}, pinned {pinned.sha256}")
    return _extract(top, archive, digest)


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
        return PINNED[top].filename
