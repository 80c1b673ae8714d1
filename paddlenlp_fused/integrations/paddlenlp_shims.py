"""Point PaddleNLP's own fused fast paths at paddlenlp_fused's ops: ``enable()`` / ``disable()``.

PaddleNLP 3.0.0b4 imports these optional kernel packages (found with ``grep -rn "paddlenlp_kernel\\|
mamba_ssm_paddle"`` over its package):

- ``paddlenlp_kernel.triton.cut_cross_entropy.linear_cross_entropy``: the loss of LLaMA, Qwen, Qwen2,
  Qwen2-MoE, Gemma and DeepSeek-V2 when ``config.use_fused_linear_cross_entropy`` (imported inside
  ``forward``);
- ``paddlenlp_kernel.triton.inf_cl.cal_inf_loss``: ``SimpleInfclLoss`` / ``MatryoshkaInfclLoss``
  (imported inside ``forward``);
- ``mamba_ssm_paddle.ops.selective_scan_interface.{selective_scan_fn, mamba_inner_fn}``,
  ``mamba_ssm_paddle.ops.triton.selective_state_update.selective_state_update`` and
  ``mamba_ssm_paddle.ops.causal_conv1d_interface.{causal_conv1d_fn, causal_conv1d_update}``: the Mamba and
  Jamba mixers' ``cuda_kernels_forward``, taken when all five imported at module import
  (``is_fast_path_available``);
- ``paddlenlp_kernel.triton.optimizer.adamw_16bit_moment`` (``AdamWMini``): not shimmed (another
  contract than our ``FusedAdamW``); that import keeps failing as before.

``enable()`` installs modules under those names in ``sys.modules`` (ahead of any real package of that
name; the previous entries are kept and put back by ``disable()``; where a real package is installed,
the shim packages search its directories, so its other submodules, e.g.
``paddlenlp_kernel.triton.optimizer``, still import) whose functions are ours:
``selective_scan_fn``, ``mamba_inner_fn``, ``selective_state_update``, ``causal_conv1d_fn``,
``causal_conv1d_update`` as they are (same signatures, Paddle ``[in, out]`` weights with
``is_paddle_linear=True``); ``mamba_chunk_scan_combined`` / ``mamba_split_conv1d_scan_combined`` also
under ``mamba_ssm_paddle.ops.triton.ssd_combined`` and ``paddlenlp_kernel.triton.mamba.ssd_combined``;
and the adapters below for the cut cross-entropy and Inf-CL signatures. Nothing is imported by
``enable()`` itself: the shim modules resolve their functions on first access, and PaddleNLP is not
imported. The PaddleNLP modeling modules that bind the Mamba names at import
(``paddlenlp.transformers.mamba.modeling``, ``jamba.modeling``) are re-bound to ours
(``is_fast_path_available = True``): at once if already imported, else by an import hook
(``sys.meta_path``) right after they are imported, which runs their own import code with the shims
withdrawn so that what they bind of their own is known. ``disable()`` puts those bindings and the
``sys.modules`` entries back, in either order of import. Each op picks its backend as usual (Triton /
CUDA on the GPU, the reference on CPU, Triton under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from typing import Dict, List

_MISSING = object()
_MAMBA_NAMES = ("selective_state_update", "selective_scan_fn", "causal_conv1d_fn", "causal_conv1d_update",
                "mamba_inner_fn")
_CONSUMERS = ("paddlenlp.transformers.mamba.modeling", "paddlenlp.transformers.jamba.modeling")

_saved_modules: Dict[str, object] = {}  # sys.modules entries the shims replaced (_MISSING: none)
_installed: Dict[str, types.ModuleType] = {}  # the shim modules, by name
_saved_consumers: Dict[str, Dict[str, object]] = {}


def linear_cross_entropy(e, c, targets, ignore_index=-100, softcap=None, reduction="mean", shift=False,
                         filter_eps="auto", impl="cce"):
    """``paddlenlp_kernel.triton.cut_cross_entropy.linear_cross_entropy`` (Apple CCE's signature) on our op.

    e ``[..., D]``; c the classifier ``[V, D]`` (CCE's layout), or ``[D, V]`` where only that fits: PaddleNLP's
    LLaMA passes its untied ``lm_head.weight`` ``[hidden, vocab]`` as is (a square ``[D, D]`` c is taken as
    ``[V, D]``, as paddlenlp_kernel does). targets ``[...]``. ``filter_eps`` defaults to ``"auto"`` as there
    (gradient tiles below 2^-12 skipped by the Triton backward; exact on the reference backend)."""
    from ..ops.cross_entropy import linear_cross_entropy as op

    if str(getattr(impl, "name", impl)).lower() != "cce":
        raise NotImplementedError(f"impl: only 'cce' exists here (as in paddlenlp_kernel), got {impl!r}")
    dim = e.shape[-1]
    transpose_y = c.ndim != 2 or c.shape[1] == dim or c.shape[0] != dim
    return op(e, c, targets, ignore_index=ignore_index, reduction=reduction, softcap=softcap, shift=shift,
              transpose_y=transpose_y, filter_eps=filter_eps)


def cal_flash_loss(q, k, labels=None, scale=None, head_dim=256):
    """Inf-CL's single-process ``cal_flash_loss``: per-row loss ``[B]`` of ``scale * q @ k.T`` against
    ``labels`` (rows of k; default ``arange``). ``head_dim`` (Inf-CL's tiling of D) is not needed here."""
    from ..ops.contrastive import cal_flash_loss as op

    return op(q, k, labels, scale, group=False)


def cal_inf_loss(q, k, labels=None, scale=None, head_dim=256):
    """paddlenlp_kernel's ``cal_inf_loss``: the mean of ``cal_flash_loss`` over this process's rows, with,
    as there, the gradient of a tensor ``scale`` all-reduced over all processes when
    ``paddle.distributed`` runs more than one."""
    import paddle
    import paddle.distributed as dist

    from ..distributed import comm

    if isinstance(scale, paddle.Tensor) and dist.is_initialized() and dist.get_world_size() > 1:
        scale = comm.copy_to_parallel(scale, dist.collective._get_global_group())
    return cal_flash_loss(q, k, labels, scale, head_dim).mean()


_SSD_NAMES = {"mamba_chunk_scan_combined": ("paddlenlp_fused.ops.ssd", "mamba_chunk_scan_combined"),
              "mamba_split_conv1d_scan_combined": ("paddlenlp_fused.ops.mamba2", "mamba_split_conv1d_scan_combined")}
# {shim module: {attribute: (our module, its attribute)}}; resolved on first access
_CONTENTS = {
    "paddlenlp_kernel.triton.cut_cross_entropy": {"linear_cross_entropy": (__name__, "linear_cross_entropy")},
    "paddlenlp_kernel.triton.inf_cl": {"cal_flash_loss": (__name__, "cal_flash_loss"),
                                       "cal_inf_loss": (__name__, "cal_inf_loss")},
    "paddlenlp_kernel.triton.mamba.ssd_combined": _SSD_NAMES,
    "mamba_ssm_paddle.ops.selective_scan_interface": {
        "selective_scan_fn": ("paddlenlp_fused.ops.mamba", "selective_scan_fn"),
        "mamba_inner_fn": ("paddlenlp_fused.ops.mamba", "mamba_inner_fn")},
    "mamba_ssm_paddle.ops.triton.selective_state_update": {
        "selective_state_update": ("paddlenlp_fused.ops.mamba", "selective_state_update")},
    "mamba_ssm_paddle.ops.causal_conv1d_interface": {
        "causal_conv1d_fn": ("paddlenlp_fused.ops.causal_conv1d", "causal_conv1d_fn"),
        "causal_conv1d_update": ("paddlenlp_fused.ops.causal_conv1d", "causal_conv1d_update")},
    "mamba_ssm_paddle.ops.triton.ssd_combined": _SSD_NAMES,
}


def _resolve(where):
    module, attr = where
    return getattr(importlib.import_module(module), attr)


def _shim_module(name: str, contents: dict) -> types.ModuleType:
    module = types.ModuleType(name, f"paddlenlp_fused shim for {name} (paddlenlp_fused.integrations.enable)")

    def __getattr__(attr):  # PEP 562: our ops load on first use, not at enable()
        if attr not in contents:
            raise AttributeError(f"module {name!r} has no attribute {attr!r}")
        value = module.__dict__[attr] = _resolve(contents[attr])
        return value

    module.__getattr__ = __getattr__
    return module


def _with_parents(names) -> List[str]:
    """Every package on the way to each module, parents first."""
    out: List[str] = []
    for name in names:
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in out:
                out.append(prefix)
    return out


def _real_search_path(name: str, parent_path) -> List[str]:
    """The directories of an installed package ``name`` (its parent's being ``parent_path``), without
    importing it; [] when there is none."""
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, parent_path)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def is_enabled() -> bool:
    return bool(_saved_modules)


def _patch_consumer(module) -> None:
    """Keep ``module``'s own Mamba bindings and bind ours (fast path on)."""
    _saved_consumers[module.__name__] = {key: module.__dict__.get(key, _MISSING)
                                         for key in _MAMBA_NAMES + ("is_fast_path_available",)}
    ours = {key: _resolve(where) for contents in _CONTENTS.values() for key, where in contents.items()
            if key in _MAMBA_NAMES}
    module.__dict__.update(ours, is_fast_path_available=True)


@contextlib.contextmanager
def _shims_withdrawn():
    """sys.modules as it would be without the shims; afterwards the shims again, and whatever real
    module got imported under a shimmed name meanwhile is what ``disable()`` puts back."""
    for name in reversed(list(_installed)):
        previous = _saved_modules[name]
        if previous is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    try:
        yield
    finally:
        for name, module in _installed.items():
            _saved_modules[name] = sys.modules.get(name, _MISSING)
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, module)


class _PatchingLoader(importlib.abc.Loader):
    """A consumer's own loader, run with the shims withdrawn, then ``_patch_consumer``."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        with _shims_withdrawn():
            self.loader.exec_module(module)
        if is_enabled():
            _patch_consumer(module)

    def __getattr__(self, attr):  # get_source, get_code... of the real loader
        return getattr(self.loader, attr)


class _ConsumerFinder(importlib.abc.MetaPathFinder):
    """Finds the consumer modules through the other finders and wraps their loader."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _CONSUMERS:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


_FINDER = _ConsumerFinder()


def enable() -> List[str]:
    """Install the shim modules and re-bind PaddleNLP's Mamba / Jamba fast-path names (now, or when
    those modules are imported); returns the installed module names. Imports neither PaddleNLP nor
    our ops. Calling it again while enabled changes nothing."""
    if is_enabled():
        return list(_saved_modules)
    names = _with_parents(_CONTENTS)
    for name in names:
        _saved_modules[name] = sys.modules.get(name, _MISSING)
        parent, _, child = name.rpartition(".")
        module = _shim_module(name, _CONTENTS.get(name, {}))
        # a package: its other submodules are looked up in the real package's directories, if any
        module.__path__ = _real_search_path(name, sys.modules[parent].__path__ if parent else None)
        sys.modules[name] = _installed[name] = module
        if parent:
            setattr(sys.modules[parent], child, module)
    for consumer in _CONSUMERS:
        if consumer in sys.modules:
            _patch_consumer(sys.modules[consumer])
    sys.meta_path.insert(0, _FINDER)
    return names


def disable() -> None:
    """Undo ``enable()``: the previous ``sys.modules`` entries and PaddleNLP's own bindings come back,
    and consumers imported from now on bind their own."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for consumer, values in _saved_consumers.items():
        module = sys.modules.get(consumer)
        if module is None:
            continue
        for key, value in values.items():
            if value is _MISSING:
                module.__dict__.pop(key, None)
            else:
                module.__dict__[key] = value
    _saved_consumers.clear()
    for name in reversed(list(_saved_modules)):
        previous = _saved_modules[name]
        if previous is _MISSING:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = previous
    _saved_modules.clear()
    _installed.clear()
