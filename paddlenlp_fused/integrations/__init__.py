"""Integrations with other libraries.

``paddlenlp``: ``swap_fused_layers(model)`` replaces a PaddleNLP model's layers with ours in place.
``enable()`` / ``disable()``: make PaddleNLP's own optional fast paths (its imports of ``paddlenlp_kernel``
and ``mamba_ssm_paddle``) resolve to our ops (``paddlenlp_shims``), before or after PaddleNLP is imported.
Neither imports PaddleNLP; our ops load when PaddleNLP first uses them.
"""


def enable():
    """See ``paddlenlp_shims.enable``."""
    from .paddlenlp_shims import enable as _enable

    return _enable()


def disable():
    """See ``paddlenlp_shims.disable``."""
    from .paddlenlp_shims import disable as _disable

    return _disable()
