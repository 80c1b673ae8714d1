"""Packaging and the support matrix: the metadata's Triton range is the one the runtime checks, a wheel
built with PADDLENLP_FUSED_BUILD_CUDA=0 is pure and complete, the sdist carries the CUDA sources, and
``python -m paddlenlp_fused.check`` reports every op with the backends the ops dispatch over."""

import ast
import importlib
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest
from packaging.specifiers import SpecifierSet

from paddlenlp_fused import check
from paddlenlp_fused.runtime import versions

ROOT = pathlib.Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirement(requirements, name):
    found = [r for r in requirements if re.match(rf"{name}\b", r)]
    assert len(found) == 1, (name, requirements)
    return found[0][len(name):].replace(" ", "")


def test_pyproject_triton_range_is_the_runtime_range():
    triton = _requirement(_pyproject()["project"]["dependencies"], "triton")
    assert SpecifierSet(triton) == SpecifierSet(versions.TRITON_SPEC)


def test_dev_requirements_pin_numpy_below_2_4_and_a_supported_stack():
    lines = [line.split("#")[0].strip() for line in (ROOT / "requirements-dev.txt").read_text().splitlines()]
    lines = [line for line in lines if line]
    assert _requirement(lines, "numpy") == "<2.4"
    assert versions.triton_problem(_requirement(lines, "triton").lstrip("=")) is None
    assert versions.paddle_problem(_requirement(lines, "paddlepaddle").lstrip("=")) is None


def _copy_source(dest: pathlib.Path) -> pathlib.Path:
    """The files a build reads, without build outputs (the in-tree CUDA library, egg-info)."""
    ignore = shutil.ignore_patterns("__pycache__", "_lib", "*.egg-info", "*.so")
    dest.mkdir()
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("paddlenlp_fused", "csrc"):
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


def test_pure_wheel_has_every_module_and_no_library(tmp_path, monkeypatch):
    pytest.importorskip("wheel")
    src = _copy_source(tmp_path / "src")
    monkeypatch.setenv("PADDLENLP_FUSED_BUILD_CUDA", "0")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist")], check=True, cwd=src)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "paddlenlp_fused").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= names, sorted(modules - names)
    assert not [n for n in names if n.endswith(".so")]
    assert any(n.endswith(".dist-info/LICENSE") for n in names)
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    (triton,) = re.findall(r"^Requires-Dist: triton(\S+)$", metadata, re.M)
    assert SpecifierSet(triton) == SpecifierSet(versions.TRITON_SPEC)
    assert "License :: OSI Approved :: Apache Software License" in metadata


def test_cuda_wheel_carries_the_library_with_a_platform_tag(tmp_path, monkeypatch):
    """The packaging of a CUDA build, with a stand-in for csrc/build_cuda.py (nvcc takes minutes;
    tests/test_cuda_build.py checks the real library): the library lands in the wheel's root, the
    wheel is tagged py3-none-<platform>, and PADDLENLP_FUSED_BUILD_CUDA=1 fails without nvcc."""
    pytest.importorskip("wheel")
    src = _copy_source(tmp_path / "src")
    stand_in = src / "csrc" / "build_cuda.py"
    stand_in.write_text("import os, pathlib\n"
                        "def find_nvcc():\n    return os.environ.get('STAND_IN_NVCC')\n"
                        "def build(out_dir):\n    out_dir.mkdir(parents=True, exist_ok=True)\n"
                        "    (out_dir / 'libpaddlenlp_fused_cuda.so').write_bytes(b'stand-in')\n")
    monkeypatch.setenv("PADDLENLP_FUSED_BUILD_CUDA", "1")
    command = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
               "-w", str(tmp_path / "dist")]
    failed = subprocess.run(command, cwd=src, capture_output=True, text=True)
    assert failed.returncode != 0 and "nvcc was not found" in failed.stdout + failed.stderr
    monkeypatch.setenv("STAND_IN_NVCC", "nvcc")
    subprocess.run(command, check=True, cwd=src)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert re.search(r"-py3-none-linux_\w+\.whl$", wheel.name), wheel.name
    names = zipfile.ZipFile(wheel).namelist()
    assert "paddlenlp_fused/_lib/libpaddlenlp_fused_cuda.so" in names, [n for n in names if ".so" in n]
    assert "Root-Is-Purelib: false" in zipfile.ZipFile(wheel).read(
        next(n for n in names if n.endswith(".dist-info/WHEEL"))).decode()


def test_sdist_carries_the_cuda_sources(tmp_path):
    src = _copy_source(tmp_path / "src")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")], check=True, cwd=src,
                   capture_output=True, env={**os.environ, "PADDLENLP_FUSED_BUILD_CUDA": "0"})
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".h", ".py")}
    assert wanted <= names, sorted(wanted - names)
    assert "LICENSE" in names and not [n for n in names if n.endswith(".so")]


def test_check_command_reports_versions_and_every_op():
    out = subprocess.run([sys.executable, "-m", "paddlenlp_fused.check", "--device", "cpu"], capture_output=True,
                         text=True, check=True).stdout
    assert f"(supported {versions.TRITON_SPEC})" in out and f"(supported {versions.PADDLE_SPEC})" in out
    assert "CUDA kernel library:" in out
    assert re.search(r"reference yes\s+pure Paddle", out)
    assert re.search(r"cuda\s+no\s+the CUDA backend needs GPU tensors", out)
    for op in check.OP_BACKENDS:
        assert re.search(rf"{re.escape(op)}\s+has ", out), op


def test_check_reports_the_interpreter_numpy_limit(monkeypatch):
    monkeypatch.setattr(check, "_version", lambda name: {"numpy": "2.4.0"}.get(name, "3.6.0"))
    assert "fails with numpy >= 2.4" in check.report("cpu")


def _implemented_sets(module) -> list:
    """Every ``implemented=`` set that ``module``'s resolve_backend calls pass, evaluated in the module."""
    found = []
    for node in ast.walk(ast.parse(inspect.getsource(module))):
        if isinstance(node, ast.keyword) and node.arg == "implemented":
            found.append(set(eval(compile(ast.Expression(node.value), module.__name__, "eval"), vars(module))))
    return found


@pytest.mark.parametrize("ops_key", list(check.OP_BACKENDS))
def test_check_table_matches_the_ops_dispatch(ops_key):
    import paddlenlp_fused

    for name in ops_key.split(", "):
        module = importlib.import_module(f"paddlenlp_fused.{paddlenlp_fused._EXPORTS[name]}")
        sets = _implemented_sets(module)
        assert sets, f"{module.__name__} passes no implemented= to resolve_backend"
        assert set(check.OP_BACKENDS[ops_key]) in sets, (name, sets)


def test_doc_links_stay_inside_the_repository():
    """Every relative link of README.md and docs/ names a file of this repository (a published copy
    has no ../shared)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path = (page.parent / target).resolve()
            assert ROOT in path.parents or path == ROOT, f"{page.name} links outside the repository: {target}"
            assert path.exists(), f"{page.name} links to a missing file: {target}"


def test_performance_page_has_the_generated_table():
    text = (ROOT / "docs" / "performance.md").read_text()
    start, end = text.index("<!-- results:start -->"), text.index("<!-- results:end -->")
    table = text[start:end]
    for result in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        assert f"| {result.stem} |" in table, f"{result.name} is not in docs/performance.md: python benchmarks/run.py --table"
