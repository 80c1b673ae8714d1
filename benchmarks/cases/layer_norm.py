"""LayerNorm fwd+bwd, x [16384, 4096] bf16 with weight and bias (PERFORMANCE.md): our Triton and
CUDA kernels against torch ``F.layer_norm`` (eager autograd and torch.compile), Liger-Kernel and
flash-attn's Triton layer norm (and, for RMSNorm, mamba_ssm's Triton gated norm with no gate) in the
same process, on the same inputs; ``rms_norm`` runs the same code for RMSNorm. The peers and
torch.compile are optional rows: one that does not import or run is listed under ``skipped``.

Bytes, PERFORMANCE.md's floor: the forward reads x and writes y (2MN elements); fwd+bwd reads x
twice, dy once and writes y and dx (5MN elements, 10 bytes each in bf16). Weights, mean/rstd and
the backward's dweight partial sums (P x N fp32) are not counted. With ``run.py --sweeps``, also a
sweep of hidden sizes at constant M*N (TB/s per backend, ``sweep``).

Two timings of every row, both medians of ``bench_ms`` (L2 flushed before each call): ``*_ms`` calls
the Python launchers eagerly, as ``common.bench_ms`` does everywhere (the headline); ``*_graph_ms``
replays the same calls captured in a CUDA graph, which leaves out the host's launch cost. When the
host is slower than the GPU the eager figure measures the host: Triton's own launch path costs tens
of microseconds a kernel, so our Triton launchers call the compiled kernels directly after their
first launch (``DirectLauncher``), and the Triton backward sums its dweight/dbias partials in the
same launch (fwd+bwd: two launches, as the op runs them). Torch gets both timings too.
"""

from __future__ import annotations

import peers
from common import GiB, TBps, autograd_row, bench_ms, clear_grads, optional_row, peak_GiB

from paddlenlp_fused.kernels.cuda import norm as cuda_norm
from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.testing.numerics import rel_err

CANONICAL = (16384, 4096)
SWEEP_N = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
TARGETS = {False: {"fwdbwd_ms": 0.20, "speedup_vs_torch": 2.2}, True: {"fwdbwd_ms": 0.19, "speedup_vs_torch": 2.1}}
DTYPE = "bfloat16"


def _ours(provider, backend, x, w, b, dy, is_rms):
    """fwd, bwd, fwd+bwd and a fresh-allocation fwd+bwd of one backend (launcher defaults), with
    its outputs."""
    M, N = x.shape
    kernels = {"triton": triton_norm, "cuda": cuda_norm}[backend]

    def buffers():
        if backend == "cuda":
            partials, rowstats = cuda_norm.bwd_workspace_shapes(M, N, DTYPE, b is not None)
        else:
            partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, b is not None)
        return dict(y=provider.empty((M, N), DTYPE), mean=None if is_rms else provider.empty((M,), "float32"),
                    rstd=provider.empty((M,), "float32"), dx=provider.empty((M, N), DTYPE),
                    dw=provider.empty((N,), DTYPE), db=None if b is None else provider.empty((N,), DTYPE),
                    workspace=dict(partials=provider.empty(partials, "float32"),
                                   rowstats=None if rowstats is None else provider.empty(rowstats, "float32"),
                                   # (Triton: the backward sums dweight/dbias itself, as the op has it)
                                   **({} if backend == "cuda" else
                                      dict(counters=provider.zeros((triton_norm.COUNTERS,), "int32")))))

    eps = 1e-6 if is_rms else 1e-5

    def fwd(o):
        kernels.norm_fwd(x, w, b, o["y"], o["mean"], o["rstd"], eps=eps, is_rms_norm=is_rms)

    def bwd(o):
        kernels.norm_bwd(x, w, o["mean"], o["rstd"], dy, o["dx"], o["dw"], dbias=o["db"], is_rms_norm=is_rms,
                         **o["workspace"])

    out = buffers()

    def fresh():
        o = buffers()
        fwd(o)
        bwd(o)
        return o

    return (lambda: fwd(out)), (lambda: bwd(out)), (lambda: (fwd(out), bwd(out))), fresh, out


def _torch(x, w, b, dy, is_rms):
    """torch's fwd and fwd+bwd closures, the leaves whose gradients fwd+bwd leaves (x, w(, b)), and
    the composition ``norm(*leaves)`` (what torch.compile compiles)."""
    import torch
    import torch.nn.functional as F

    N = x.shape[1]
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w, b) if t is not None]

    def norm(t, wt, bt=None):
        return F.rms_norm(t, (N,), wt, 1e-6) if is_rms else F.layer_norm(t, (N,), wt, bt, 1e-5)

    def fwd():
        with torch.no_grad():
            return norm(*leaves)

    def fwdbwd():
        clear_grads(leaves)
        norm(*leaves).backward(dy)
        return [t.grad for t in leaves]

    return fwd, fwdbwd, leaves, norm


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


def graph_ms(provider, fn, rep_ms: int = 100):
    """``bench_ms`` of ``fn`` captured once in a CUDA graph and replayed (torch provider; None
    elsewhere or where capture fails)."""
    if getattr(provider, "name", None) != "torch":
        return None
    import torch

    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture (torch's recipe for autograd capture)
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize()
        return None
    return bench_ms(graph.replay, warmup_ms=10, rep_ms=rep_ms)


def _peer_rows(provider, leaves, norm, dy, is_rms, ref_y, ref_dx, skipped) -> list:
    """torch.compile of the composition and the peers, on torch's leaves (x, w(, b)), each an
    optional row (``skipped`` says why one is missing)."""
    import torch

    x, w = leaves[:2]
    b = leaves[2] if len(leaves) > 2 else None
    eps = 1e-6 if is_rms else 1e-5

    def check(y, grads):
        return {"rel_err": _err(y, ref_y), "rel_err_dx": _err(grads[0], ref_dx)}

    def row(impl, forward, grad_out=dy):
        return lambda: autograd_row(provider, impl, forward, leaves, grad_out, check)

    def liger():
        if is_rms:  # Liger's defaults: LLaMA casting, and dx written into the incoming gradient
            f = peers.load("liger_kernel.ops.rms_norm").LigerRMSNormFunction
            return lambda: f.apply(x, w, eps)
        f = peers.load("liger_kernel.ops.layer_norm").LigerLayerNormFunction
        return lambda: f.apply(x, w, b, eps)

    def flash_attn():
        ln = peers.load("flash_attn.ops.triton.layer_norm")
        return (lambda: ln.rms_norm_fn(x, w, None, eps=eps)) if is_rms else (lambda: ln.layer_norm_fn(x, w, b, eps=eps))

    def mamba_gated():
        f = peers.load("mamba_ssm.ops.triton.layernorm_gated").rmsnorm_fn
        return lambda: f(x, w, None, z=None, eps=eps)

    rows = []
    compiled = torch.compile(norm)
    optional_row(rows, skipped, "torch.compile", row("torch.compile", lambda: compiled(*leaves)))
    # Liger's RMSNorm writes dx into the gradient it is given: a private copy of dy
    liger_name = "Liger (dx written into dy)" if is_rms else "Liger"
    optional_row(rows, skipped, liger_name, lambda: row(liger_name, liger(), dy.clone() if is_rms else dy)())
    optional_row(rows, skipped, "flash-attn Triton", lambda: row("flash-attn Triton", flash_attn())())
    if is_rms:
        name = "mamba_ssm Triton gated RMSNorm (z=None)"
        optional_row(rows, skipped, name, lambda: row(name, mamba_gated())())
    return rows


def run_norm(provider, quick: bool, is_rms: bool, sweep: bool = False) -> dict:
    M, N = (2048, 4096) if quick else CANONICAL
    esize = 2
    fwd_bytes, fwdbwd_bytes = 2 * M * N * esize, 5 * M * N * esize
    x, w, b, dy = _inputs(provider, M, N, is_rms)
    ref_y, ref_dx = _reference(x, w, b, dy, is_rms)
    grad_bytes = (M * N + 2 * N) * esize
    rows = []
    for backend in ("triton", "cuda"):
        fwd, bwd, fwdbwd, fresh, out = _ours(provider, backend, x, w, b, dy, is_rms)
        fwdbwd()
        provider.synchronize()
        rows.append({"impl": f"paddlenlp_fused/{backend}", "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
                     "fwd_graph_ms": graph_ms(provider, fwd), "bwd_graph_ms": graph_ms(provider, bwd),
                     "fwdbwd_graph_ms": graph_ms(provider, fwdbwd),
                     "peak_GiB": peak_GiB(provider, fresh, exclude_bytes=grad_bytes),
                     "rel_err": _err(out["y"], ref_y), "rel_err_dx": _err(out["dx"], ref_dx)})
        del out
    t_fwd, t_fwdbwd, leaves, norm = _torch(x, w, b, dy, is_rms)
    t_fwdbwd()
    rows.append({"impl": "torch", "fwd_ms": bench_ms(t_fwd), "fwdbwd_ms": bench_ms(t_fwdbwd),
                 "fwd_graph_ms": graph_ms(provider, t_fwd), "fwdbwd_graph_ms": graph_ms(provider, t_fwdbwd),
                 "peak_GiB": peak_GiB(provider, t_fwdbwd, exclude_bytes=grad_bytes, leaves=leaves),
                 "rel_err": _err(t_fwd(), ref_y), "rel_err_dx": _err(t_fwdbwd()[0], ref_dx)})
    torch_row, skipped = rows[-1], {}
    rows += _peer_rows(provider, leaves, norm, dy, is_rms, ref_y, ref_dx, skipped)
    del leaves, ref_y, ref_dx, x, w, b, dy
    for row in rows:
        for key in ("fwdbwd_ms", "fwdbwd_graph_ms"):
            torch_ms = torch_row.get(key)
            if row.get(key) and torch_ms:
                suffix = "_graph" if "graph" in key else ""
                row[f"speedup_vs_torch{suffix}"] = torch_ms / row[key]
        for key, n_bytes in (("fwd_ms", fwd_bytes), ("fwdbwd_ms", fwdbwd_bytes), ("fwd_graph_ms", fwd_bytes),
                             ("fwdbwd_graph_ms", fwdbwd_bytes)):
            if row.get(key):
                row[key.replace("_ms", "_TBps")] = TBps(n_bytes, row[key])

    sizes = []
    total = M * N
    for n in SWEEP_N if sweep else ():
        m = max(1, total // n)
        x, w, b, dy = _inputs(provider, m, n, is_rms)
        entry = {"M": m, "N": n}
        impls = {name: _ours(provider, name, x, w, b, dy, is_rms) for name in ("triton", "cuda")}
        for name, (fwd, _, fwdbwd, _, _) in impls.items():
            fwdbwd()
            entry[f"{name}_fwdbwd_ms"] = bench_ms(fwdbwd, rep_ms=40)
            entry[f"{name}_fwd_graph_ms"] = graph_ms(provider, fwd, rep_ms=30)
            entry[f"{name}_fwdbwd_graph_ms"] = graph_ms(provider, fwdbwd, rep_ms=30)
        _, t_fwdbwd, leaves, _ = _torch(x, w, b, dy, is_rms)
        t_fwdbwd()
        entry["torch_fwdbwd_ms"] = bench_ms(t_fwdbwd, rep_ms=40)
        entry["torch_fwdbwd_graph_ms"] = graph_ms(provider, t_fwdbwd, rep_ms=30)
        for key in [k for k in entry if k.endswith("_ms") and entry[k]]:
            n_bytes = (2 if "_fwd_" in key else 5) * m * n * esize
            entry[key.replace("_ms", "_TBps")] = TBps(n_bytes, entry[key])
        sizes.append(entry)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()), flush=True)
        del x, w, b, dy, impls, leaves

    return {"shape": {"M": M, "N": N, "dtype": DTYPE, "weight": "weight" if is_rms else "weight+bias"},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes},
            "rows": rows, "skipped": skipped, "target": TARGETS[is_rms], "sweep": sizes,
            "timing": "*_ms: eager launcher calls (common.bench_ms); *_graph_ms: the same calls replayed as a "
                      "CUDA graph (no host launch cost); both medians with L2 flushed before each call",
            "peak_note": f"peak_GiB excludes dx, dweight(, dbias): {grad_bytes / GiB:.3f} GiB",
            "peer_versions": {top: peers.describe(top) for top in ("liger_kernel", "flash_attn", "mamba_ssm")}}


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    return run_norm(provider, quick, is_rms=False, sweep=sweep)
