"""LayerNorm fwd+bwd, x [16384, 4096] bf16 with weight and bias (PERFORMANCE.md): our Triton and
CUDA kernels against torch ``F.layer_norm`` (eager autograd) in the same process; ``rms_norm``
runs the same code for RMSNorm.

Bytes, PERFORMANCE.md's floor: the forward reads x and writes y (2MN elements); fwd+bwd reads x
twice, dy once and writes y and dx (5MN elements, 10 bytes each in bf16). Weights, mean/rstd and
the backward's dweight partial sums (P x N fp32) are not counted. Also: a sweep of hidden sizes at
constant M*N (TB/s per backend, ``sweep``) and a tuning grid of the Triton kernels' tiles, warps
and persistent-grid size (``triton_tuning``; the rows above use the launchers' defaults).
"""

from __future__ import annotations

from common import GiB, TBps, bench_ms, peak_GiB

from paddlenlp_fused.kernels.cuda import norm as cuda_norm
from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.testing.numerics import rel_err

CANONICAL = (16384, 4096)
SWEEP_N = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
TARGETS = {False: {"fwdbwd_ms": 0.20, "speedup_vs_torch": 2.2}, True: {"fwdbwd_ms": 0.19, "speedup_vs_torch": 2.1}}
DTYPE = "bfloat16"


def _ours(provider, backend, x, w, b, dy, is_rms, fwd_config=None, bwd_config=None):
    """fwd, bwd, fwd+bwd and a fresh-allocation fwd+bwd of one backend, with its outputs;
    ``fwd_config`` / ``bwd_config``: Triton launcher overrides (tuning)."""
    M, N = x.shape
    kernels = {"triton": triton_norm, "cuda": cuda_norm}[backend]
    fwd_config, bwd_config = fwd_config or {}, bwd_config or {}

    def buffers():
        if backend == "cuda":
            partials, rowstats = cuda_norm.bwd_workspace_shapes(M, N, DTYPE, b is not None)
        else:
            partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, b is not None, **bwd_config)
        return dict(y=provider.empty((M, N), DTYPE), mean=None if is_rms else provider.empty((M,), "float32"),
                    rstd=provider.empty((M,), "float32"), dx=provider.empty((M, N), DTYPE),
                    dw=provider.empty((N,), DTYPE), db=None if b is None else provider.empty((N,), DTYPE),
                    partials=provider.empty(partials, "float32"),
                    rowstats=None if rowstats is None else provider.empty(rowstats, "float32"))

    eps = 1e-6 if is_rms else 1e-5

    def fwd(o):
        kernels.norm_fwd(x, w, b, o["y"], o["mean"], o["rstd"], eps=eps, is_rms_norm=is_rms, **fwd_config)

    def bwd(o):
        kernels.norm_bwd(x, w, o["mean"], o["rstd"], dy, o["dx"], o["dw"], o["partials"], dbias=o["db"],
                         rowstats=o["rowstats"], is_rms_norm=is_rms, **bwd_config)

    out = buffers()

    def fresh():
        o = buffers()
        fwd(o)
        bwd(o)
        return o

    return (lambda: fwd(out)), (lambda: bwd(out)), (lambda: (fwd(out), bwd(out))), fresh, out


def _torch(x, w, b, dy, is_rms):
    import torch
    import torch.nn.functional as F

    N = x.shape[1]
    xg, wg = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    bg = None if b is None else b.detach().clone().requires_grad_(True)

    def norm(t):
        return F.rms_norm(t, (N,), wg, 1e-6) if is_rms else F.layer_norm(t, (N,), wg, bg, 1e-5)

    def fwd():
        with torch.no_grad():
            return norm(xg)

    def fwdbwd():
        xg.grad = wg.grad = None
        if bg is not None:
            bg.grad = None
        norm(xg).backward(dy)
        return xg.grad, wg.grad, bg.grad if bg is not None else None

    return fwd, fwdbwd, xg


def _reference(x, w, b, dy, is_rms):
    """float64 y and dx (torch autograd on upcast inputs)."""
    import torch
    import torch.nn.functional as F

    N = x.shape[1]
    x64 = x.double().requires_grad_(True)
    y = F.rms_norm(x64, (N,), w.double(), 1e-6) if is_rms else F.layer_norm(x64, (N,), w.double(), b.double(), 1e-5)
    (dx,) = torch.autograd.grad(y, x64, dy.double())
    return y.detach(), dx


def _inputs(provider, M, N, is_rms):
    x, dy = provider.randn((M, N), DTYPE), provider.randn((M, N), DTYPE)
    w = provider.randn((N,), DTYPE, scale=0.1, offset=1.0)
    b = None if is_rms else provider.randn((N,), DTYPE, scale=0.1)
    return x, w, b, dy


def _err(out, ref) -> float:
    return rel_err(out.double().cpu().numpy(), ref.cpu().numpy())


def _tune_triton(provider, x, w, b, dy, is_rms) -> list:
    """Triton forward and backward alone under launcher overrides: at the canonical shape the
    tile rows / warps and the backward's programs per SM (None: fitted to the compiled kernel);
    at N = 16384 the register-tile cap of each pass."""
    results = []

    def record(pass_, shape, config, fn):
        results.append({"pass": pass_, "shape": list(shape), **config, "ms": bench_ms(fn, warmup_ms=10, rep_ms=60)})

    for rows, warps in ((1, 8), (2, 8), (2, 16), (4, 8)):
        config = {"rows": rows, "num_warps": warps}
        fwd, _, _, _, _ = _ours(provider, "triton", x, w, b, dy, is_rms, fwd_config=config)
        record("fwd", x.shape, config, fwd)
    for rows, warps in ((1, 4), (1, 8), (1, 16)):
        for per_sm in (None, 2, 3, 4):
            config = {"rows": rows, "num_warps": warps, "programs_per_sm": per_sm}
            _, bwd, _, _, _ = _ours(provider, "triton", x, w, b, dy, is_rms, bwd_config=config)
            record("bwd", x.shape, config, bwd)
    wide = _inputs(provider, x.shape[0] * x.shape[1] // 16384, 16384, is_rms)
    for max_block, warps in ((8192, 16), (16384, 16)):
        config = {"max_block": max_block, "num_warps": warps}
        fwd, _, _, _, _ = _ours(provider, "triton", *wide, is_rms, fwd_config=config)
        record("fwd", wide[0].shape, config, fwd)
    for max_block in (4096, 8192):
        config = {"max_block": max_block}
        _, bwd, _, _, _ = _ours(provider, "triton", *wide, is_rms, bwd_config=config)
        record("bwd", wide[0].shape, config, bwd)
    return results


def run_norm(provider, quick: bool, is_rms: bool) -> dict:
    M, N = (2048, 4096) if quick else CANONICAL
    esize = 2
    fwd_bytes, fwdbwd_bytes = 2 * M * N * esize, 5 * M * N * esize
    x, w, b, dy = _inputs(provider, M, N, is_rms)
    ref_y, ref_dx = _reference(x, w, b, dy, is_rms)
    grad_bytes = (M * N + 2 * N) * esize
    rows = []
    for backend in ("triton", "cuda"):
        fwd, _, fwdbwd, fresh, out = _ours(provider, backend, x, w, b, dy, is_rms)
        fwdbwd()
        provider.synchronize()
        rows.append({"impl": f"paddlenlp_fused/{backend}", "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
                     "peak_GiB": peak_GiB(provider, fresh, exclude_bytes=grad_bytes),
                     "rel_err": _err(out["y"], ref_y), "rel_err_dx": _err(out["dx"], ref_dx)})
        del out
    t_fwd, t_fwdbwd, xg = _torch(x, w, b, dy, is_rms)
    t_fwdbwd()
    rows.append({"impl": "torch", "fwd_ms": bench_ms(t_fwd), "fwdbwd_ms": bench_ms(t_fwdbwd),
                 "peak_GiB": peak_GiB(provider, t_fwdbwd, exclude_bytes=grad_bytes),
                 "rel_err": _err(t_fwd(), ref_y), "rel_err_dx": _err(t_fwdbwd()[0], ref_dx)})
    del xg, ref_y, ref_dx
    torch_ms = rows[-1]["fwdbwd_ms"]
    for row in rows:
        row["fwd_TBps"] = TBps(fwd_bytes, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes, row["fwdbwd_ms"])
        row["speedup_vs_torch"] = torch_ms / row["fwdbwd_ms"]

    tuning = _tune_triton(provider, x, w, b, dy, is_rms)
    _, cuda_bwd, _, _, out = _ours(provider, "cuda", x, w, b, dy, is_rms)
    cuda_bwd_ms = {"num_partials": out["partials"].shape[1], "bwd_ms": bench_ms(cuda_bwd)}
    del x, w, b, dy, out

    sweep = []
    total = M * N
    for n in SWEEP_N:
        m = max(1, total // n)
        x, w, b, dy = _inputs(provider, m, n, is_rms)
        entry = {"M": m, "N": n}
        impls = {name: _ours(provider, name, x, w, b, dy, is_rms) for name in ("triton", "cuda")}
        for name, (fwd, _, fwdbwd, _, _) in impls.items():
            fwdbwd()
            entry[f"{name}_fwd_ms"], entry[f"{name}_fwdbwd_ms"] = bench_ms(fwd, rep_ms=100), bench_ms(fwdbwd, rep_ms=100)
        t_fwd, t_fwdbwd, xg = _torch(x, w, b, dy, is_rms)
        t_fwdbwd()
        entry["torch_fwd_ms"], entry["torch_fwdbwd_ms"] = bench_ms(t_fwd, rep_ms=100), bench_ms(t_fwdbwd, rep_ms=100)
        for name in ("triton", "cuda", "torch"):
            entry[f"{name}_fwd_TBps"] = TBps(2 * m * n * esize, entry[f"{name}_fwd_ms"])
            entry[f"{name}_fwdbwd_TBps"] = TBps(5 * m * n * esize, entry[f"{name}_fwdbwd_ms"])
        sweep.append(entry)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()), flush=True)
        del x, w, b, dy, impls, xg

    return {"shape": {"M": M, "N": N, "dtype": DTYPE, "weight": "weight" if is_rms else "weight+bias"},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes,
                      "floor_fwdbwd_ms_at_4.25TBps": fwdbwd_bytes / 4.25e12 * 1e3},
            "rows": rows, "target": TARGETS[is_rms], "sweep": sweep,
            "triton_tuning": tuning, "cuda_bwd": cuda_bwd_ms,
            "peak_note": f"peak_GiB excludes dx, dweight(, dbias): {grad_bytes / GiB:.3f} GiB"}


def run(provider, quick: bool = False) -> dict:
    return run_norm(provider, quick, is_rms=False)
