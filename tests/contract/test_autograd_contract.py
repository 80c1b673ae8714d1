"""Autograd and Paddle contract (DESIGN.md, "Autograd contract"): every entry of ``cases.ENTRIES``
on every backend it lists, against its plain Paddle composition.

The expected values come from the plain composition in the simplest setting (float32 leaves, one
consumer, ``paddle.grad``); each check then puts the fused op in a training loop's setting and
derives what it must give from them: other consumers of every input (their known gradients added),
two backward passes (twice the gradients), ``stop_gradient`` mixes, ``no_grad`` / ``eval``,
non-contiguous views, fleet's ``recompute`` with the backend chosen by ``use_backend`` around the
forward only, in-place edits after the forward, double backward (``create_graph=True``), 0 tokens,
bad inputs and AMP dtypes under ``paddle.amp.auto_cast`` / ``paddle.amp.decorate``.
"""

from __future__ import annotations

import re

import numpy as np
import paddle
import pytest
from paddle.distributed.fleet.utils import recompute

from cases import ENTRIES
from paddlenlp_fused import use_backend
from paddlenlp_fused.testing.numerics import assert_close, assert_sum_within, assert_within, bound_for, rel_err

FLOATS = (paddle.float16, paddle.bfloat16, paddle.float32, paddle.float64)
SUM_FACTOR = 8  # sums over every token (weights' gradients): see _check_grad and test_amp_dtypes
AMP_CAP = 0.5  # the largest relative error test_amp_dtypes accepts, whatever the baseline's
# amp_factor entries' weight gradients (token sums that cancel) against amp_factor's limit: up to 0.99
# of it seen (mamba_inner_fn's c_rms weight, O1, Triton, seed 456934019) in ~40 runs of the suite
AMP_SUM_FACTOR = 2
PRE, POST = 0.75, 0.25  # other consumers: PRE * sum(tanh(t)) before the op, POST * sum(t * t) after it


def _backend_params(entries, check):
    """(entry, backend) pairs; a defect reported to the owner of the op's file is a strict xfail."""
    return [pytest.param(e, b, id=f"{e.name}-{b}", marks=_known(e, check, b)) for e in entries for b in e.backends]


def _known(entry, check, backend):
    reason = entry.known.get((check, backend)) or entry.known.get(check)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _is_float(t):
    return isinstance(t, paddle.Tensor) and t.dtype in FLOATS


def _np(t):
    return t.astype("float32").numpy().astype(np.float64)


def _outputs(result):
    return [t for t in (result if isinstance(result, (tuple, list)) else (result,)) if t is not None]


class Case:
    """One entry on one backend with fresh inputs: the fused call, the plain expectation."""

    def __init__(self, entry, backend, dtypes=None):
        self.entry, self.backend = entry, backend
        self.values = entry.inputs()
        if dtypes:
            self.values = {k: dtypes(k, v) if _is_float(v) else v for k, v in self.values.items()}
        self.layer = entry.build(backend) if entry.is_layer else None
        self.plain_layer = entry.build("reference") if entry.is_layer else None
        if self.layer is not None and dtypes and dtypes("param", paddle.zeros([1])).dtype != paddle.float32:
            self.layer.to(dtype="bfloat16")
            for p in self.plain_layer.parameters():  # the plain composition on the same rounded values
                p.set_value(p.astype("bfloat16").astype("float32"))
        self.float_names = [k for k, v in self.values.items() if _is_float(v)]
        self.param_names = [n for n, _ in self.layer.named_parameters()] if self.layer is not None else []

    def params(self, layer=None):
        return dict((layer or self.layer).named_parameters()) if self.layer is not None else {}

    def call(self, tensors, **options):
        first = self.layer if self.layer is not None else self.backend
        return _outputs(self.entry.fused(first, **tensors, **options))

    def leaves(self, requires=lambda name: True):
        leaves = {}
        for name in self.float_names:
            leaf = self.values[name].detach().clone()
            leaf.stop_gradient = not requires(name)
            leaves[name] = leaf
        return leaves

    def _plain(self):
        """(outputs, sources by name) of the plain composition on float32 leaves of the inputs (and the
        plain layer's parameters, named "param:...")."""
        leaves = {k: paddle.to_tensor(_np(self.values[k]).astype(np.float32), stop_gradient=False)
                  for k in self.float_names}
        tensors = {**self.values, **leaves}
        if self.plain_layer is None:
            return _outputs(self.entry.plain(**tensors)), leaves
        params = {"param:" + n: p for n, p in self.plain_layer.named_parameters()}
        return _outputs(self.entry.plain(self.plain_layer, **tensors)), {**leaves, **params}

    def expected(self):
        """(outputs, loss weights, gradients by name) of the plain composition in float32."""
        if not hasattr(self, "_expected"):
            outs, sources = self._plain()
            weights = [_loss_weight(o.shape) for o in outs]
            grads = paddle.grad(_loss(outs, weights), list(sources.values()), allow_unused=True)
            grads = {n: (np.zeros(s.shape) if g is None else _np(g)) for (n, s), g in zip(sources.items(), grads)}
            self._expected = ([_np(o) for o in outs], weights, grads)
        return self._expected

    def terms(self, name):
        """For a weight of a ``token_axes`` entry, the sum over tokens of the magnitudes of each token's
        term of its gradient (of the plain composition, the loss of ``expected``); else None."""
        if not hasattr(self, "_terms"):
            _, weights, _ = self.expected()
            outs, sources = self._plain()
            summed = {n: s for n, s in sources.items() if _is_weight(self.entry, n)}
            axes = self.entry.token_axes
            self._terms = _token_terms(outs, weights, axes, summed) if axes is not None and summed else {}
        return self._terms.get(name)


def _token_terms(outs, weights, token_axes, sources):
    """{name: sum_t |d loss_t / d source|} for the loss split by token (``token_axes`` of every float
    output): a weight's gradient is the sum of these per-token terms, one backward pass each."""
    per_token = None
    for o, w in zip(outs, weights):
        if _is_float(o):
            other = [a for a in range(o.ndim) if a not in token_axes]
            part = o.astype("float32") * paddle.to_tensor(w.astype(np.float32))
            part = (part.sum(axis=other) if other else part).flatten()
            per_token = part if per_token is None else per_token + part
    names = list(sources)
    magnitudes = {n: np.zeros(sources[n].shape) for n in names}
    for t in range(per_token.shape[0]):
        grads = paddle.grad(per_token[t], [sources[n] for n in names], allow_unused=True, retain_graph=True)
        for n, g in zip(names, grads):
            if g is not None:
                magnitudes[n] += np.abs(_np(g))
    return magnitudes


def _loss_weight(shape):
    """Random weights of an output in the loss, of magnitude 0.5 to 1.5 (a scalar loss's weight near
    zero would leave its gradients below the rounding of the other consumers' terms)."""
    return np.random.choice([-1.0, 1.0], size=shape) * np.random.uniform(0.5, 1.5, size=shape)


def _loss(outs, weights):
    total = None
    for o, w in zip(outs, weights):
        if _is_float(o):
            term = (o.astype("float32") * paddle.to_tensor(w.astype(np.float32))).sum()
            total = term if total is None else total + term
    return total


def _check_outputs(case, outs, what, dtype="float32"):
    expected, _, _ = case.expected()
    assert len(outs) == len(expected), f"{what}: {len(outs)} outputs, the plain composition has {len(expected)}"
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert_close(f"{what} output {i}", _np(o), e, dtype)


def _is_weight(entry, name):
    return name.startswith("param:") or (entry.low_precision is not None and name not in entry.low_precision)


def _check_grad(case, name, got, what, extra=0.0, spread=None):
    """A float32 gradient against the plain composition's. A weight's gradient of a ``token_axes``
    entry sums terms over every token, which can cancel far below them (Mamba2Block's dt_bias and
    A_log gradients over two heads): within SUM_FACTOR times the float32 bound by relative norm, or
    DESIGN.md's measure for sums, each element within the float32 bound of the sum of its terms'
    magnitudes (each token's term of the loss, the other consumers' gradient one more term). An
    alias, a lost accumulation or a stray gradient is off by O(1) in both."""
    _, _, grads = case.expected()
    assert got is not None, f"{what}: {name} got no gradient"
    expected = grads[name] if spread is None else spread(grads[name])  # (spread: onto a view's storage)
    terms = case.terms(name)
    if terms is not None:
        terms = terms if spread is None else spread(terms)
        assert_sum_within(f"{what} d{name}", _np(got) - extra, expected, terms + np.abs(extra),
                          SUM_FACTOR * bound_for("float32"))
    else:
        assert_close(f"{what} d{name}", _np(got) - extra, expected, "float32")


def _other_consumers(t):
    """The gradient the other consumers give t (PRE * sum(tanh(t)) + POST * sum(t * t))."""
    v = _np(t)
    return PRE * (1 - np.tanh(v) ** 2) + 2 * POST * v


# ---- every input also feeds other branches; backward() twice accumulates; paddle.grad ----------

@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "other_consumers"))
def test_other_consumers_and_accumulation_backward(entry, backend):
    case = Case(entry, backend)
    _, weights, _ = case.expected()
    leaves = case.leaves()
    params = case.params()
    extra = {**{k: _other_consumers(v) for k, v in leaves.items()},
             **{"param:" + k: _other_consumers(p) for k, p in params.items()}}
    for step in (1, 2):
        tensors = {**case.values, **{k: v * 1.0 for k, v in leaves.items()}}
        owners = [tensors[k] for k in leaves] + list(params.values())
        pre = sum(PRE * paddle.tanh(t.astype("float32")).sum() for t in owners)
        outs = case.call(tensors)
        post = sum(POST * (t.astype("float32") ** 2).sum() for t in owners)
        (pre + _loss(outs, weights) + post).backward()
        if step == 1:
            _check_outputs(case, outs, "forward")
        for name, leaf in list(leaves.items()) + [("param:" + k, p) for k, p in params.items()]:
            assert leaf.grad is not None, f"{name}: no gradient after backward()"
            _check_grad(case, name, leaf.grad / step, f"backward() pass {step}", extra[name])
    for p in params.values():
        p.clear_gradient(False)


@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "paddle_grad"))
def test_other_consumers_paddle_grad(entry, backend):
    case = Case(entry, backend)
    _, weights, _ = case.expected()
    leaves = case.leaves()
    params = case.params()
    tensors = {**case.values, **{k: v * 1.0 for k, v in leaves.items()}}
    owners = [tensors[k] for k in leaves] + list(params.values())
    pre = sum(PRE * paddle.tanh(t.astype("float32")).sum() for t in owners)
    outs = case.call(tensors)
    post = sum(POST * (t.astype("float32") ** 2).sum() for t in owners)
    sources = list(leaves.items()) + [("param:" + k, p) for k, p in params.items()]
    grads = paddle.grad(pre + _loss(outs, weights) + post, [t for _, t in sources])
    for (name, t), g in zip(sources, grads):
        _check_grad(case, name, g, "paddle.grad", _other_consumers(t))


def test_paddle_grad_over_a_subset_of_pylayer_inputs():
    """Paddle's partial-gradient pass requires a PyLayer's backward to return None for the inputs not
    asked for and does not tell it which (docs/autograd.md): any PyLayer fails there, so the ops'
    PyLayers cannot do better; the ways round it that the docs give work."""
    class Product(paddle.autograd.PyLayer):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            ctx.needs = (not a.stop_gradient, not b.stop_gradient)  # what the ops' PyLayers know
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensor()
            return tuple(grad if need else None for grad, need in zip((g * b, g * a), ctx.needs))

    a, b = paddle.randn([3]), paddle.randn([3])
    a.stop_gradient = b.stop_gradient = False
    with pytest.raises(ValueError, match="should return None at 1 position"):
        paddle.grad(Product.apply(a, b), [a])
    (da, _) = paddle.grad(Product.apply(a, b), [a, b])  # every input that requires a gradient
    np.testing.assert_array_equal(da.numpy(), b.numpy())
    b.stop_gradient = True  # or stop the others before the call
    (da,) = paddle.grad(Product.apply(a, b), [a])
    np.testing.assert_array_equal(da.numpy(), b.numpy())


# ---- stop_gradient mixes, no_grad, eval ----------------------------------------------------------

@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "stop_gradient"))
def test_stop_gradient_mixes(entry, backend):
    case = Case(entry, backend)
    _, weights, _ = case.expected()
    names = case.float_names + ["param:" + n for n in case.param_names]
    for parity in (0, 1):
        frozen = {n for i, n in enumerate(names) if i % 2 == parity}
        if len(frozen) == len(names):
            continue
        leaves = case.leaves(lambda n: n not in frozen)
        params = case.params()
        for k, p in params.items():
            p.stop_gradient = "param:" + k in frozen
            p.clear_gradient(False)
        try:
            outs = case.call({**case.values, **leaves})
            _loss(outs, weights).backward()
            for name, t in list(leaves.items()) + [("param:" + k, p) for k, p in params.items()]:
                if name in frozen:
                    assert t.grad is None, f"{name}: stop_gradient=True, yet it got a gradient"
                else:
                    _check_grad(case, name, t.grad, f"frozen {sorted(frozen)}")
        finally:
            for p in params.values():
                p.stop_gradient = False
                p.clear_gradient(False)


@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "no_grad"))
def test_no_grad_and_eval(entry, backend):
    case = Case(entry, backend)
    with paddle.no_grad():
        outs = case.call({**case.values, **case.leaves()})
    assert all(o.stop_gradient for o in outs if _is_float(o)), "an output under no_grad requires a gradient"
    _check_outputs(case, outs, "no_grad")
    if case.layer is not None:
        case.layer.eval()
        outs = case.call({**case.values, **case.leaves()})
        case.layer.train()
        _check_outputs(case, outs, "eval()")


# ---- non-contiguous inputs ---------------------------------------------------------------------

def _strided_view(t):
    """(storage leaf, a non-contiguous view of it with t's values, the map of the view's gradient
    onto the storage)."""
    v = _np(t).astype(np.float32)
    if t.ndim >= 2:
        perm = list(range(t.ndim - 2)) + [t.ndim - 1, t.ndim - 2]
        storage = paddle.to_tensor(np.ascontiguousarray(np.swapaxes(v, -1, -2)), stop_gradient=False)
        return storage, storage.transpose(perm), lambda g: np.swapaxes(g, -1, -2)
    padded = np.zeros(2 * v.shape[0], np.float32)
    padded[::2] = v
    storage = paddle.to_tensor(padded, stop_gradient=False)
    return storage, storage[::2], lambda g: np.stack([g, np.zeros_like(g)], axis=-1).reshape(-1)


@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "non_contiguous"))
def test_non_contiguous_inputs(entry, backend):
    case = Case(entry, backend)
    _, weights, _ = case.expected()
    views = {k: _strided_view(case.values[k]) for k in case.float_names if case.values[k].size}
    assert any(not view.is_contiguous() for _, view, _ in views.values()), "no input view is non-contiguous"
    outs = case.call({**case.values, **{k: view for k, (_, view, _) in views.items()}})
    _check_outputs(case, outs, "non-contiguous")
    _loss(outs, weights).backward()
    for name, (storage, _, spread) in views.items():
        assert storage.grad is not None, f"{name}: no gradient through the view"
        _check_grad(case, name, storage.grad, "non-contiguous", spread=spread)
    for p in case.params().values():
        p.clear_gradient(False)


# ---- fleet's recompute -------------------------------------------------------------------------

@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "recompute"))
def test_recompute(entry, backend):
    """The op on ``backend="auto"`` with the backend chosen by ``use_backend`` around the forward
    only, as a training step does: fleet re-runs the forward in the backward, after the block (the
    re-run must take the forward's backend: a dropout mask of another backend, another gradient)."""
    case = Case(entry, "auto")
    _, weights, _ = case.expected()
    leaves = case.leaves()
    names = list(leaves)

    def forward(*tensors):
        result = case.call({**case.values, **dict(zip(names, tensors))})
        return tuple(result) if len(result) > 1 else result[0]

    with use_backend(backend):
        outs = _outputs(recompute(forward, *leaves.values()))
    _check_outputs(case, outs, "recompute")
    _loss(outs, weights).backward()
    params = case.params()
    for name, t in list(leaves.items()) + [("param:" + k, p) for k, p in params.items()]:
        _check_grad(case, name, t.grad, "recompute")
    for p in params.values():
        p.clear_gradient(False)


# ---- in-place edits after the forward; double backward -------------------------------------------

INPLACE_ERROR = "modified by an inplace operation"


def _edit_targets(case):
    """What one check edits in place after the forward: the first float input and, where the op has
    several outputs, the last (prenorm's residual stream h, which the next block reads)."""
    targets = [("input", case.float_names[0])]
    if len(case.expected()[0]) > 1:
        targets.append(("output", -1))
    return targets


@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "inplace"))
def test_inplace_edit_after_forward(entry, backend):
    """The op raises Paddle's in-place error in the backward (Paddle wraps a PyLayer's as OSError) or
    gives the gradients of the forward it ran (through the edit: an edited output's weight in the
    loss doubles). Where the plain composition raises, a PyLayer path raises too; the reference,
    plain Paddle itself, may keep a tensor the edit does not reach (out= buffers written by copy)."""
    case = Case(entry, backend)
    _, weights, grads = case.expected()
    plain_layer = [case.plain_layer] if case.plain_layer is not None else []
    plain_params = {"param:" + n: p for n, p in case.plain_layer.named_parameters()} if plain_layer else {}
    for kind, key in _edit_targets(case):
        leaves = case.leaves()
        tensors = {**case.values, **{k: v * 1.0 for k, v in leaves.items()}}
        plain_outs = _outputs(entry.plain(*plain_layer, **tensors))
        (tensors[key] if kind == "input" else plain_outs[key]).scale_(2.0)
        try:
            paddle.grad(_loss(plain_outs, weights), list({**leaves, **plain_params}.values()), allow_unused=True)
            plain_raises = False
        except RuntimeError as exc:
            assert INPLACE_ERROR in str(exc), exc
            plain_raises = True
        if kind == "input":
            expected = grads
        else:  # the edit scales the output in the graph: the plain composition's gradients with its weight doubled
            doubled = list(weights)
            doubled[key] = 2.0 * doubled[key]
            outs, sources = case._plain()
            expected = paddle.grad(_loss(outs, doubled), list(sources.values()), allow_unused=True)
            expected = {n: np.zeros(t.shape) if g is None else _np(g) for (n, t), g in zip(sources.items(), expected)}
        leaves = case.leaves()
        fused_sources = {**leaves, **{"param:" + k: p for k, p in case.params().items()}}
        tensors = {**case.values, **{k: v * 1.0 for k, v in leaves.items()}}
        outs = case.call(tensors)
        (tensors[key] if kind == "input" else outs[key]).scale_(2.0)
        try:
            got = paddle.grad(_loss(outs, weights), list(fused_sources.values()), allow_unused=True)
        except (RuntimeError, OSError) as exc:
            assert INPLACE_ERROR in str(exc), exc
            continue
        assert backend == "reference" or not plain_raises, \
            f"{kind} {key} edited in place after the forward: Paddle raises, the op did not"
        for name, g in zip(fused_sources, got):
            want = expected[name]
            assert_close(f"{kind} {key} edited: d{name}", np.zeros(want.shape) if g is None else _np(g), want,
                         "float32")


def _double_backward(sources, loss):
    """Second-order gradients: d/d sources of sum(first-order gradient ** 2)."""
    grads = paddle.grad(loss, sources, create_graph=True, allow_unused=True)
    total = sum((g * g).sum() for g in grads if g is not None and not g.stop_gradient)
    if not isinstance(total, paddle.Tensor):
        return grads, None
    return grads, paddle.grad(total, sources, allow_unused=True)


@pytest.mark.parametrize("entry,backend", _backend_params(ENTRIES, "create_graph"))
def test_create_graph(entry, backend):
    """``paddle.grad(..., create_graph=True)`` raises the op's clear error (Paddle wraps it as OSError),
    or gives the plain composition's first- and second-order gradients."""
    case = Case(entry, backend)
    _, weights, grads = case.expected()
    outs, sources = case._plain()
    try:
        _, expected = _double_backward(list(sources.values()), _loss(outs, weights))
    except (RuntimeError, OSError, ValueError) as exc:  # (a Paddle op without a double backward)
        expected = exc
    leaves = case.leaves()
    fused_sources = {**leaves, **{"param:" + k: p for k, p in case.params().items()}}
    outs = case.call({**case.values, **leaves})
    try:
        first, second = _double_backward(list(fused_sources.values()), _loss(outs, weights))
    except OSError as exc:
        assert "double backward" in str(exc) and "backend='reference'" in str(exc), exc
        return
    except (RuntimeError, ValueError) as exc:
        assert isinstance(expected, Exception), f"the plain composition has a double backward: {exc}"
        return
    for name, g in zip(fused_sources, first):
        _check_grad(case, name, g, "create_graph=True")
    if isinstance(expected, Exception):  # (the op has what the plain composition lacks: not compared)
        return
    for (name, _), g, e in zip(sources.items(), second, expected):
        assert (g is None) == (e is None), f"{name}: second-order gradient {g} where the plain composition has {e}"
        if g is not None:
            assert_close(f"second-order d{name}", _np(g), _np(e), "float32")


def test_inplace_edits_from_the_review():
    """Issue 29's two reproductions on the Triton backend: prenorm's stream h scaled after the forward
    (dx was off by O(1)), and fused_mlp_func's input scaled after it (sum|dW1| three times too big)."""
    import paddlenlp_fused as pf

    x, w, r = (paddle.randn(s) for s in ([4, 16], [16], [4, 16]))
    for t in (x, w, r):
        t.stop_gradient = False
    y, h = pf.rms_norm_fn(x * 1.0, w, residual=r * 1.0, prenorm=True, backend="triton")
    h.scale_(2.0)
    with pytest.raises(OSError, match=r"layer_norm_fn / rms_norm_fn: output 1, used in gradient computation, has "
                                      r"been modified by an inplace operation"):
        (y.sum() + h.sum()).backward()
    x, w1, w2 = (paddle.randn(s) for s in ([5, 8], [8, 6], [6, 4]))
    for t in (x, w1, w2):
        t.stop_gradient = False
    x2 = x * 1.0
    out = pf.fused_mlp_func(x2, w1, w2, backend="triton")
    x2.scale_(3.0)
    with pytest.raises(OSError, match=r"fused_mlp_func: input 'x2d', used in gradient computation, has been modified"):
        out.sum().backward()


def test_double_backward_on_the_kernels_raises_and_the_reference_has_it():
    import paddlenlp_fused as pf

    x = paddle.randn([3, 16])
    x.stop_gradient = False
    with pytest.raises(OSError, match=r"swiglu / geglu: double backward .*backend='reference'\) supports it"):
        paddle.grad((pf.swiglu(x, backend="triton") ** 2).sum(), [x], create_graph=True)
    (g,) = paddle.grad((pf.swiglu(x, backend="reference") ** 2).sum(), [x], create_graph=True)
    (second,) = paddle.grad(g.sum(), [x])
    x64 = paddle.to_tensor(x.numpy().astype(np.float64), stop_gradient=False)
    a, b = x64[:, :8], x64[:, 8:]
    (g64,) = paddle.grad(((paddle.nn.functional.silu(a) * b) ** 2).sum(), [x64], create_graph=True)
    (second64,) = paddle.grad(g64.sum(), [x64])
    assert_close("reference second-order dx", _np(second), second64.numpy(), "float32")


# ---- 0 tokens ----------------------------------------------------------------------------------

@pytest.mark.parametrize("entry,backend", _backend_params([e for e in ENTRIES if e.empty is not None], "empty"))
def test_empty_inputs(entry, backend):
    values = entry.empty()
    layer = entry.build(backend) if entry.is_layer else None
    leaves = {}
    for name, v in values.items():
        if _is_float(v):
            v.stop_gradient = False
            leaves[name] = v
    outs = _outputs(entry.fused(layer if layer is not None else backend, **values))
    for i, o in enumerate(outs):
        assert o.size == 0 or (o.size == 1 and np.isfinite(_np(o)).all() and float(_np(o).sum()) == 0.0), \
            f"output {i}: expected an empty tensor (or a zero loss), got shape {list(o.shape)}"
    loss = _loss(outs, [np.ones(o.shape) for o in outs])
    if loss is not None and not loss.stop_gradient:
        loss.backward()
    sources = list(leaves.items()) + (list(layer.named_parameters()) if layer is not None else [])
    for name, t in sources:
        if t.grad is not None:
            g = _np(t.grad)
            assert list(g.shape) == list(t.shape) and np.all(g == 0), f"{name}: expected a zero gradient"


# ---- bad inputs: the same error on every backend ------------------------------------------------

@pytest.mark.parametrize("entry,bad,backend", [
    pytest.param(e, bad, b, id=f"{e.name}-{bad.label}-{b}") for e in ENTRIES if not e.is_layer for bad in e.bad
    for b in e.backends])
def test_bad_inputs_raise_the_same_error_on_every_backend(entry, bad, backend):
    values = bad.change(entry.inputs())
    with pytest.raises(bad.error, match=rf"\b{re.escape(bad.arg)}\b"):
        entry.fused(backend, **values, **bad.options)


# ---- AMP-style dtypes ----------------------------------------------------------------------------

def _amp_params():
    params = []
    for e in ENTRIES:
        if e.low_precision is None:
            continue
        for level in (("O1", "O2") if e.o1 else ("O2",)):
            params += [pytest.param(e, level, b, id=f"{e.name}-{level}-{b}", marks=_known(e, level, b))
                       for b in e.backends]
    return params


def _amp_run(case, target, weights, level):
    """Outputs and gradients (by name) of the fused call on ``target`` (a backend, or a layer of
    ``case``'s dtypes) with ``case``'s low-precision inputs, the forward under Paddle's
    ``auto_cast`` of ``level`` (a layer also through ``decorate`` at O2), the backward after it, as
    a training step runs them. (Paddle's CPU build runs both as no-ops: the amp level stays O0.)"""
    leaves = case.leaves()
    if level == "O2" and isinstance(target, paddle.nn.Layer):
        target = paddle.amp.decorate(models=target, level="O2", dtype="bfloat16")
    with paddle.amp.auto_cast(level=level, dtype="bfloat16"):
        outs = _outputs(case.entry.fused(target, **{**case.values, **leaves}))
    _loss(outs, weights).backward()
    sources = list(leaves.items())
    if case.layer is not None:
        sources += [("param:" + k, p) for k, p in target.named_parameters()]
    grads = {}
    for name, t in sources:
        assert t.grad is not None and t.grad.dtype == t.dtype, f"{name}: gradient {t.grad} not in {t.dtype}"
        grads[name] = _np(t.grad)
    return [_np(o) for o in outs], grads


def _bfloat16_values(t):
    """``t`` (float32) rounded to the nearest bfloat16 values, still float32."""
    return t.astype("bfloat16").astype(t.dtype)


@pytest.mark.filterwarnings("ignore:amp_guard can only be enabled")  # (Paddle's CPU build: see _amp_run)
@pytest.mark.parametrize("entry,level,backend", _amp_params())
def test_amp_dtypes(entry, level, backend):
    """O1: bfloat16 activations, float32 weights; O2: bfloat16 everything. Gradients come in each
    input's dtype. O1's float32 weights hold bfloat16 values: an op may cast them to bfloat16 for
    its matmuls, as Paddle's O1 white list does, and the plain composition's expectation from other
    weights would charge it with that rounding (and, for a ReLU whose input sits within it of 0, a
    flipped derivative). Values against the plain float32 composition on the same (bfloat16-rounded)
    inputs, within DESIGN.md's bound: 2x the error of the plain composition in bfloat16, which
    Paddle's CPU build cannot run, so the reference backend (each op in float32, rounded to
    bfloat16 between ops) stands for it. The weights' gradients are sums over every token, which
    DESIGN.md bounds against their terms' magnitudes (``Case.terms``, which the float32 checks use,
    is not used here: these limits have shown no tail): within SUM_FACTOR times bfloat16's bound.
    An entry whose op chains bfloat16 roundings that the reference does not make gives
    ``amp_factor``: everything within that many times bfloat16's bound (its weights' token sums
    AMP_SUM_FACTOR times that), or within twice the reference backend's own error where a draw's
    conditioning (a tiny case: sums over ten tokens, norms over eight channels) amplifies the
    roundings past it, capped at AMP_CAP (the ops' own tests hold them to DESIGN.md's bounds; a
    wrong dtype or a lost term is off by O(1))."""
    def dtype_of(name, t):
        if level == "O2" or (name != "param" and name in entry.low_precision):
            return t.astype("bfloat16")
        return _bfloat16_values(t)

    case = Case(entry, backend, dtypes=dtype_of)
    baseline_layer = None
    if case.layer is not None:
        baseline_layer = entry.build("reference")
        if level == "O2":
            baseline_layer.to(dtype="bfloat16")
        else:
            for layer in (case.layer, case.plain_layer, baseline_layer):
                for p in layer.parameters():
                    p.set_value(_bfloat16_values(p))
    expected_outs, weights, expected_grads = case.expected()
    outs, grads = _amp_run(case, case.layer if case.layer is not None else backend, weights, level)
    base_outs, base_grads = _amp_run(case, baseline_layer if baseline_layer is not None else "reference", weights,
                                     level)
    checks = [(f"{level} output {i}", o, b, e, True) for i, (o, b, e) in enumerate(zip(outs, base_outs, expected_outs))]
    checks += [(f"{level} d{n}", g, base_grads[n], expected_grads[n], n in entry.low_precision) for n, g in grads.items()]
    for name, got, base, ref, per_token in checks:
        if entry.amp_factor:
            factor = entry.amp_factor * (1 if per_token else AMP_SUM_FACTOR)
            limit = max(factor * bound_for("bfloat16"), 2.0 * rel_err(base, ref))
            assert_within(name, got, ref, min(limit, AMP_CAP))
        elif per_token:
            assert_close(name, got, ref, "bfloat16", baseline_err=rel_err(base, ref))
        else:
            assert_within(name, got, ref, SUM_FACTOR * bound_for("bfloat16"))
