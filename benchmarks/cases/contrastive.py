"""Contrastive (InfoNCE) loss fwd+bwd, q, k [65536, 512] fp32 in, scale 20 (PERFORMANCE.md): our
Triton kernels (bf16 operands, fp32 accumulation) against the torch composition
``F.cross_entropy(scale * q @ k.T, labels)`` (fp32, cuBLAS) in the same process; also at [16384, 512].

Inputs are CLIP-like: q unit rows, k = normalise(q + noise), labels ``arange``. FLOP: the forward is
one product of ``2 B^2 D``; forward and backward together are four (forward, the backward's
recompute of the scores, ``G @ k``, ``G.T @ q``): 17.6 TFLOP at 65536 x 512. ``rel_err`` is the
loss's relative error against float64 computed from the same fp32 inputs (chunked on the GPU);
``dq_rel_err``/``dk_rel_err`` compare the gradients with torch's fp32 ones. ``peak_GiB`` is the
peak memory of one fwd+bwd beyond inputs and their gradients; our peak is also measured at 16384,
65536 and 262144 rows (``peak_GiB_by_rows``), with ``workspace_GiB_by_rows`` the part beyond the
two bf16 operand copies of q and k: the backward's bf16 ``q.T`` (also B D elements) and the G chunk
(8192^2 bf16 = 0.125 GiB, whatever B).

Before the canonical rows, the case times a few tile configurations at 65536 (``sweep``) and
reports the rows with the fastest (listed under ``config``).
"""

from __future__ import annotations

import itertools

from common import GiB, TFLOPs, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton.contrastive import (DEFAULT_CONFIGS, GRAD_CHUNK, TileConfig,
                                                       contrastive_grad_accumulate, contrastive_lse_fwd,
                                                       grad_workspace_shape)
from paddlenlp_fused.testing.numerics import rel_err

SCALE = 20.0
D = 512
# the sweep of the first H200 run (results of which set DEFAULT_CONFIGS) covered 4 forward and 12
# backward configurations; this one re-times the GEMM stages and the chunk only
FWD_CONFIGS = [DEFAULT_CONFIGS["fwd"]]
GRAD_CONFIGS = [DEFAULT_CONFIGS["grad"]]
MATMUL_CONFIGS = [TileConfig(), TileConfig(num_stages=4)]
CHUNKS = [4096, 8192]


def _config_dict(cfg: TileConfig) -> dict:
    return {k: v for k, v in cfg._asdict().items() if v is not None}


class _Ours:
    """The op's computation on torch tensors (what ops/contrastive.py does with Paddle ones)."""

    def __init__(self, torch, fwd=None, grad=None, matmul=None, chunk=GRAD_CHUNK, symmetric=False):
        self.torch, self.symmetric = torch, symmetric
        self.fwd_cfg, self.grad_cfg, self.matmul_cfg, self.chunk = fwd, grad, matmul, chunk

    def forward(self, q, k):
        torch = self.torch
        B = q.shape[0]
        qo, ko = q.to(torch.bfloat16), k.to(torch.bfloat16)  # bf16 tensor-core operands
        labels = torch.arange(B, device=q.device)
        lse, pos = torch.empty(B, device=q.device), torch.empty(B, device=q.device)
        contrastive_lse_fwd(qo, ko, labels, lse, pos, SCALE, config=self.fwd_cfg)
        rows = lse - pos
        lse_c = lse
        if self.symmetric:
            lse_c, pos_c = torch.empty(B, device=q.device), torch.empty(B, device=q.device)
            contrastive_lse_fwd(ko, qo, labels, lse_c, pos_c, SCALE, config=self.fwd_cfg)
            rows = 0.5 * (rows + lse_c - pos_c)
        return rows.mean(), (qo, ko, labels, lse, lse_c)

    def backward(self, q, saved):
        torch = self.torch
        qo, ko, labels, lse, lse_c = saved
        B = q.shape[0]
        w = torch.full((B,), (0.5 if self.symmetric else 1.0) / B, device=q.device)
        work = torch.empty(grad_workspace_shape(B, B, self.chunk), dtype=torch.bfloat16, device=q.device)
        ua = torch.empty((B, q.shape[1]), device=q.device)
        ub = torch.empty((B, q.shape[1]), device=q.device)
        contrastive_grad_accumulate(qo, qo.t().contiguous(), ko, lse, lse_c, w, w, labels, labels, w[:1].abs(), work,
                                    ua, ub, SCALE,
                                    row_term=True, col_term=self.symmetric, grad_config=self.grad_cfg,
                                    matmul_config=self.matmul_cfg)
        dscale = torch.dot(q.flatten(), ua.flatten())
        return ua.mul_(SCALE), ub.mul_(SCALE), dscale

    def fwdbwd(self, q, k):
        loss, saved = self.forward(q, k)
        return (loss,) + self.backward(q, saved)


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


def _torch_rows(provider, torch, q, k, symmetric, loss64, label):
    F = torch.nn.functional
    labels = torch.arange(q.shape[0], device=q.device)
    qg, kg = q.detach().clone().requires_grad_(True), k.detach().clone().requires_grad_(True)

    def loss_of():
        logits = SCALE * qg @ kg.T
        loss = F.cross_entropy(logits, labels)
        return 0.5 * (loss + F.cross_entropy(logits.T, labels)) if symmetric else loss

    def fwd():
        with torch.no_grad():
            return loss_of()

    def fwdbwd():
        qg.grad = kg.grad = None
        loss_of().backward()
        return qg.grad, kg.grad

    loss = float(fwd())
    grads = fwdbwd()
    row = {"impl": f"torch{label}", "B": q.shape[0], "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
           "peak_GiB": peak_GiB(provider, fwdbwd, exclude_bytes=2 * q.numel() * 4),
           "rel_err": abs(loss - loss64) / abs(loss64)}
    return row, (grads[0].detach().clone(), grads[1].detach().clone())


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
    """Fastest forward config, and fastest (grad, matmul, chunk) for the backward, at this size."""
    quick_ms = lambda fn: bench_ms(fn, warmup_ms=10, rep_ms=60)
    fwd_times = []
    for cfg in FWD_CONFIGS:
        ours = _Ours(torch, fwd=cfg)
        fwd_times.append((quick_ms(lambda: ours.forward(q, k)), cfg))
    _, saved = _Ours(torch).forward(q, k)
    bwd_times = []
    for grad, matmul, chunk in itertools.product(GRAD_CONFIGS, MATMUL_CONFIGS, CHUNKS):
        ours = _Ours(torch, grad=grad, matmul=matmul, chunk=chunk)
        bwd_times.append((quick_ms(lambda: ours.backward(q, saved)), grad, matmul, chunk))
    best_fwd = min(fwd_times, key=lambda t: t[0])
    best_bwd = min(bwd_times, key=lambda t: t[0])
    table = {"fwd": [{"ms": ms, **_config_dict(c)} for ms, c in fwd_times],
             "bwd": [{"ms": ms, "grad": _config_dict(g), "matmul": _config_dict(m), "chunk": c}
                     for ms, g, m, c in bwd_times]}
    return best_fwd[1], best_bwd[1:], table


def _rows_at(provider, torch, q, k, ours, symmetric_ours, label):
    """Our row and torch's at this batch (and our symmetric row when given)."""
    loss64 = _loss64(torch, q, k, False)
    torch_row, torch_grads = _torch_rows(provider, torch, q, k, False, loss64, label)
    rows = [_our_row(provider, torch, ours, q, k, loss64, label, torch_grads), torch_row]
    del torch_grads
    if symmetric_ours is not None:
        rows.append(_our_row(provider, torch, symmetric_ours, q, k, _loss64(torch, q, k, True), "/symmetric"))
    return rows


def _peak_at(provider, torch, ours, B):
    q, k = _inputs(provider, torch, B)
    return peak_GiB(provider, lambda: ours.fwdbwd(q, k), exclude_bytes=2 * q.numel() * 4)


def run(provider, quick: bool = False) -> dict:
    import torch

    big, small = (4096, 1024) if quick else (65536, 16384)
    q, k = _inputs(provider, torch, big)
    if quick:
        fwd_cfg, (grad_cfg, matmul_cfg, chunk), sweep = DEFAULT_CONFIGS["fwd"], (
            DEFAULT_CONFIGS["grad"], DEFAULT_CONFIGS["matmul"], GRAD_CHUNK), {}
    else:
        fwd_cfg, (grad_cfg, matmul_cfg, chunk), sweep = _sweep(provider, torch, q, k)
    best = dict(fwd=fwd_cfg, grad=grad_cfg, matmul=matmul_cfg, chunk=chunk)
    ours = _Ours(torch, **best)
    # CLIP's symmetric loss at the canonical size (with its own default score-gradient tiles)
    symmetric = _Ours(torch, fwd=fwd_cfg, matmul=matmul_cfg, chunk=chunk, symmetric=True)
    rows = _rows_at(provider, torch, q, k, ours, symmetric, "")
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
        torch_row = next(r for r in rows if r["impl"].startswith("torch") and r["B"] == row["B"])
        if not row["impl"].endswith("/symmetric"):
            row["speedup_vs_torch"] = torch_row["fwdbwd_ms"] / row["fwdbwd_ms"]

    peaks = {B: _peak_at(provider, torch, ours, B) for B in ((1024, 4096) if quick else (16384, 65536, 262144))}
    rows[0]["peak_GiB_by_rows"] = peaks
    rows[0]["workspace_GiB_by_rows"] = {B: p - 2 * B * D * 2 / GiB for B, p in peaks.items()}
    return {"shape": {"B": big, "D": D, "dtype": "float32 in, bf16 operands", "scale": SCALE},
            "flops": flops, "config": {name: (_config_dict(v) if isinstance(v, TileConfig) else v)
                                       for name, v in best.items()},
            "sweep": sweep, "rows": rows,
            "target": {"fwdbwd_ms": 60.0, "peak_GiB": 1.0, "rel_err": 1e-3}}
