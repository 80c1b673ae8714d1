"""Download the pinned peers into ``.whl/`` (git-ignored) where the package index is reachable:
``python benchmarks/fetch_peers.py [--cuda]``. The GPU machine has no network: carry ``.whl`` to it;
``peers.py`` loads their Triton modules from these files (README: "Peers").

Wheels come through ``pip download``. ``mamba-ssm``, ``flash-attn`` and ``causal-conv1d`` are
published as sdists only, and ``pip download`` of an sdist runs its ``setup.py`` (which imports torch
and looks for nvcc) just to read its metadata, so those come straight from the index's simple API
(the JSON form pip reads). The index is the one pip is configured with (``pip config``,
``PIP_INDEX_URL``), else pip's own default. Every file is checked against the sha256 that
``peers.PINNED`` holds. ``--cuda`` also fetches causal-conv1d, whose only use is a CUDA build on the
GPU machine (mamba-ssm's sdist carries its CUDA sources too).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import urllib.request

from peers import PINNED, WHEEL_DIR, sha256_of

WHEELS = {"liger-kernel": "liger_kernel", "inf-cl": "inf_cl", "cut-cross-entropy": "cut_cross_entropy"}
SDISTS = {"mamba-ssm": "mamba_ssm", "flash-attn": "flash_attn"}
CUDA_SDISTS = {"causal-conv1d": "causal_conv1d"}
CARRY_LIMIT_MiB = 64


def _version(filename: str) -> str:
    return filename.split("-")[1].removesuffix(".tar.gz")


def index_url() -> str:
    """The index pip itself would use: its configured ``index-url``, else its built-in default."""
    listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             check=True).stdout
    for line in listing.splitlines():
        key, _, value = line.partition("=")
        if key.rsplit(".", 1)[-1] == "index-url":
            return value.strip().strip("'\"").rstrip("/")
    from pip._internal.models.index import PyPI  # pip's default index, named by pip alone

    return PyPI.simple_url.rstrip("/")


def check(top: str) -> None:
    pinned = PINNED[top]
    digest = sha256_of(WHEEL_DIR / pinned.filename)
    if digest != pinned.sha256:
        raise RuntimeError(f"{pinned.filename}: sha256 {digest}, pinned {pinned.sha256}")


def fetch_sdist(name: str, top: str, index: str) -> None:
    pinned = PINNED[top]
    target = WHEEL_DIR / pinned.filename
    if target.is_file() and sha256_of(target) == pinned.sha256:
        return
    request = urllib.request.Request(f"{index}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    url = next(f["url"] for f in files if f["filename"] == pinned.filename)
    with urllib.request.urlopen(url, timeout=600) as response:
        target.write_bytes(response.read())
    check(top)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="also fetch causal-conv1d (CUDA build only)")
    args = parser.parse_args(argv)
    WHEEL_DIR.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "-d", str(WHEEL_DIR),
                    *(f"{name}=={_version(PINNED[top].filename)}" for name, top in WHEELS.items())], check=True)
    for top in WHEELS.values():
        check(top)
    sdists = {**SDISTS, **(CUDA_SDISTS if args.cuda else {})}
    if sdists:
        index = index_url()
        for name, top in sdists.items():
            fetch_sdist(name, top, index)
    total = 0
    for pinned in PINNED.values():
        path = WHEEL_DIR / pinned.filename
        if path.is_file():
            size = path.stat().st_size
            total += size
            print(f"{size / 2**20:8.2f} MiB  {path}")
    print(f"{total / 2**20:8.2f} MiB in all: carried with .whl, against the {CARRY_LIMIT_MiB} MiB the device call "
          "carries (working tree and paddlenlp_fused/_lib included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
