"""Contrastive (InfoNCE) loss fwd+bwd, q, k [65536, 512] fp32 in, scale 20 (PERFORMANCE.md): our
Triton kernels (bf16 tensor cores on the fp32 inputs, fp32 accumulation) against the torch
composition ``F.cross_entropy(scale * q @ k.T, labels)`` (fp32, cuBLAS; eager, and torch.compile)
and Inf-CL's Triton ``cal_flash_loss`` in the same process; also ours and eager torch at [16384, 512]. Our path is the op's (``precision="bf16"``): no bf16 copy of q or k; their chunks are
rounded into constant-size bf16 buffers (``stage_a``/``stage``, the "ab" mode) or, unstaged, their
fp32 tiles are rounded in registers.

Inputs are CLIP-like: q unit rows, k = normalise(q + noise), labels ``arange``. FLOP: the forward is
one product of ``2 B^2 D``; forward and backward together are four (forward, the backward's
recompute of the scores, ``G @ k``, ``G.T @ q``): 17.6 TFLOP at 65536 x 512. ``rel_err`` is the
loss's relative error against float64 computed from the same fp32 inputs (chunked on the GPU);
``dq_rel_err``/``dk_rel_err`` compare the gradients with torch's fp32 ones. ``peak_GiB`` is the
peak memory of one fwd+bwd beyond inputs and their gradients. Memory against the batch
(``peak_GiB_by_rows``): ours at 16384, 65536 and 262144 rows (what is left is the backward's
constant G chunk, 8192^2 bf16 = 0.125 GiB, the staging buffers and per-row vectors), torch's where
its [B, B] scores fit (``torch_peak_GiB_by_rows``; at 262144 they would take 256 GiB).

With ``run.py --sweeps``, before the canonical rows, the case times the staging modes with a few tile
configurations at 65536 (``sweep``) and reports the rows with the fastest (listed under ``config``);
without it, the defaults those sweeps picked.
"""

from __future__ import annotations

import peers
from common import GiB, TFLOPs, autograd_row, bench_ms, optional_row, peak_GiB

from paddlenlp_fused.kernels.triton.contrastive import (FWD_STAGE_ROWS, GRAD_CHUNK, STAGE_A_DEFAULT, STAGED_DEFAULT,
                                                       TileConfig, contrastive_grad_accumulate, contrastive_lse_fwd,
                                                       grad_workspace_shape, stage_shape)
from paddlenlp_fused.testing.numerics import rel_err

INF_CL = "Inf-CL cal_flash_loss (fp32)"
SCALE = 20.0
D = 512
PRECISION = "bf16"
# The sweep: staging modes (fp32 q and k rounded into bf16 chunk buffers: "ab" both, "b" k only, q's
# tiles then rounded in registers) with the tiles that were fastest for each in earlier H200 runs
# (round A of 2026-11-30 timed 16 forward and 40 backward configurations; DEFAULT_CONFIGS says which).
MODES = {"ab": dict(stage_a=True, staged=True), "b": dict(stage_a=False, staged=True)}
FWD_CONFIGS = {"ab": [TileConfig(flatten=True), TileConfig()], "b": [TileConfig(block_k=32)]}
_PRODUCTS = TileConfig(128, 256, 8, 3, block_k=64)
BWD_CONFIGS = {"ab": [(TileConfig(128, 64), _PRODUCTS), (TileConfig(128, 128), _PRODUCTS),
                      (TileConfig(128, 128), TileConfig(num_stages=4))],
               "b": [(TileConfig(128, 128, block_k=32), _PRODUCTS)]}


def _config_dict(cfg: TileConfig) -> dict:
    return {k: v for k, v in cfg._asdict().items() if v is not None}


class _Ours:
    """The op's computation on torch tensors (what ops/contrastive.py does with Paddle ones): fp32 q, k
    go to the launchers as they are, with ``precision="bf16"``."""

    def __init__(self, torch, fwd=None, grad=None, matmul=None, chunk=GRAD_CHUNK, symmetric=False,
                 staged=STAGED_DEFAULT, stage_a=STAGE_A_DEFAULT):
        self.torch, self.symmetric, self.staged, self.stage_a = torch, symmetric, staged, stage_a
        self.fwd_cfg, self.grad_cfg, self.matmul_cfg, self.chunk = fwd, grad, matmul, chunk

    def _stages(self, q, k, rows):
        """{"stage_a": for q's chunks, "stage": for k's} bf16 buffers, as the op allocates them."""
        make = lambda x, n: self.torch.empty(stage_shape(x.shape[0], x.shape[1], n), dtype=self.torch.bfloat16,
                                             device=x.device)
        return {**({"stage_a": make(q, rows[0])} if self.stage_a else {}),
                **({"stage": make(k, rows[1])} if self.staged else {})}

    def forward(self, q, k):
        torch = self.torch
        B = q.shape[0]
        labels = torch.arange(B, device=q.device)
        stages = self._stages(q, k, FWD_STAGE_ROWS)
        lse, pos = torch.empty(B, device=q.device), torch.empty(B, device=q.device)
        contrastive_lse_fwd(q, k, labels, lse, pos, SCALE, precision=PRECISION, config=self.fwd_cfg, **stages)
        rows = lse - pos
        lse_c = lse
        if self.symmetric:
            lse_c, pos_c = torch.empty(B, device=q.device), torch.empty(B, device=q.device)
            contrastive_lse_fwd(k, q, labels, lse_c, pos_c, SCALE, precision=PRECISION, config=self.fwd_cfg,
                                **stages)
            rows = 0.5 * (rows + lse_c - pos_c)
        return rows.mean(), (labels, lse, lse_c)

    def backward(self, q, k, saved):
        torch = self.torch
        labels, lse, lse_c = saved
        B = q.shape[0]
        w = torch.full((B,), (0.5 if self.symmetric else 1.0) / B, device=q.device)
        work = torch.empty(grad_workspace_shape(B, B, self.chunk), dtype=torch.bfloat16, device=q.device)
        ua = torch.empty((B, q.shape[1]), device=q.device)
        ub = torch.empty((B, q.shape[1]), device=q.device)
        contrastive_grad_accumulate(q, k, lse, lse_c, w, w, labels, labels, w[:1].abs(), work, ua, ub, SCALE,
                                    row_term=True, col_term=self.symmetric, precision=PRECISION,
                                    grad_config=self.grad_cfg, matmul_config=self.matmul_cfg,
                                    **self._stages(q, k, (self.chunk, self.chunk)))
        del work
        dscale = torch.dot(q.flatten(), ua.flatten())
        return ua.mul_(SCALE), ub.mul_(SCALE), dscale

    def fwdbwd(self, q, k):
        loss, saved = self.forward(q, k)
        return (loss,) + self.backward(q, k, saved)


def _inputs(provider, torch, B):
    q = torch.nn.functional.normalize(provider.randn((B, D)), dim=1)
    k = torch.nn.functional.normalize(q + provider.randn((B, D)), dim=1)
    return q, k


def _loss64(torch, q, k, symmetric, chunk=8192):
    """Float64 loss of the same fp32 inputs, chunked ([chunk, B] score blocks)."""
    q64, k64 = q.double(), k.double()

    def direction(a, b):
        total = 0.0
        for i in range(0, a.shape[0], chunk):
            scores = SCALE * a[i:i + chunk] @ b.T
            n = scores.shape[0]
            pos = scores[torch.arange(n, device=q.device), torch.arange(i, i + n, device=q.device)]
            total += float((torch.logsumexp(scores, 1) - pos).sum())
        return total / a.shape[0]

    loss = direction(q64, k64)
    return 0.5 * (loss + direction(k64, q64)) if symmetric else loss


def _composition(torch, q, k, symmetric):
    """``F.cross_entropy(scale * q @ k.T, arange)`` (and its transpose for the symmetric loss)."""
    F = torch.nn.functional
    labels = torch.arange(q.shape[0], device=q.device)
    logits = SCALE * q @ k.T
    loss = F.cross_entropy(logits, labels)
    return 0.5 * (loss + F.cross_entropy(logits.T, labels)) if symmetric else loss


def _torch_rows(provider, torch, q, k, symmetric, loss64, label):
    """torch's row, and its fp32 gradients (those of the row's last call), the reference of ours."""
    leaves = [q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)]

    def check(loss, grads):
        return {"rel_err": abs(float(loss) - loss64) / abs(loss64)}

    row = autograd_row(provider, f"torch{label}", lambda: _composition(torch, *leaves, symmetric), leaves, None,
                       check)
    row["B"] = q.shape[0]
    return row, (leaves[0].grad, leaves[1].grad)


def _peer_rows(provider, torch, q, k, loss64, torch_grads, skipped) -> list:
    """torch.compile of the composition and Inf-CL's ``cal_flash_loss`` (mean of its per-row losses),
    optional rows on the same inputs."""
    leaves = [q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)]

    def check(loss, grads):
        return {"rel_err": abs(float(loss) - loss64) / abs(loss64),
                "dq_rel_err": rel_err(grads[0].double().cpu().numpy(), torch_grads[0].double().cpu().numpy()),
                "dk_rel_err": rel_err(grads[1].double().cpu().numpy(), torch_grads[1].double().cpu().numpy())}

    def row(impl, forward):
        return lambda: dict(autograd_row(provider, impl, forward, leaves, None, check),
                            B=q.shape[0])

    def inf_cl():
        fn = peers.load("inf_cl.flash").cal_flash_loss
        labels = torch.arange(q.shape[0], device=q.device)
        return dict(row(INF_CL, lambda: fn(*leaves, labels, scale=SCALE).mean())(), peer=peers.describe("inf_cl"))

    rows = []
    compiled = torch.compile(lambda a, b: _composition(torch, a, b, False))
    optional_row(rows, skipped, "torch.compile", row("torch.compile", lambda: compiled(*leaves)))
    optional_row(rows, skipped, INF_CL, inf_cl)
    return rows


def _our_row(provider, torch, ours, q, k, loss64, label, torch_grads=None):
    loss, dq, dk, _ = ours.fwdbwd(q, k)
    provider.synchronize()
    row = {"impl": f"paddlenlp_fused/triton{label}", "B": q.shape[0],
           "fwd_ms": bench_ms(lambda: ours.forward(q, k)), "fwdbwd_ms": bench_ms(lambda: ours.fwdbwd(q, k)),
           "peak_GiB": peak_GiB(provider, lambda: ours.fwdbwd(q, k), exclude_bytes=2 * q.numel() * 4),
           "rel_err": abs(float(loss) - loss64) / abs(loss64)}
    if torch_grads is not None:
        row["dq_rel_err"] = rel_err(dq.double().cpu().numpy(), torch_grads[0].double().cpu().numpy())
        row["dk_rel_err"] = rel_err(dk.double().cpu().numpy(), torch_grads[1].double().cpu().numpy())
    return row


def _sweep(provider, torch, q, k):
    """The staging mode whose fastest forward and backward sum least, with those configs, at this size."""
    quick_ms = lambda fn: bench_ms(fn, warmup_ms=10, rep_ms=60)
    _, saved = _Ours(torch).forward(q, k)
    table, best = {"fwd": [], "bwd": []}, None
    for mode, staging in MODES.items():
        fwd = [(quick_ms(lambda: _Ours(torch, fwd=c, **staging).forward(q, k)), c) for c in FWD_CONFIGS[mode]]
        bwd = [(quick_ms(lambda: _Ours(torch, grad=g, matmul=m, **staging).backward(q, k, saved)), g, m)
               for g, m in BWD_CONFIGS[mode]]
        table["fwd"] += [{"ms": ms, "mode": mode, **_config_dict(c)} for ms, c in fwd]
        table["bwd"] += [{"ms": ms, "mode": mode, "grad": _config_dict(g), "matmul": _config_dict(m)}
                         for ms, g, m in bwd]
        f, b = min(fwd, key=lambda t: t[0]), min(bwd, key=lambda t: t[0])
        if best is None or f[0] + b[0] < best[0]:
            best = (f[0] + b[0], dict(fwd=f[1], grad=b[1], matmul=b[2], **staging), mode)
    table["mode"] = best[2]
    return best[1], table


def _rows_at(provider, torch, q, k, ours, symmetric_ours, label, skipped=None):
    """Our row and torch's at this batch (with ``skipped``, also the optional rows; and our symmetric
    row when given)."""
    loss64 = _loss64(torch, q, k, False)
    torch_row, torch_grads = _torch_rows(provider, torch, q, k, False, loss64, label)
    rows = [_our_row(provider, torch, ours, q, k, loss64, label, torch_grads), torch_row]
    if skipped is not None:
        rows += _peer_rows(provider, torch, q, k, loss64, torch_grads, skipped)
    del torch_grads
    if symmetric_ours is not None:
        rows.append(_our_row(provider, torch, symmetric_ours, q, k, _loss64(torch, q, k, True), "/symmetric"))
    return rows


def _peak_at(provider, torch, ours, B):
    q, k = _inputs(provider, torch, B)
    return peak_GiB(provider, lambda: ours.fwdbwd(q, k), exclude_bytes=2 * q.numel() * 4)


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    import torch

    big, small = (4096, 1024) if quick else (65536, 16384)
    q, k = _inputs(provider, torch, big)
    if sweep and not quick:
        best, staging_sweep = _sweep(provider, torch, q, k)
    else:  # the defaults (DEFAULT_CONFIGS, picked by earlier sweeps)
        best, staging_sweep = dict(fwd=None, grad=None, matmul=None), {}
    ours = _Ours(torch, **best)
    # CLIP's symmetric loss at the canonical size (with its own default score-gradient tiles)
    symmetric = _Ours(torch, **{**best, "grad": None}, symmetric=True)
    skipped = {}
    rows = _rows_at(provider, torch, q, k, ours, symmetric, "", skipped)
    del q, k
    torch.cuda.empty_cache()
    rows += _rows_at(provider, torch, *_inputs(provider, torch, small), ours, None, f"@{small}")
    torch.cuda.empty_cache()

    flops = {"fwd": 2 * big * big * D, "fwdbwd": 8 * big * big * D}
    for row in rows:
        factor = (row["B"] / big) ** 2
        sym = row["impl"].endswith("/symmetric")  # two forward products, five in all
        row["fwd_TFLOPs"] = TFLOPs(flops["fwd"] * factor * (2 if sym else 1), row["fwd_ms"])
        row["fwdbwd_TFLOPs"] = TFLOPs((flops["fwdbwd"] + (flops["fwd"] if sym else 0)) * factor, row["fwdbwd_ms"])
    for row in rows:  # against torch's composition at the same batch
        torch_row = next(r for r in rows if r["impl"].split("@")[0] == "torch" and r["B"] == row["B"])
        if not row["impl"].endswith("/symmetric"):
            row["speedup_vs_torch"] = torch_row["fwdbwd_ms"] / row["fwdbwd_ms"]

    sizes = (1024, 4096, 16384) if quick else (16384, 65536, 262144)
    rows[0]["peak_GiB_by_rows"] = {B: _peak_at(provider, torch, ours, B) for B in sizes}
    # torch's peak from its rows above where its [B, B] fp32 scores (and their gradient) fit
    rows[0]["torch_peak_GiB_by_rows"] = {B: next((r["peak_GiB"] for r in rows if r["impl"].split("@")[0] == "torch"
                                                  and r["B"] == B), f"does not fit ({B * B * 4 / GiB:.0f} GiB "
                                                 "of fp32 scores)") for B in sizes}
    return {"shape": {"B": big, "D": D, "dtype": "float32 in, rounded to bf16 in the kernels", "scale": SCALE},
            "flops": flops, "config": {**{name: (_config_dict(v) if isinstance(v, TileConfig) else v)
                                          for name, v in best.items()}, "chunk": GRAD_CHUNK,
                                       "fwd_stage_rows": FWD_STAGE_ROWS},
            "sweep": staging_sweep, "rows": rows, "skipped": skipped,
            "target": {"fwdbwd_ms": 60.0, "peak_GiB": 1.0, "rel_err": 1e-3}}
