"""GPU suite: kernels against float64 references on tensors from a provider (Paddle when a CUDA
build of Paddle runs here, torch otherwise). Run with ``pytest tests/gpu`` on a GPU machine."""

import pytest

from paddlenlp_fused.testing.providers import gpu_provider

_provider = None


@pytest.fixture(scope="session")
def provider():
    global _provider
    if _provider is None:
        _provider = gpu_provider()
    if _provider is None:
        pytest.skip("no GPU: neither a CUDA build of Paddle nor torch with CUDA runs here")
    return _provider
