"""Hygiene of the benchmarks' peer loading (no GPU needed): the index comes from pip's own
configuration, archives are checked against their pinned hashes, and extracted peers live in a
private per-user cache that another user cannot plant."""

import os
import pathlib
import re
import sys
import zipfile

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

import fetch_peers  # noqa: E402
import peers  # noqa: E402


def test_index_url_is_pips_configured_index(monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", "file:///srv/mirror/simple/")
    assert fetch_peers.index_url() == "file:///srv/mirror/simple"


def test_no_index_host_in_benchmark_code():
    for path in BENCH.glob("*.py"):
        assert not re.search(r"https?://", path.read_text()), f"{path.name} names a URL"


def test_every_pin_has_a_sha256():
    for top, pinned in peers.PINNED.items():
        assert re.fullmatch(r"[0-9a-f]{64}", pinned.sha256), top
        assert pinned.filename.replace("-", "_").startswith(top), top


def _fake_wheel(folder: pathlib.Path, top: str, filename: str) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / filename
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{top}/__init__.py", "VALUE = 7\n")
        zf.writestr(f"{top}/ops.py", "from . import __name__ as _n\nANSWER = 42\n")
    return path


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    """A pinned peer 'fakepeer' in a fresh .whl folder and cache, not installed anywhere."""
    wheel = _fake_wheel(tmp_path / "whl", "fakepeer", "fakepeer-1.0-py3-none-any.whl")
    monkeypatch.setattr(peers, "WHEEL_DIR", tmp_path / "whl")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(peers.PINNED, "fakepeer", peers.Pinned(wheel.name, peers.sha256_of(wheel)))
    yield wheel
    for name in [m for m in sys.modules if m == "fakepeer" or m.startswith("fakepeer.")]:
        del sys.modules[name]


def test_pinned_archive_extracts_into_the_private_cache(fake_peer, tmp_path):
    module = peers.load("fakepeer.ops")
    assert module.ANSWER == 42
    where = pathlib.Path(module.__file__).resolve()
    assert (tmp_path / "cache" / "paddlenlp_fused" / "peers").resolve() in where.parents
    mode = (tmp_path / "cache" / "paddlenlp_fused" / "peers").stat().st_mode
    assert mode & 0o077 == 0, oct(mode)


def test_an_archive_that_is_not_the_pinned_one_is_refused(fake_peer, monkeypatch):
    monkeypatch.setitem(peers.PINNED, "fakepeer", peers.Pinned(fake_peer.name, "0" * 64))
    with pytest.raises(ImportError, match="sha256"):
        peers.package_dir("fakepeer")


def test_a_cache_others_can_write_is_refused(fake_peer, tmp_path):
    root = tmp_path / "cache" / "paddlenlp_fused" / "peers"
    root.mkdir(parents=True)
    os.chmod(root, 0o777)
    with pytest.raises(ImportError, match="not a private folder"):
        peers.package_dir("fakepeer")
