"""LayerNorm / RMSNorm (Triton and CUDA) and gated RMSNorm (Triton) on the GPU against float64:
every output poisoned (NaN) before the kernels write it, workspaces included; fp32/fp16/bf16;
hidden sizes 1, odd, 4096, past one register block and 65536; 1 and many rows; residual streams of
another dtype; unaligned rows; rows past 2^31 elements; flash-attn's second output (weight1/bias1) and
the residual stream stored without a residual (the op's residual_out= with h = x).

``python tests/gpu/test_norm.py`` runs each kernel once on small shapes (for compute-sanitizer).
"""

import numpy as np
import pytest

from paddlenlp_fused.kernels.cuda import norm as cuda_norm
from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.testing.numerics import assert_close, assert_close_to_terms, assert_sum_close, bound_for

KERNELS = {"triton": triton_norm, "cuda": cuda_norm}
DTYPES = ("float32", "float16", "bfloat16")
SHAPES = [(1, 1), (300, 1), (37, 7), (1, 4096), (1000, 4096), (257, 8192), (5, 12345), (64, 65536)]  # (M, N)


def _tuning(backend, options, direction):
    """A launcher's tuning argument from a dict of its fields (the variant tests' tables)."""
    if backend == "cuda":
        return dict(variant=cuda_norm.NormVariant(**options))
    return dict(tuning=(triton_norm.FwdTuning if direction == "fwd" else triton_norm.BwdTuning)(**options))


def _workspace(provider, backend, M, N, dtype, has_bias, group_size=None, **options):
    if backend == "cuda":
        partials, rowstats = cuda_norm.bwd_workspace_shapes(M, N, dtype, has_bias, **_tuning(backend, options, "bwd"))
    else:
        partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, has_bias, group_size,
                                                              **_tuning(backend, options, "bwd"))
    return provider.poisoned(partials, "float32"), None if rowstats is None else provider.poisoned(rowstats, "float32")


def _round(provider, a, dtype):
    return provider.to_numpy(provider.from_numpy(a, dtype))


def _reference(h, w, b, dy, dres_out, eps, is_rms):
    """float64 y, dh (incl. dres_out), dweight, dbias, rstd of a norm over the last axis."""
    mean = 0.0 if is_rms else h.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (h - mean) * rstd
    y = xhat * w + (0.0 if b is None else b)
    wdy = dy * w
    c2 = 0.0 if is_rms else wdy.mean(-1, keepdims=True)
    dh = (wdy - xhat * (xhat * wdy).mean(-1, keepdims=True) - c2) * rstd
    if dres_out is not None:
        dh = dh + dres_out
    return y, dh, (dy * xhat).sum(0), dy.sum(0), rstd


def _run(provider, backend, x, w, b, dy, *, residual=None, res_out_dtype=None, dres_out=None, eps=1e-5,
         is_rms=False, weight_offset=0.0, fwd_options=None, bwd_options=None):
    """Forward and backward of one backend on poisoned outputs; returns them as float64 arrays.
    ``fwd_options`` / ``bwd_options``: launcher variant overrides (and the workspace's). Triton
    gets the counters of the fused partial sums (as the op passes them; checked to be left zeroed)
    unless ``bwd_options`` has ``counters=False``."""
    fwd_options, bwd_options = dict(fwd_options or {}), dict(bwd_options or {})
    counters = None
    if bwd_options.pop("counters", True) and backend == "triton":
        counters = provider.zeros((triton_norm.COUNTERS,), "int32")
    K = KERNELS[backend]
    M, N = x.shape
    dtype = str(x.dtype).split(".")[-1]
    y, rstd = provider.poisoned((M, N), dtype), provider.poisoned((M,), "float32")
    mean = None if is_rms else provider.poisoned((M,), "float32")
    res_out = None if res_out_dtype is None else provider.poisoned((M, N), res_out_dtype)
    K.norm_fwd(x, w, b, y, mean, rstd, residual=residual, residual_out=res_out, eps=eps, is_rms_norm=is_rms,
               weight_offset=weight_offset, **_tuning(backend, fwd_options, "fwd"))
    dx = provider.poisoned((M, N), dtype)
    res_dtype = None if residual is None else str(residual.dtype).split(".")[-1]
    dres = provider.poisoned((M, N), res_dtype) if res_dtype not in (None, dtype) else None
    dw = provider.poisoned(tuple(w.shape), str(w.dtype).split(".")[-1])
    db = None if b is None else provider.poisoned(tuple(b.shape), str(b.dtype).split(".")[-1])
    partials, rowstats = _workspace(provider, backend, M, N, dtype, b is not None, **bwd_options)
    K.norm_bwd(res_out if res_out is not None else x, w, mean, rstd, dy, dx, dw, partials, dbias=db,
               dresidual_out=dres_out, dresidual=dres, rowstats=rowstats, is_rms_norm=is_rms,
               weight_offset=weight_offset, **({} if counters is None else dict(counters=counters)),
               **_tuning(backend, bwd_options, "bwd"))
    provider.synchronize()
    if counters is not None:
        assert not provider.to_numpy(counters).any(), "the fused partial sums left their counters non-zero"
    out = {"y": y, "dx": dx, "dweight": dw, "dbias": db, "residual_out": res_out, "dresidual": dres}
    return {k: provider.to_numpy(v) for k, v in out.items() if v is not None}


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_fwd_bwd_match_float64(provider, shape, dtype, is_rms, backend):
    M, N = shape
    w_dtype = "float32" if is_rms else dtype  # both weight dtypes, across the two norms
    x = provider.randn((M, N), dtype, scale=2.0, offset=0.5)
    w = provider.randn((N,), w_dtype)
    b = None if is_rms else provider.randn((N,), w_dtype)
    dy = provider.randn((M, N), dtype)
    offset = 1.0 if is_rms else 0.0
    got = _run(provider, backend, x, w, b, dy, eps=1e-5, is_rms=is_rms, weight_offset=offset)
    w64 = provider.to_numpy(w) + offset
    dy64 = provider.to_numpy(dy)
    y, dh, dw, db, rstd = _reference(provider.to_numpy(x), w64, None if b is None else provider.to_numpy(b), dy64,
                                     None, 1e-5, is_rms)
    assert_close("y", got["y"], y, dtype)
    if N == 1:  # exact dx: 0 (LayerNorm) or O(eps) (RMSNorm), all cancellation; measured against
        # the size of the terms that cancel, |w dy| rstd
        err = np.linalg.norm(got["dx"] - dh) / np.linalg.norm(w64 * dy64 * rstd)
        assert err <= bound_for(dtype), f"dx ({dtype}, N=1): error {err:.3e} of |w dy| rstd"
    else:
        assert_close("dx", got["dx"], dh, dtype)
    assert_close("dweight", got["dweight"], dw, dtype)
    if b is not None:
        assert_close("dbias", got["dbias"], db, dtype)


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("N", [2048, 777, 16384])
@pytest.mark.parametrize("dtype,res_dtype,res_out_dtype", [("bfloat16", "float32", "float32"),
                                                           ("bfloat16", "bfloat16", "float32"),
                                                           ("float16", "float16", "float16")])
def test_residual_stream_and_its_gradient(provider, dtype, res_dtype, res_out_dtype, N, backend):
    """h = x + residual rounded to residual_out's dtype and stored; the backward adds the stream's
    gradient and writes the residual's gradient in its own dtype."""
    M = 333
    x, res = provider.randn((M, N), dtype), provider.randn((M, N), res_dtype)
    w, b = provider.randn((N,), dtype), provider.randn((N,), dtype)
    dy, dres_out = provider.randn((M, N), dtype), provider.randn((M, N), res_out_dtype)
    got = _run(provider, backend, x, w, b, dy, residual=res, res_out_dtype=res_out_dtype, dres_out=dres_out)
    h = _round(provider, provider.to_numpy(x) + provider.to_numpy(res), res_out_dtype)
    y, dh, dw, db, _ = _reference(h, provider.to_numpy(w), provider.to_numpy(b), provider.to_numpy(dy),
                                  provider.to_numpy(dres_out), 1e-5, False)
    np.testing.assert_array_equal(got["residual_out"], h)
    assert_close("y", got["y"], y, dtype)
    assert_close("dx", got["dx"], dh, dtype)
    if "dresidual" in got:
        assert_close("dresidual", got["dresidual"], dh, res_dtype)
    assert_close("dweight", got["dweight"], dw, dtype)
    assert_close("dbias", got["dbias"], db, dtype)


# launch variants besides the defaults: CUDA vectors per thread, staged rows, blocks per SM (all that
# the entry points take); Triton tiles, warps, pipelining depth, weight held or reloaded (a few)
VARIANTS = [("cuda", dict(items=i, stages=s), dict(items=i, stages=s, blocks_per_sm=bps))
            for i in (1, 2) for s in (0, 2, 3) for bps in (None, 1)] + \
           [("triton", dict(rows=r, num_warps=nw), dict(rows=r, num_warps=nw, num_stages=s, reload_weight=rw))
            for r, nw, s, rw in ((1, 8, 3, False), (1, 16, 2, True), (2, 8, 1, True))] + \
           [("triton", {}, dict(counters=False)), ("triton", {}, dict(num_stages=4))]


@pytest.mark.parametrize("N", [4096, 6000, 24576])
@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("backend,fwd_options,bwd_options", VARIANTS, ids=str)
def test_launch_variants_bfloat16(provider, backend, fwd_options, bwd_options, is_rms, N):
    """Each variant (vectors per thread, rows staged in shared memory, tiles, warps, blocks per
    SM) against float64, at widths that fit one block, leave part of one unused, and need slabs."""
    M = 700
    x, dy = provider.randn((M, N), "bfloat16", scale=2.0, offset=0.5), provider.randn((M, N), "bfloat16")
    w = provider.randn((N,), "bfloat16")
    b = None if is_rms else provider.randn((N,), "bfloat16")
    got = _run(provider, backend, x, w, b, dy, is_rms=is_rms, fwd_options=fwd_options, bwd_options=bwd_options)
    y, dh, dw, db, _ = _reference(provider.to_numpy(x), provider.to_numpy(w), None if b is None else provider.to_numpy(b),
                                  provider.to_numpy(dy), None, 1e-5, is_rms)
    for name, ref in (("y", y), ("dx", dh), ("dweight", dw)) + ((("dbias", db),) if b is not None else ()):
        assert_close(f"{backend} {name}", got[name], ref, "bfloat16")


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_cuda_staged_kernels_after_a_wider_row(provider, is_rms):
    """The staged CUDA kernels ask for shared memory by row width: a narrower row after a wider
    one must not lower the kernel's limit under what the wider one needs again (it did: invalid
    argument at the third call)."""
    for N in (6000, 2048, 4096, 6000):
        M = 64
        x, dy = provider.randn((M, N), "bfloat16"), provider.randn((M, N), "bfloat16")
        w = provider.randn((N,), "bfloat16")
        b = None if is_rms else provider.randn((N,), "bfloat16")
        got = _run(provider, "cuda", x, w, b, dy, is_rms=is_rms)
        y, dh, dw, _, _ = _reference(provider.to_numpy(x), provider.to_numpy(w),
                                     None if b is None else provider.to_numpy(b), provider.to_numpy(dy), None, 1e-5,
                                     is_rms)
        for name, ref in (("y", y), ("dx", dh), ("dweight", dw)):
            assert_close(f"{name} N={N}", got[name], ref, "bfloat16")


@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_unaligned_rows_and_no_rows(provider, backend):
    """Rows at an odd stride (element-wise path) and an empty batch (zero weight gradients)."""
    M, N = 50, 1000
    big = provider.randn((M, N + 3), "bfloat16")
    x = big[:, 1:N + 1]
    w, b, dy = provider.randn((N,), "bfloat16"), provider.randn((N,), "bfloat16"), provider.randn((M, N), "bfloat16")
    got = _run(provider, backend, x, w, b, dy)
    y, dh, dw, db, _ = _reference(provider.to_numpy(x), provider.to_numpy(w), provider.to_numpy(b),
                                  provider.to_numpy(dy), None, 1e-5, False)
    for name, ref in (("y", y), ("dx", dh), ("dweight", dw), ("dbias", db)):
        assert_close(name, got[name], ref, "bfloat16")

    empty = provider.randn((0, N), "bfloat16")
    got = _run(provider, backend, empty, w, b, empty)
    assert np.array_equal(got["dweight"], np.zeros(N)) and np.array_equal(got["dbias"], np.zeros(N))


# Every row width 1..8192 and a sample to 65536 (issue: the backward's cooperative launch failed
# with "too many blocks" at N = 3000, a width that compiles to another kernel than its neighbours):
# options cycle with N (period 5, coprime to 16, so each meets aligned and unaligned widths).
SWEEP_OPTIONS = (dict(is_rms=False, bias=True), dict(is_rms=False, bias=False), dict(is_rms=True, bias=False),
                 dict(is_rms=False, bias=True, residual="float32", prenorm=True),
                 dict(is_rms=True, bias=False, residual="same", prenorm=False))
# one chunk per register block (the widths that round up to one power of 2 compile to their own
# kernels), at most 1024 widths each, so that the compilations spread over the test workers
SWEEP_CHUNKS = [range(1, 2)] + [range(start, min(start + 1024, 2 * half + 1)) for half in (2 ** k for k in range(13))
                                for start in range(half + 1, 2 * half + 1, 1024)] + \
               [sorted({8193, 8200, 9999, 12345, 16383, 16384, 16385, 20000, 24577, 32767, 32768, 40000, 50001,
                        65535, 65536})]


def _xhat_magnitude(h, rstd, is_rms):
    """What xhat's rounding error scales with: |h| rstd for RMSNorm; (|h| + |mean|) rstd for LayerNorm,
    whose centring h - mean in the input's precision loses digits where a row's values nearly agree
    (at N = 2 a row of two close values makes xhat, and the variance, ill-conditioned)."""
    if is_rms:
        return np.abs(h) * rstd
    return (np.abs(h) + np.abs(h.mean(-1, keepdims=True))) * rstd


def _y_terms(h, w, b, rstd, is_rms):
    """Magnitudes of the terms of y = xhat w + b, xhat at its conditioning's scale."""
    terms = _xhat_magnitude(h, rstd, is_rms) * np.abs(w)
    return terms if b is None else terms + np.abs(b)


def _dx_terms(h, w, dy, rstd, dres_out, provider, is_rms):
    """Magnitudes of the terms whose sum is the reference's dx: rstd (|w dy| + X mean(X |w dy|) +
    |c2|) with X = xhat's magnitude at its conditioning's scale, plus |dresidual_out|."""
    xmag = _xhat_magnitude(h, rstd, is_rms)
    wdy = np.abs(dy * w)
    terms = wdy + xmag * (xmag * wdy).mean(-1, keepdims=True)
    if not is_rms:
        terms = terms + wdy.mean(-1, keepdims=True)
    terms = terms * rstd
    return terms if dres_out is None else terms + np.abs(provider.to_numpy(dres_out))


def _check_sweep_case(provider, M, N, dtype, options):
    """One forward and backward against float64, all outputs (poisoned before) checked."""
    w_dtype = "float32" if options["is_rms"] else dtype
    x, dy = provider.randn((M, N), dtype, scale=2.0, offset=0.5), provider.randn((M, N), dtype)
    w = provider.randn((N,), w_dtype)
    b = provider.randn((N,), w_dtype) if options["bias"] else None
    residual = res_out_dtype = dres_out = None
    if options.get("residual"):
        res_out_dtype = dtype if options["residual"] == "same" else options["residual"]
        residual = provider.randn((M, N), res_out_dtype)
        dres_out = provider.randn((M, N), res_out_dtype) if options["prenorm"] else None
    got = _run(provider, "triton", x, w, b, dy, residual=residual, res_out_dtype=res_out_dtype, dres_out=dres_out,
               is_rms=options["is_rms"])
    h = provider.to_numpy(x)
    if residual is not None:  # x + residual, rounded once to residual_out's dtype
        h = h + provider.to_numpy(residual)
        if res_out_dtype == "float32":  # (round to nearest even: numpy's cast)
            np.testing.assert_array_equal(got["residual_out"], h.astype(np.float32), err_msg=f"residual_out [{M}, {N}] {dtype} {options}")
        else:
            assert_close(f"residual_out [{M}, {N}] {dtype} {options}", got["residual_out"], h, res_out_dtype)
        h = got["residual_out"]  # what the kernels normalise
    y, dh, dw, db, rstd = _reference(h, provider.to_numpy(w), None if b is None else provider.to_numpy(b),
                                     provider.to_numpy(dy), None if dres_out is None else provider.to_numpy(dres_out),
                                     1e-5, options["is_rms"])
    where = f"[{M}, {N}] {dtype} {options}"
    dy64 = provider.to_numpy(dy)
    try:
        assert_close(f"y {where}", got["y"], y, dtype)
    except AssertionError:  # LayerNorm rows whose values nearly agree (see _xhat_magnitude)
        assert_close_to_terms(f"y {where}", got["y"], y, _y_terms(h, provider.to_numpy(w).astype(np.float64),
                                                                   None if b is None else provider.to_numpy(b),
                                                                   rstd, options["is_rms"]), dtype)
    if N == 1 and dres_out is None:  # all cancellation (see test_fwd_bwd_match_float64)
        scale = np.linalg.norm(provider.to_numpy(w) * provider.to_numpy(dy) * rstd)
        assert np.linalg.norm(got["dx"] - dh) <= bound_for(dtype) * scale, f"dx {where}"
    else:
        try:
            assert_close(f"dx {where}", got["dx"], dh, dtype)
        except AssertionError:
            # at a few columns dx is a difference of nearly equal terms (LayerNorm at N = 2 cancels to
            # O(eps / var)), so its error is measured against their magnitudes, elementwise, with xhat
            # at its conditioning's scale
            assert_close_to_terms(f"dx {where}", got["dx"], dh, _dx_terms(h, provider.to_numpy(w), dy64, rstd, dres_out,
                                                                           provider, options["is_rms"]), dtype)
    # dweight and dbias sum one term per row: over the hundreds of thousands of rows of the
    # cooperative-grid cases they cancel, so DESIGN's measure for sums applies (error over the sum
    # of the terms' magnitudes where the relative norm error is past the bound)
    if N == 1 and not options["is_rms"]:  # xhat is exactly 0
        np.testing.assert_array_equal(got["dweight"], dw, err_msg=f"dweight {where}")
    else:
        xhat = (h - (0.0 if options["is_rms"] else h.mean(-1, keepdims=True))) * rstd
        assert_sum_close(f"dweight {where}", got["dweight"], dw, np.abs(dy64 * xhat).sum(0), dtype)
    if b is not None:
        assert_sum_close(f"dbias {where}", got["dbias"], db, np.abs(dy64).sum(0), dtype)


@pytest.mark.parametrize("widths", SWEEP_CHUNKS, ids=lambda r: f"N{min(r)}-{max(r)}")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_every_width_small_batch(provider, dtype, widths):
    """Each width with a few rows: every specialisation the widths compile to runs and is right."""
    for N in widths:
        _check_sweep_case(provider, 3 + N % 4, N, dtype, SWEEP_OPTIONS[N % len(SWEEP_OPTIONS)])


@pytest.mark.parametrize("log_block", range(14))
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_cooperative_grid_fits_at_every_specialisation(provider, dtype, log_block):
    """Per register block (powers of 2 up to 8192), an aligned and two unaligned widths under each
    option set, with enough rows that the backward's persistent grid fills the GPU (the fused,
    cooperative partial sums then ask for every resident program): no launch error, right results."""
    block = 2 ** log_block
    widths = sorted({block, max(1, block - 1), max(1, block - 3 * block // 8 - 1)} | ({3000} if block == 4096 else set()))
    for N in widths:
        rows = triton_norm._bwd_config(N, triton_norm.BWD_MAX_BLOCK)[0]
        M = 2 * triton_norm._num_sms() * triton_norm._max_programs_per_sm(
            triton_norm._bwd_config(N, triton_norm.BWD_MAX_BLOCK)[3]) * rows
        for options in SWEEP_OPTIONS:
            _check_sweep_case(provider, M, N, dtype, options)


class _Recorder:
    """Stands in for a DirectLauncher: records each launch's arguments, then launches."""

    def __init__(self, launcher):
        self.launcher, self.calls = launcher, []

    def __call__(self, grid, args, constexprs, options=()):
        self.calls.append((args, constexprs, options))
        self.launcher(grid, args, constexprs, options)

    def warmup(self, args, constexprs, options=()):
        return self.launcher.warmup(args, constexprs, options)

    def specialisation(self, args, constexprs, options=()):
        return self.launcher.specialisation(args, constexprs, options)

    @property
    def compiled(self):
        return self.launcher.compiled


def test_direct_launches_pick_the_kernel_triton_picks(provider, monkeypatch):
    """After the first launch of a specialisation the Triton launchers call the compiled kernel
    directly (DirectLauncher): across arguments that differ in what Triton specialises on (16-byte
    alignment of a pointer, ints that are 1 or multiples of 16, None), the kernel cached under each
    launch's key must be the one Triton's own path compiles for those arguments, and a repeated
    (direct) launch must write the same bits as the first; with the partial sums fused into the
    backward (grid barrier) and in their own kernel."""
    recorders = {name: _Recorder(getattr(triton_norm, name)) for name in ("_launch_fwd", "_launch_bwd", "_launch_sum")}
    for name, recorder in recorders.items():
        monkeypatch.setattr(triton_norm, name, recorder)
    for M, N, col_offset, pad in ((64, 4096, 0, 0), (64, 4096, 1, 3), (3, 17, 0, 0), (16, 1, 0, 0)):
        big = provider.randn((M, N + col_offset + pad), "bfloat16")
        x = big[:, col_offset:col_offset + N]
        w, b, dy = provider.randn((N,), "bfloat16"), provider.randn((N,), "bfloat16"), provider.randn((M, N), "bfloat16")
        y, dh, dw, db, _ = _reference(provider.to_numpy(x), provider.to_numpy(w), provider.to_numpy(b),
                                      provider.to_numpy(dy), None, 1e-5, False)
        for fused in (False, True):  # (the partial sums in their own kernel, or in the backward)
            first, second = (_run(provider, "triton", x, w, b, dy, bwd_options=dict(counters=fused)) for _ in range(2))
            for key in first:
                np.testing.assert_array_equal(first[key], second[key], err_msg=f"{key} [{M}, {N}] {col_offset} {fused}")
            for name, ref in (("y", y), ("dx", dh), ("dweight", dw), ("dbias", db)):
                if np.any(ref):
                    assert_close(f"{name} [{M}, {N}] fused={fused}", second[name], ref, "bfloat16")
                else:  # (N = 1: dx and dweight of a LayerNorm are exactly 0)
                    np.testing.assert_array_equal(second[name], ref, err_msg=f"{name} [{M}, {N}] fused={fused}")
    for name, recorder in recorders.items():
        assert recorder.calls, name
        for args, constexprs, options in recorder.calls:
            key, _ = recorder.launcher.specialisation(args, constexprs, options)
            assert recorder.launcher.compiled[key] is recorder.launcher.warmup(args, constexprs, options), name


def _gated_norm64(x64, z64, w64, dy64, b64, G, norm_before_gate, is_rms_norm):
    """Float64 mamba_ssm gated norm over groups of G columns, y = norm(x) * w (+ b), gated by silu(z)
    before or after the norm: (y, dx, dz as the launcher writes it, the gradient g at the affine
    output, xhat)."""
    M, N = x64.shape
    sig = 1 / (1 + np.exp(-z64))
    silu, dsilu = z64 * sig, sig * (1 + z64 * (1 - sig))
    h = (x64 if norm_before_gate else x64 * silu).reshape(M, N // G, G)
    centred = h if is_rms_norm else h - h.mean(-1, keepdims=True)
    rs = 1 / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-6)
    xhat_g = centred * rs
    xhat = xhat_g.reshape(M, N)
    g = dy64 * silu if norm_before_gate else dy64
    wdy = (g * w64).reshape(M, N // G, G)
    dh_g = wdy - xhat_g * (xhat_g * wdy).mean(-1, keepdims=True)
    dh = ((dh_g if is_rms_norm else dh_g - wdy.mean(-1, keepdims=True)) * rs).reshape(M, N)
    y = (xhat * w64 + (0.0 if b64 is None else b64)) * (silu if norm_before_gate else 1.0)
    dx = dh if norm_before_gate else dh * silu
    dz = dy64 * xhat * w64 * dsilu if norm_before_gate else dh * x64 * dsilu
    return y, dx, dz, g, xhat


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,group_size,norm_before_gate", [(4096, 1024, True), (4096, None, False),
                                                           (24, 8, False), (40000, 20000, True)])
def test_gated_rms_norm_matches_float64(provider, N, group_size, norm_before_gate, dtype):
    M = 129
    x, z, w, dy = (provider.randn((M, N), dtype), provider.randn((M, N), dtype), provider.randn((N,), dtype),
                   provider.randn((M, N), dtype))
    G = group_size or N
    y, rstd = provider.poisoned((M, N), dtype), provider.poisoned((M * (N // G),), "float32")
    triton_norm.norm_fwd(x, w, None, y, None, rstd, z=z, eps=1e-6, is_rms_norm=True, group_size=group_size,
                         norm_before_gate=norm_before_gate)
    dx, dz, dw = provider.poisoned((M, N), dtype), provider.poisoned((M, N), dtype), provider.poisoned((N,), dtype)
    partials, rowstats = _workspace(provider, "triton", M, N, dtype, False, group_size)
    counters = provider.zeros((triton_norm.COUNTERS,), "int32")  # as the op passes them (used without groups)
    triton_norm.norm_bwd(x, w, None, rstd, dy, dx, dw, partials, z=z, dz=dz, rowstats=rowstats, counters=counters,
                         is_rms_norm=True, group_size=group_size, norm_before_gate=norm_before_gate)
    provider.synchronize()
    assert not provider.to_numpy(counters).any()

    ref_y, ref_dx, ref_dz, g, xhat = _gated_norm64(*(provider.to_numpy(t) for t in (x, z, w, dy)), None, G,
                                                    norm_before_gate, is_rms_norm=True)
    assert_close("gated y", provider.to_numpy(y), ref_y, dtype)
    assert_close("gated dx", provider.to_numpy(dx), ref_dx, dtype)
    assert_close("gated dz", provider.to_numpy(dz), ref_dz, dtype)
    assert_close("gated dweight", provider.to_numpy(dw), (g * xhat).sum(0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,group_size,norm_before_gate", [(4096, 1024, True), (777, None, False), (24, 8, True),
                                                           (40000, 20000, False)])
def test_gated_layer_norm_with_bias_matches_float64(provider, N, group_size, norm_before_gate, dtype):
    """mamba_ssm's gated LayerNorm (is_rms_norm=False) with bias at the launcher. With the gate
    after the norm the launcher's dz leaves out bias * silu'(z) (ops.norm adds it) and is fp32, as
    the op passes it."""
    M = 129
    x, z, w, b, dy = (provider.randn((M, N), dtype, offset=0.5), provider.randn((M, N), dtype),
                      provider.randn((N,), dtype), provider.randn((N,), dtype), provider.randn((M, N), dtype))
    G = group_size or N
    y, mean, rstd = (provider.poisoned((M, N), dtype), provider.poisoned((M * (N // G),), "float32"),
                     provider.poisoned((M * (N // G),), "float32"))
    triton_norm.norm_fwd(x, w, b, y, mean, rstd, z=z, eps=1e-6, group_size=group_size,
                         norm_before_gate=norm_before_gate)
    dz_dtype = "float32" if norm_before_gate else dtype
    dx, dz = provider.poisoned((M, N), dtype), provider.poisoned((M, N), dz_dtype)
    dw, db = provider.poisoned((N,), dtype), provider.poisoned((N,), dtype)
    partials, rowstats = _workspace(provider, "triton", M, N, dtype, True, group_size)
    counters = provider.zeros((triton_norm.COUNTERS,), "int32")
    triton_norm.norm_bwd(x, w, mean, rstd, dy, dx, dw, partials, dbias=db, z=z, dz=dz, rowstats=rowstats,
                         counters=counters, group_size=group_size, norm_before_gate=norm_before_gate)
    provider.synchronize()
    assert not provider.to_numpy(counters).any()

    x64, z64, w64, b64, dy64 = (provider.to_numpy(t) for t in (x, z, w, b, dy))
    ref_y, ref_dx, ref_dz, g, xhat = _gated_norm64(x64, z64, w64, dy64, b64, G, norm_before_gate, is_rms_norm=False)
    assert_close("gated layer norm y", provider.to_numpy(y), ref_y, dtype)
    assert_close("gated layer norm dx", provider.to_numpy(dx), ref_dx, dtype)
    assert_close("gated layer norm dz", provider.to_numpy(dz), ref_dz, dtype)
    assert_close("gated layer norm dweight", provider.to_numpy(dw), (g * xhat).sum(0), dtype)
    assert_close("gated layer norm dbias", provider.to_numpy(db), g.sum(0), dtype)


@pytest.mark.parametrize("is_rms", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,out_dtype,w_dtype", [("bfloat16", "float32", "float16"),
                                                     ("float32", "bfloat16", "float16"),
                                                     ("float16", "float32", "bfloat16")])
@pytest.mark.parametrize("shape", [(1, 1), (257, 777), (1000, 4096), (5, 12345)], ids=str)
def test_triton_out_dtype_and_weight_dtype(provider, shape, dtype, out_dtype, w_dtype, is_rms):
    """y (and dy) in out_dtype, weight/bias (and their gradients) in a third dtype (flash-attn's
    out_dtype and weight dtypes; the CUDA kernels are routed around these)."""
    M, N = shape
    x, dy = provider.randn((M, N), dtype, scale=2.0, offset=0.5), provider.randn((M, N), out_dtype)
    w = provider.randn((N,), w_dtype)
    b = None if is_rms else provider.randn((N,), w_dtype)
    y, rstd = provider.poisoned((M, N), out_dtype), provider.poisoned((M,), "float32")
    mean = None if is_rms else provider.poisoned((M,), "float32")
    triton_norm.norm_fwd(x, w, b, y, mean, rstd, eps=1e-5, is_rms_norm=is_rms)
    dx, dw = provider.poisoned((M, N), dtype), provider.poisoned((N,), w_dtype)
    db = None if is_rms else provider.poisoned((N,), w_dtype)
    partials, rowstats = _workspace(provider, "triton", M, N, dtype, b is not None)
    counters = provider.zeros((triton_norm.COUNTERS,), "int32")
    triton_norm.norm_bwd(x, w, mean, rstd, dy, dx, dw, partials, dbias=db, rowstats=rowstats, counters=counters,
                         is_rms_norm=is_rms)
    provider.synchronize()
    assert not provider.to_numpy(counters).any()
    ref_y, dh, ref_dw, ref_db, rstd64 = _reference(provider.to_numpy(x), provider.to_numpy(w),
                                                   None if b is None else provider.to_numpy(b),
                                                   provider.to_numpy(dy), None, 1e-5, is_rms)
    loosest = "bfloat16" if "bfloat16" in (dtype, out_dtype, w_dtype) else "float16"
    assert_close("y", provider.to_numpy(y), ref_y, loosest)
    if N == 1:  # all cancellation: against the size of the terms (as test_fwd_bwd_match_float64)
        err = np.linalg.norm(provider.to_numpy(dx) - dh) / np.linalg.norm(
            provider.to_numpy(w) * provider.to_numpy(dy) * rstd64)
        assert err <= bound_for(loosest), f"dx (N=1): error {err:.3e} of |w dy| rstd"
    else:
        assert_close("dx", provider.to_numpy(dx), dh, loosest)
    assert_close("dweight", provider.to_numpy(dw), ref_dw, loosest)
    if b is not None:
        assert_close("dbias", provider.to_numpy(db), ref_db, loosest)


@pytest.mark.parametrize("case", ["rowscale+dropout+residual", "x1+dropout"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 7), (1000, 4096), (5, 12345), (64, 65536)], ids=str)
def test_triton_flash_attn_extras_match_float64(provider, shape, dtype, case):
    """flash-attn's extras on Triton: h = dropout(x * rowscale) + residual (LayerNorm, h in fp32)
    or dropout(x) + dropout(x1) (RMSNorm, h in x's dtype), the keep-masks stored and regenerated by
    the backward; dx, dx1, drowscale (partial sums per column slab) against float64."""
    M, N = shape
    p, seed, is_rms = 0.25, 1234, case.startswith("x1")
    x, dy = provider.randn((M, N), dtype), provider.randn((M, N), dtype)
    w, b = provider.randn((N,), "float32"), None if is_rms else provider.randn((N,), "float32")
    res = None if is_rms else provider.randn((M, N), dtype)
    x1 = provider.randn((M, N), dtype) if is_rms else None
    rs = None if is_rms else provider.from_numpy(np.random.rand(M) + 0.5, dtype)
    h_dtype = dtype if is_rms else "float32"
    y, h, rstd = provider.poisoned((M, N), dtype), provider.poisoned((M, N), h_dtype), provider.poisoned((M,))
    mean = None if is_rms else provider.poisoned((M,))
    mask = provider.from_numpy(np.full((M, N), 7), "uint8")  # (neither 0 nor 1: every element must be written)
    mask1 = provider.from_numpy(np.full((M, N), 7), "uint8") if is_rms else None
    triton_norm.norm_fwd(x, w, b, y, mean, rstd, residual=res, residual_out=h, x1=x1, rowscale=rs, dropout_p=p,
                         seed=seed, dropout_mask=mask, dropout_mask1=mask1, eps=1e-5, is_rms_norm=is_rms)
    dx, dw = provider.poisoned((M, N), dtype), provider.poisoned((N,))
    db = None if is_rms else provider.poisoned((N,))
    dres = None if is_rms else provider.poisoned((M, N), dtype)
    dx1 = provider.poisoned((M, N), dtype) if is_rms else None
    drs = None if is_rms else provider.poisoned(triton_norm.drowscale_shape(M, N))
    partials, rowstats = _workspace(provider, "triton", M, N, dtype, b is not None)
    counters = provider.zeros((triton_norm.COUNTERS,), "int32")
    triton_norm.norm_bwd(h, w, mean, rstd, dy, dx, dw, partials, dbias=db, dresidual=dres, rowstats=rowstats,
                         counters=counters, x=None if is_rms else x, dx1=dx1, rowscale=rs, drowscale=drs,
                         dropout_p=p, seed=seed, is_rms_norm=is_rms)
    provider.synchronize()
    assert not provider.to_numpy(counters).any()
    keep = provider.to_numpy(mask)
    assert set(np.unique(keep)) <= {0.0, 1.0}, "a mask element was not written"
    if M * N >= 4096:
        assert abs(1 - keep.mean() - p) < 0.02
    scale = keep / (1 - p)
    x64, dy64, w64 = provider.to_numpy(x), provider.to_numpy(dy), provider.to_numpy(w)
    if is_rms:
        keep1 = provider.to_numpy(mask1)
        assert set(np.unique(keep1)) <= {0.0, 1.0} and (M * N < 64 or not np.array_equal(keep, keep1))
        exact = x64 * scale + provider.to_numpy(x1) * keep1 / (1 - p)
    else:
        rs64 = provider.to_numpy(rs)[:, None]
        exact = x64 * rs64 * scale + provider.to_numpy(res)
    h64 = _round(provider, exact, h_dtype)
    assert_close("h", provider.to_numpy(h), exact, dtype)
    ref_y, dh, ref_dw, ref_db, rstd64 = _reference(h64, w64, None if b is None else provider.to_numpy(b), dy64, None,
                                                   1e-5, is_rms)
    assert_close("y", provider.to_numpy(y), ref_y, dtype)
    if N == 1:  # all cancellation (as test_fwd_bwd_match_float64): only check every element was written
        assert np.isfinite(provider.to_numpy(dx)).all()
    else:
        assert_close("dx", provider.to_numpy(dx), dh * scale * (1.0 if is_rms else rs64), dtype)
        if is_rms:
            assert_close("dx1", provider.to_numpy(dx1), dh * keep1 / (1 - p), dtype)
        else:
            assert_close("dresidual", provider.to_numpy(dres), dh, dtype)
            terms = dh * scale * x64  # a sum over the row: bounded against its terms' magnitudes
            assert_close_to_terms("drowscale", provider.to_numpy(drs).sum(-1), terms.sum(-1), np.abs(terms).sum(-1),
                                  dtype)
    assert_close("dweight", provider.to_numpy(dw), ref_dw, dtype)
    if b is not None:
        assert_close("dbias", provider.to_numpy(db), ref_db, dtype)


@pytest.mark.parametrize("case", ["layer_norm,residual fp32,bias1", "rms_norm,weight1 only"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 7), (300, 130), (1000, 4096), (20000, 2048), (5, 12345), (64, 65536)],
                         ids=str)
def test_triton_weight1_matches_float64(provider, shape, dtype, case):
    """flash-attn's second output y1 = xhat * w1 (+ b1) on Triton: LayerNorm with bias, bias1, an fp32
    residual stream and its gradient (prenorm), or RMSNorm with weight1 alone; every output poisoned,
    the counters of the fused partial sums passed as the op does (one slab: dweight, dbias, dweight1
    and dbias1 summed in the cooperative launch; 20000 rows fill the GPU; wider rows: the pre-pass
    and the sums kernel); against float64, the weights' gradients as sums over rows."""
    M, N = shape
    is_rms = case.startswith("rms")
    x, dy, dy1 = provider.randn((M, N), dtype, scale=2.0, offset=0.5), provider.randn((M, N), dtype), \
        provider.randn((M, N), dtype)
    w, w1 = provider.randn((N,), "float32"), provider.randn((N,), "float32")
    b, b1 = (None, None) if is_rms else (provider.randn((N,), "float32"), provider.randn((N,), "float32"))
    res = None if is_rms else provider.randn((M, N), dtype)
    dres_out = None if is_rms else provider.randn((M, N), "float32")
    y, y1, rstd = provider.poisoned((M, N), dtype), provider.poisoned((M, N), dtype), provider.poisoned((M,))
    mean = None if is_rms else provider.poisoned((M,))
    h = None if is_rms else provider.poisoned((M, N), "float32")
    triton_norm.norm_fwd(x, w, b, y, mean, rstd, residual=res, residual_out=h, weight1=w1, bias1=b1, y1=y1, eps=1e-5,
                         is_rms_norm=is_rms)
    dx, dw, dw1 = provider.poisoned((M, N), dtype), provider.poisoned((N,)), provider.poisoned((N,))
    db, db1 = (None, None) if is_rms else (provider.poisoned((N,)), provider.poisoned((N,)))
    dres = None if is_rms else provider.poisoned((M, N), dtype)
    partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, not is_rms, has_weight1=True, has_bias1=not is_rms)
    partials = provider.poisoned(partials, "float32")
    rowstats = None if rowstats is None else provider.poisoned(rowstats, "float32")
    counters = provider.zeros((triton_norm.COUNTERS,), "int32")
    triton_norm.norm_bwd(x if is_rms else h, w, mean, rstd, dy, dx, dw, partials, dbias=db, dresidual_out=dres_out,
                         dresidual=dres, rowstats=rowstats, counters=counters, weight1=w1, dy1=dy1, dweight1=dw1,
                         dbias1=db1, is_rms_norm=is_rms)
    provider.synchronize()
    assert not provider.to_numpy(counters).any(), "the fused partial sums left their counters non-zero"
    h64 = provider.to_numpy(x)
    if not is_rms:
        h64 = h64 + provider.to_numpy(res)
        np.testing.assert_array_equal(provider.to_numpy(h), h64.astype(np.float32))
        h64 = provider.to_numpy(h)
    w64, w164, dy64, dy164 = (provider.to_numpy(t) for t in (w, w1, dy, dy1))
    centred = h64 if is_rms else h64 - h64.mean(-1, keepdims=True)
    rstd64 = 1.0 / np.sqrt((centred * centred).mean(-1, keepdims=True) + 1e-5)
    xhat = centred * rstd64
    b64, b164 = (0.0, 0.0) if is_rms else (provider.to_numpy(b), provider.to_numpy(b1))
    wdy = dy64 * w64 + dy164 * w164
    c2 = 0.0 if is_rms else wdy.mean(-1, keepdims=True)
    dh = (wdy - xhat * (xhat * wdy).mean(-1, keepdims=True) - c2) * rstd64
    if dres_out is not None:
        dh = dh + provider.to_numpy(dres_out)
    where = f"[{M}, {N}] {dtype} {case}"
    assert_close(f"y {where}", provider.to_numpy(y), xhat * w64 + b64, dtype)
    assert_close(f"y1 {where}", provider.to_numpy(y1), xhat * w164 + b164, dtype)
    if N == 1 and is_rms:  # all cancellation (see test_fwd_bwd_match_float64): against the terms
        terms = rstd64 * (np.abs(wdy) + np.abs(xhat * (xhat * wdy).mean(-1, keepdims=True)))
        assert_close_to_terms(f"dx {where}", provider.to_numpy(dx), dh, terms, dtype)
    else:
        assert_close(f"dx {where}", provider.to_numpy(dx), dh, dtype)
    if dres is not None:
        assert_close(f"dresidual {where}", provider.to_numpy(dres), dh, dtype)
    for name, got, cot, is_weight in (("dweight", dw, dy64, True), ("dbias", db, dy64, False),
                                      ("dweight1", dw1, dy164, True), ("dbias1", db1, dy164, False)):
        if got is not None:
            terms = cot * xhat if is_weight else cot
            assert_sum_close(f"{name} {where}", provider.to_numpy(got), terms.sum(0), np.abs(terms).sum(0), dtype)


@pytest.mark.parametrize("backend", sorted(KERNELS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [7, 4096, 12345])
def test_residual_out_without_residual(provider, backend, dtype, N):
    """The stream stored with no residual in x's own dtype (the op's residual_out= where h is x):
    residual_out is x exactly; y, and dx with the stream's gradient, against float64."""
    M = 129
    x, dy, dres_out = (provider.randn((M, N), dtype) for _ in range(3))
    w, b = provider.randn((N,), dtype), provider.randn((N,), dtype)
    got = _run(provider, backend, x, w, b, dy, res_out_dtype=dtype, dres_out=dres_out)
    np.testing.assert_array_equal(got["residual_out"], provider.to_numpy(x))
    y, dh, dw, db, _ = _reference(provider.to_numpy(x), provider.to_numpy(w), provider.to_numpy(b),
                                  provider.to_numpy(dy), provider.to_numpy(dres_out), 1e-5, False)
    for name, ref in (("y", y), ("dx", dh), ("dweight", dw), ("dbias", db)):
        assert_close(f"{backend} {name} [{M}, {N}]", got[name], ref, dtype)


@pytest.mark.xdist_group("huge")
@pytest.mark.parametrize("backend", sorted(KERNELS))
def test_rows_past_2_31_elements(provider, backend):
    """x has 2^31 + 65536 elements: 64-bit row offsets in the forward and backward (tail rows)."""
    N = 65536
    M = 2**31 // N + 1
    x, w, dy = provider.randn((M, N), "bfloat16"), provider.randn((N,), "bfloat16"), provider.randn((M, N), "bfloat16")
    y, mean, rstd = provider.poisoned((M, N), "bfloat16"), provider.empty((M,), "float32"), provider.empty((M,), "float32")
    K = KERNELS[backend]
    K.norm_fwd(x, w, None, y, mean, rstd)
    dx, dw = provider.poisoned((M, N), "bfloat16"), provider.empty((N,), "bfloat16")
    partials, rowstats = _workspace(provider, backend, M, N, "bfloat16", False)
    K.norm_bwd(x, w, mean, rstd, dy, dx, dw, partials, rowstats=rowstats)
    provider.synchronize()
    ref_y, ref_dx, _, _, _ = _reference(provider.to_numpy(x[-2:]), provider.to_numpy(w), None,
                                     provider.to_numpy(dy[-2:]), None, 1e-5, False)
    assert_close("tail y", provider.to_numpy(y[-2:]), ref_y, "bfloat16")
    assert_close("tail dx", provider.to_numpy(dx[-2:]), ref_dx, "bfloat16")
    assert np.isfinite(provider.to_numpy(dw)).all()


def sanitize_smoke() -> None:
    """Each kernel path once on small shapes, checked: for ``compute-sanitizer --tool memcheck``."""
    from paddlenlp_fused.testing.providers import gpu_provider

    provider = gpu_provider()
    for backend, fwd_options, bwd_options in VARIANTS:  # no residual: the staged CUDA kernels too
        if backend == "cuda" or bwd_options in (dict(rows=1, num_warps=8, num_stages=3, reload_weight=False),
                                                dict(counters=False)):
            for M, N in ((5, 256), (3, 8200)):
                x, w, b, dy = (provider.randn((M, N), "bfloat16"), provider.randn((N,), "bfloat16"),
                               provider.randn((N,), "bfloat16"), provider.randn((M, N), "bfloat16"))
                got = _run(provider, backend, x, w, b, dy, fwd_options=fwd_options, bwd_options=bwd_options)
                ref = _reference(provider.to_numpy(x), provider.to_numpy(w), provider.to_numpy(b), provider.to_numpy(dy),
                                 None, 1e-5, False)
                for name, r in zip(("y", "dx", "dweight", "dbias"), ref[:4]):
                    assert_close(f"{backend} {name} [{M}, {N}] {bwd_options}", got[name], r, "bfloat16")
    print("ok launch variants [5, 256], [3, 8200]", flush=True)
    for backend in sorted(KERNELS):
        for M, N in ((5, 256), (3, 12345), (4, 7)):  # aligned, column slabs + chunks, element-wise
            x, res = provider.randn((M, N), "bfloat16"), provider.randn((M, N), "float32")
            w, b, dy = provider.randn((N,), "float32"), provider.randn((N,), "float32"), provider.randn((M, N), "bfloat16")
            dres_out = provider.randn((M, N), "float32")
            got = _run(provider, backend, x, w, b, dy, residual=res, res_out_dtype="float32", dres_out=dres_out)
            h = provider.to_numpy(x) + provider.to_numpy(res)
            ref = _reference(h, provider.to_numpy(w), provider.to_numpy(b), provider.to_numpy(dy),
                             provider.to_numpy(dres_out), 1e-5, False)
            for name, r in zip(("y", "dx", "dweight", "dbias"), ref[:4]):
                assert_close(f"{backend} {name} [{M}, {N}]", got[name], r, "bfloat16")
            print(f"ok {backend} layer_norm residual [{M}, {N}]", flush=True)
    provider.synchronize()
    test_gated_rms_norm_matches_float64(provider, 24, 8, False, "bfloat16")
    print("ok triton gated_rms_norm [129, 24]", flush=True)
    for shape in ((37, 7), (5, 12345)):  # one block with the fused sums; slabs, pre-pass and sums kernel
        test_triton_weight1_matches_float64(provider, shape, "bfloat16", "layer_norm,residual fp32,bias1")
        print(f"ok triton layer_norm weight1 {list(shape)}", flush=True)


if __name__ == "__main__":
    sanitize_smoke()
