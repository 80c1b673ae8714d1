"""Download the pinned peers into ``.whl/`` (git-ignored) where PyPI is reachable:
``python benchmarks/fetch_peers.py [--cuda]``. The GPU machine has no network: carry ``.whl`` to it;
``peers.py`` loads their Triton modules from these files (README: "Peers").

Wheels come through ``pip download``. ``mamba-ssm``, ``flash-attn`` and ``causal-conv1d`` are on
PyPI as sdists only, and ``pip download`` of an sdist runs its ``setup.py`` (which imports torch and
looks for nvcc) just to read its metadata, so those come straight from PyPI's simple index (the
JSON form pip reads), checked against the pinned sha256. ``--cuda`` also fetches causal-conv1d,
whose only use is a CUDA build on the GPU machine (mamba-ssm's sdist carries its CUDA sources too).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import urllib.request

from peers import PINNED, WHEEL_DIR

WHEELS = ["liger-kernel==0.6.4", "inf-cl==1.2.1", "cut-cross-entropy==25.1.1"]
SDISTS = {  # name: (version, sha256 of the sdist)
    "mamba-ssm": ("2.3.2.post1", "104cc47e9101e5401a675fa2b784f2952b9b037f3b1dd83b5ac544394e95d028"),
    "flash-attn": ("2.8.3.post2", "d0f9f0b08a986cdeadbffcf5ec8b3a8f514366c68ad1853d3ab061bc83cc340b"),
}
CUDA_SDISTS = {"causal-conv1d": ("1.7.0", "3202758494eaa7b597ce1c282dfa188889506bfcb92cad3c407d26736bfcd32b")}
INDEX = "https://pypi.org/simple"
CARRY_LIMIT_MiB = 64


def fetch_sdist(name: str, version: str, sha256: str) -> None:
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    target = WHEEL_DIR / filename
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == sha256:
        return
    request = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        files = json.load(response)["files"]
    url = next(f["url"] for f in files if f["filename"] == filename)
    with urllib.request.urlopen(url, timeout=600) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise RuntimeError(f"{filename}: sha256 {digest}, pinned {sha256}")
    target.write_bytes(data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="also fetch causal-conv1d (CUDA build only)")
    args = parser.parse_args(argv)
    WHEEL_DIR.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "-d", str(WHEEL_DIR), *WHEELS], check=True)
    for name, (version, sha256) in {**SDISTS, **(CUDA_SDISTS if args.cuda else {})}.items():
        fetch_sdist(name, version, sha256)
    total = 0
    for filename in PINNED.values():
        path = WHEEL_DIR / filename
        if path.is_file():
            size = path.stat().st_size
            total += size
            print(f"{size / 2**20:8.2f} MiB  {path}")
    print(f"{total / 2**20:8.2f} MiB in all: carried with .whl, against the {CARRY_LIMIT_MiB} MiB the device call "
          "carries (working tree and paddlenlp_fused/_lib included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
