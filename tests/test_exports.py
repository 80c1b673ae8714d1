"""The one export map: every public name resolves to what its module defines, ``paddlenlp_fused.ops``
serves the same objects, and ``import paddlenlp_fused`` loads neither Paddle nor Triton."""

import inspect
import subprocess
import sys
import types

import pytest

import paddlenlp_fused
import paddlenlp_fused.ops as ops


@pytest.mark.parametrize("name", paddlenlp_fused.__all__)
def test_every_exported_name_resolves(name):
    value = getattr(paddlenlp_fused, name)
    assert not isinstance(value, types.ModuleType), f"{name} resolved to a module"
    defined_in = paddlenlp_fused._EXPORTS[name]
    assert inspect.getmodule(value).__name__ == f"paddlenlp_fused.{defined_in}", (name, defined_in)


def test_ops_serves_the_same_objects_as_the_package():
    for name in ops.__all__:
        assert getattr(ops, name) is getattr(paddlenlp_fused, name), name
    ops_names = {n for n, m in paddlenlp_fused._EXPORTS.items() if m.startswith("ops.")}
    # only names shadowed by a submodule of the same name are left out of ops
    assert ops_names - set(ops.__all__) == {"gated_activation"}


def test_ops_linear_cross_entropy_is_the_function():
    """``ops.<name>`` is the function for the loss too, also once the layer has imported its module."""
    import paddlenlp_fused.layers.linear_cross_entropy  # noqa: F401  (imports the op's module)
    from paddlenlp_fused.ops import linear_cross_entropy

    assert callable(linear_cross_entropy) and not isinstance(linear_cross_entropy, types.ModuleType)
    assert linear_cross_entropy is paddlenlp_fused.linear_cross_entropy


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'not_an_op'"):
        paddlenlp_fused.not_an_op  # noqa: B018


def test_package_import_is_cheap():
    code = ("import sys, paddlenlp_fused, paddlenlp_fused.ops; "
            "print(sorted(m for m in ('paddle', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
