"""GPU suite: kernels against float64 references on tensors from a provider (Paddle when a CUDA
build of Paddle runs here, torch otherwise). Run with ``pytest tests/gpu`` on a GPU machine, or in
parallel with ``pytest -n 8 --dist loadgroup tests/gpu``: the cases past 2^31 elements (tens of GB
each) carry ``xdist_group("huge")``, so they run one after another in one worker instead of side by
side, where two of them overflow the device's memory."""

import pytest

from paddlenlp_fused.testing.providers import gpu_provider

_provider = None


def pytest_configure(config):
    # pytest-xdist registers the mark when it is installed; without it the mark is inert
    config.addinivalue_line("markers", "xdist_group(name): tests xdist --dist loadgroup runs in one worker")


@pytest.fixture(scope="session")
def provider():
    global _provider
    if _provider is None:
        _provider = gpu_provider()
    if _provider is None:
        pytest.skip("no GPU: neither a CUDA build of Paddle nor torch with CUDA runs here")
    return _provider
