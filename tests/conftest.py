"""CPU suite set-up: Triton kernels run in interpreter mode on Paddle CPU tensors.

``pytest`` (the CPU suite) never collects ``tests/gpu``; ``pytest tests/gpu`` on a GPU machine runs
compiled kernels, so the interpreter is switched on only when the GPU suite is not the target.
"""

import os
import pathlib

import numpy as np
import pytest

_GPU_DIR = pathlib.Path(__file__).parent / "gpu"


def _targets_gpu_suite(config) -> bool:
    for arg in config.args:
        path = pathlib.Path(arg.split("::")[0]).resolve()
        if path == _GPU_DIR or _GPU_DIR in path.parents:
            return True
    return False


def pytest_configure(config):
    if not _targets_gpu_suite(config):
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        os.environ.pop("PADDLENLP_FUSED_BACKEND", None)


def pytest_ignore_collect(collection_path, config):
    if not _targets_gpu_suite(config):
        path = pathlib.Path(collection_path).resolve()
        return path == _GPU_DIR or _GPU_DIR in path.parents
    return None


SEED_ENV = "PADDLENLP_FUSED_TEST_SEED"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Fresh random inputs per test (numpy and Paddle), reproducible from the seed that a failing
    test's report shows (``pytest_runtest_makereport``): rerun it with PADDLENLP_FUSED_TEST_SEED=<seed>."""
    fixed = os.environ.get(SEED_ENV)
    seed = int(fixed) if fixed else int(np.random.SeedSequence().entropy % (2**31))
    request.node.user_properties.append(("seed", seed))
    from paddlenlp_fused.testing import numerics  # here: the interpreter switch comes first

    numerics.current_test = f"{request.node.nodeid} seed={seed}"
    np.random.seed(seed)
    try:
        import paddle

        paddle.seed(seed)
    except ImportError:
        pass
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = dict(item.user_properties).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("seed", f"{SEED_ENV}={seed} pytest '{item.nodeid}'"))
