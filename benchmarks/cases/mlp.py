"""MLP fwd+bwd (PERFORMANCE.md, issue #17), bf16, in one process beside torch:
    gelu    x [16384, 4096] -> 16384 (gelu tanh, biases) -> 4096
    swiglu  x [16384, 4096] -> 2 x 14336 (silu(gate) * up, no biases) -> 4096 (LLaMA-8B)

Ours run, on the launchers, the sequence ``fused_mlp_func`` runs on the CUDA backend
(ops/fused_dense.py), for each choice its policy block reads from
``kernels/cuda/fused_dense_tuning.py``:
    fwd   pre = x @ W1 + b1 and out1 = gelu(pre) in GELU_AUX_BIAS, or GEMM + bias epilogue then the
          Triton activation pass (FWD_GELU_EPILOGUE); out = out1 @ W2 + b2
    bwd   dW2 (+ db2: BGRADA, or a Triton column-sum pass) = out1^T @ dy; dact = dy @ W2^T (plain);
          dpre = gelu'(pre) * dact, with db1 summed in that Triton pass unless BGRAD_EPILOGUE;
          dW1 (+ db1 by BGRADA) = x^T @ dpre; dx = dpre @ W1^T
    checkpoint_lvl 1 recomputes out1 in backward (GEMM1 again when its epilogue applied gelu), 2 also pre.

Measured per shape: every GEMM of the sequence at cuBLASLt heuristic indices 0..7 (``per_gemm``);
the floor (the six plain GEMMs at their best index, timed back to back); rows for each plan
(FWD_GELU_EPILOGUE x BGRAD_EPILOGUE at the best index per GEMM) at checkpoint levels 0/1/2 with the
activation memory each keeps for backward (``saved_GiB``: allocated after the forward, less inputs
and output; torch's the same way), the committed tuning (what the op runs now), index 0 everywhere,
Triton (gelu), torch eager and torch.compile of the composition. Every row's output and gradients
are checked against an fp32 reference, and each plan's levels 1 and 2 bit for bit against level 0
(``checks``). fwd+bwd times are medians of ROUNDS rounds over all rows. ``tuning`` holds the values
to copy into fused_dense_tuning.py.
FLOPs: 6 GEMMs of 2*M*D*H' each (H' = the hidden width of each GEMM).
"""

from __future__ import annotations

import itertools

from common import GiB, TFLOPs, bench_ms, optional_row, peak_GiB

from paddlenlp_fused.kernels.cuda import fused_dense as lt
from paddlenlp_fused.kernels.cuda import fused_dense_tuning as tuning
from paddlenlp_fused.kernels.triton import fused_dense as tr
from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd

INDICES = range(8)  # the cuBLASLt heuristic indices swept per GEMM
ROUNDS = 3  # fwd+bwd timings per row, round-robin
PLAN_TIE = 0.01  # level-0 times this close count as equal when choosing the plan to commit
GRAD_NAMES = ("dx", "dweight1", "dbias1", "dweight2", "dbias2")


class Problem:
    """Inputs, the output gradient and the fp32 reference of one MLP shape."""

    def __init__(self, provider, torch, F, M, D, H, gated, bias):
        self.provider, self.torch, self.F = provider, torch, F
        self.M, self.D, self.H, self.gated, self.bias = M, D, H, gated, bias
        self.W = 2 * H if gated else H  # GEMM1's width
        r = provider.randn
        self.x = r((M, D), "bfloat16")
        self.w1, self.w2 = r((D, self.W), "bfloat16", scale=D**-0.5), r((H, D), "bfloat16", scale=H**-0.5)
        self.b1 = r((self.W,), "bfloat16", scale=0.1) if bias else None
        self.b2 = r((D,), "bfloat16", scale=0.1) if bias else None
        self.dy = r((M, D), "bfloat16")
        self.ws = provider.empty((lt.workspace_bytes(0),), "uint8")
        self.grad_bytes = 2 * (M * D + D * self.W + H * D + (self.W + D if bias else 0))
        self.ref = self._reference()

    def act_torch(self, h):
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.F.silu(gate) * up
        return self.F.gelu(h, approximate="tanh")

    def torch_leaves(self):
        """Leaves in torch's [out, in] weight layout."""
        ts = [self.x, self.w1.t().contiguous(), self.b1, self.w2.t().contiguous(), self.b2]
        return [t.detach().clone().requires_grad_(True) if t is not None else None for t in ts]

    def torch_forward(self, leaves):
        x, w1, b1, w2, b2 = leaves
        return self.F.linear(self.act_torch(self.F.linear(x, w1, b1)), w2, b2)

    def _reference(self):
        leaves = [t.detach().float().requires_grad_(True) if t is not None else None for t in self.torch_leaves()]
        out = self.torch_forward(leaves)
        out.backward(self.dy.float())
        x, w1, b1, w2, b2 = leaves
        ref = [out.detach(), x.grad, w1.grad.t(), b1.grad if b1 is not None else None, w2.grad.t(),
               b2.grad if b2 is not None else None]
        return ref

    def rel_errs(self, outs):
        """(output's relative error, the largest of the gradients'); inf for any non-finite value."""
        torch = self.torch

        def rel(a, b):
            a = a.double()
            if not bool(torch.isfinite(a).all()):
                return float("inf")
            return float(torch.linalg.norm(a - b.double()) / torch.linalg.norm(b.double()))

        errs = [rel(o, r) for o, r in zip(outs, self.ref) if r is not None]
        return errs[0], max(errs[1:])

    def flops(self):
        return 2 * self.M * self.D * (self.W + self.H), 6 * self.M * self.D * (self.W + self.H)


class Plan:
    """One way to run the MLP on the launchers, as ops/fused_dense.py's CUDA kernel set does."""

    def __init__(self, p: Problem, fwd_gelu_epilogue: bool, bgrad_epilogue: bool, heuristic):
        self.p, self.fwd_gelu = p, fwd_gelu_epilogue and not p.gated
        self.bgrad, self.h = bgrad_epilogue, heuristic

    def _e(self, shape, dtype="bfloat16"):
        return self.p.provider.empty(shape, dtype)

    def linear(self, x, w, bias=None, gelu=False):
        M, N = x.shape[0], w.shape[1]
        out = self._e((M, N))
        aux = self._e(lt.aux_shape("gelu_approx", M, N)[0]) if gelu else None
        kind = ("fwd_bias" if bias is not None else "fwd") + ("_gelu_aux" if gelu else "")
        lt.linear_act_fwd(x, w, out, self.p.ws, bias=bias, activation="gelu_approx" if gelu else "none", aux=aux,
                          heuristic=self.h(kind, M, N, x.shape[1]))
        return out, aux

    def linear_t(self, dy, w):
        out = self._e((dy.shape[0], w.shape[0]))
        lt.linear_act_fwd(dy, w, out, self.p.ws, weight_transposed=True,
                          heuristic=self.h("dgrad", dy.shape[0], w.shape[0], w.shape[1]))
        return out

    def wgrad(self, x, dy, with_dbias):
        dw = self._e((x.shape[1], dy.shape[1]))
        db = self._e((dy.shape[1],)) if with_dbias else None
        in_epilogue = with_dbias and self.bgrad
        lt.linear_wgrad(x, dy, dw, self.p.ws, dbias=db if in_epilogue else None,
                        heuristic=self.h("wgrad_bgrad" if in_epilogue else "wgrad", x.shape[1], dy.shape[1],
                                         x.shape[0]))
        if with_dbias and not in_epilogue:
            tr.column_sum(dy, db, self._e(tr.colsum_partial_shape(*dy.shape), "float32"))
        return dw, db

    def act(self, pre):
        out = self._e((pre.shape[0], self.p.H))
        if self.p.gated:
            gated_activation_fwd(pre, out, "silu")
        else:
            tr.act_fwd(pre, out, "gelu_approx")
        return out

    def act_linear(self):
        p = self.p
        if self.fwd_gelu:
            return self.linear(p.x, p.w1, p.b1, gelu=True)
        pre, _ = self.linear(p.x, p.w1, p.b1)
        return self.act(pre), pre

    def forward(self, level):
        """(out, what backward keeps) at checkpoint level ``level``."""
        p = self.p
        out1, pre = self.act_linear()
        out, _ = self.linear(out1, p.w2, p.b2)
        return out, [pre, out1][: 2 - level]

    def backward(self, saved, level):
        p = self.p
        if level == 2:
            out1, pre = self.act_linear()
        elif level == 1:
            (pre,) = saved
            out1 = self.linear(p.x, p.w1, p.b1, gelu=True)[0] if self.fwd_gelu else self.act(pre)
        else:
            pre, out1 = saved
        dw2, db2 = self.wgrad(out1, p.dy, p.bias)
        del out1
        dact = self.linear_t(p.dy, p.w2)
        dpre, db1 = self._e(pre.shape), None
        if p.gated:
            gated_activation_bwd(pre, dact, dpre, "silu")
        elif p.bias and not self.bgrad:
            db1 = self._e((pre.shape[1],))
            tr.act_bwd_dbias(pre, dact, dpre, db1, self._e(tr.colsum_partial_shape(*pre.shape), "float32"),
                             "gelu_approx")
        else:
            tr.act_bwd(pre, dact, dpre, "gelu_approx")
        del pre, dact
        dw1, db1_gemm = self.wgrad(p.x, dpre, p.bias and db1 is None)
        dx = self.linear_t(dpre, p.w1)
        return [dx, dw1, db1 if db1 is not None else db1_gemm, dw2, db2]

    def fwdbwd(self, level=0):
        out, saved = self.forward(level)
        return [out] + self.backward(saved, level)


def _gemms(p: Problem):
    """The six GEMMs as (name, kinds to time, launch(kind, index)) on preallocated buffers."""
    r, e = p.provider.randn, p.provider.empty
    M, D, H, W = p.M, p.D, p.H, p.W
    out1, dy, dpre = r((M, H), "bfloat16"), p.dy, r((M, W), "bfloat16")
    o_mw, o_md, o_mh = e((M, W), "bfloat16"), e((M, D), "bfloat16"), e((M, H), "bfloat16")
    aux = e(lt.aux_shape("gelu_approx", M, W)[0], "bfloat16")
    dw1, dw2, db1, db2 = e((D, W), "bfloat16"), e((H, D), "bfloat16"), e((W,), "bfloat16"), e((D,), "bfloat16")
    ws = p.ws

    def fwd(a, w, out, bias):
        def go(kind, h):
            lt.linear_act_fwd(a, w, out, ws, bias=bias if "bias" in kind else None,
                              activation="gelu_approx" if "gelu" in kind else "none",
                              aux=aux if "gelu" in kind else None, heuristic=h)
        return go

    def dgrad(a, w, out):
        return lambda kind, h: lt.linear_act_fwd(a, w, out, ws, weight_transposed=True, heuristic=h)

    def wgrad(a, d, dw, db):
        return lambda kind, h: lt.linear_wgrad(a, d, dw, ws, dbias=db if kind == "wgrad_bgrad" else None, heuristic=h)

    fwd1_kinds = ["fwd"] + (["fwd_bias", "fwd_bias_gelu_aux"] if p.bias and not p.gated else [])
    bias_kinds = ["fwd_bias"] if p.bias else []
    wgrad_kinds = ["wgrad"] + (["wgrad_bgrad"] if p.bias else [])
    return [
        ("fwd1 x@W1", (M, W, D), fwd1_kinds, fwd(p.x, p.w1, o_mw, p.b1)),
        ("fwd2 out1@W2", (M, D, H), ["fwd"] + bias_kinds, fwd(out1, p.w2, o_md, p.b2)),
        ("wgrad2 out1^T@dy", (H, D, M), wgrad_kinds, wgrad(out1, dy, dw2, db2)),
        ("dgrad2 dy@W2^T", (M, H, D), ["dgrad"], dgrad(dy, p.w2, o_mh)),
        ("wgrad1 x^T@dpre", (D, W, M), wgrad_kinds, wgrad(p.x, dpre, dw1, db1)),
        ("dgrad1 dpre@W1^T", (M, D, W), ["dgrad"], dgrad(dpre, p.w1, o_md)),
    ]


def _sweep(p: Problem):
    """Per GEMM and kind: ms at each heuristic index, the best index; the floor: the sum of the six plain
    GEMMs' separate times at their best index, and a function running them back to back (timed with
    the rows)."""
    per_gemm, best, plain_best = {}, {}, []
    gemms = _gemms(p)
    for name, (M, N, K), kinds, launch in gemms:
        per_gemm[name] = {"MNK": [M, N, K]}
        for kind in kinds:
            ms = {h: bench_ms(lambda k=kind, h=h: launch(k, h), rep_ms=100) for h in INDICES}
            h_best = min(ms, key=ms.get)
            per_gemm[name][kind] = {"ms": {str(h): v for h, v in ms.items()}, "best": h_best}
            best[(kind, "bfloat16", M, N, K)] = h_best
        plain_kind = "dgrad" if "dgrad" in kinds else ("wgrad" if "wgrad" in kinds else "fwd")
        plain_best.append((launch, plain_kind, per_gemm[name][plain_kind]["best"],
                           per_gemm[name][plain_kind]["ms"][str(per_gemm[name][plain_kind]["best"])]))

    def floor():
        for launch, kind, h, _ in plain_best:
            launch(kind, h)

    return per_gemm, best, {"sum_of_best_separately_ms": sum(v for *_, v in plain_best)}, floor


def _saved_GiB(provider, forward, output_bytes):
    """(GiB allocated after ``forward`` beyond what was before it, less its output: the activations kept for
    backward; peak GiB during it)."""
    provider.synchronize()
    before = provider.memory_allocated()
    provider.reset_peak_memory()
    kept = forward()
    provider.synchronize()
    after, peak = provider.memory_allocated(), provider.peak_memory()
    del kept
    return max(0.0, (after - before - output_bytes) / GiB), max(0.0, (peak - before) / GiB)


def _pick_plan(plans, tie=PLAN_TIE):
    """The plan (fwd_gelu, bgrad, {level: row}) to commit: among the correct plans whose level-0 fwd+bwd
    is within ``tie`` of the fastest (run-to-run noise), the one with the fastest level 1 (a GELU
    epilogue makes level 1 recompute GEMM1)."""
    correct = [t for t in plans if t[2][0]["rel_err"] < 1e-2 and t[2][0]["grad_rel_err"] < 1e-2] or plans
    fastest = min(t[2][0]["fwdbwd_ms"] for t in correct)
    level0_ties = [t for t in correct if t[2][0]["fwdbwd_ms"] <= fastest * (1 + tie)]
    return min(level0_ties, key=lambda t: (t[2][1]["fwdbwd_ms"], t[2][0]["fwdbwd_ms"]))


def _case(provider, torch, F, M, D, H, gated, bias, quick):
    p = Problem(provider, torch, F, M, D, H, gated, bias)
    fwd_flops, fwdbwd_flops = p.flops()
    per_gemm, best, floor, floor_fn = _sweep(p)
    rows, timed, skipped = [], [], {}
    out_bytes = M * D * 2

    def row(impl, fwd, fwdbwd, leaves=(), forward=None, **extra):
        """A row: errors of one fwd+bwd, fwd time, peak memory, the activations ``forward`` keeps;
        its fwd+bwd is timed later, in rounds over every row (``_time_in_rounds``)."""
        outs = fwdbwd()
        provider.synchronize()
        out_err, grad_err = p.rel_errs(outs)
        del outs
        r = {"impl": impl, "fwd_ms": bench_ms(fwd) if fwd is not None else None,
             "peak_GiB": peak_GiB(provider, fwdbwd, exclude_bytes=p.grad_bytes, leaves=leaves),
             "rel_err": out_err, "grad_rel_err": grad_err}
        if r["fwd_ms"]:
            r["fwd_TFLOPs"] = TFLOPs(fwd_flops, r["fwd_ms"])
        if forward is not None:
            r["saved_GiB"], r["fwd_peak_GiB"] = _saved_GiB(provider, forward, out_bytes)
        r.update(extra)
        timed.append((r, fwdbwd))
        return r

    def tuned(kind, M_, N_, K_):
        return best.get((kind, "bfloat16", M_, N_, K_), tuning.DEFAULT_HEURISTIC)

    def committed(kind, M_, N_, K_):
        return tuning.heuristic(kind, "bfloat16", M_, N_, K_)

    flags = list(itertools.product((True, False), (True, False))) if bias and not gated else [(False, False)]
    plans, identical = [], {}  # (fwd_gelu, bgrad, {level: row}); levels 1, 2 bit-equal to level 0
    for fwd_gelu, bgrad in flags:
        plan, levels = Plan(p, fwd_gelu, bgrad, tuned), {}
        first = plan.fwdbwd(0)
        identical[f"fwd_gelu_epilogue={fwd_gelu}, bgrad_epilogue={bgrad}"] = all(
            all(a is None or torch.equal(a, b) for a, b in zip(first, plan.fwdbwd(level))) for level in (1, 2))
        del first
        for level in (0, 1, 2):
            levels[level] = row(f"paddlenlp_fused/cuda tuned (fwd_gelu_epilogue={fwd_gelu}, bgrad_epilogue={bgrad})"
                                f" checkpoint_lvl {level}", (lambda plan=plan: plan.forward(0)) if level == 0 else None,
                                lambda plan=plan, level=level: plan.fwdbwd(level),
                                forward=lambda plan=plan, level=level: plan.forward(level))
            rows.append(levels[level])
        plans.append((fwd_gelu, bgrad, levels))
    policy = Plan(p, tuning.FWD_GELU_EPILOGUE, tuning.BGRAD_EPILOGUE, committed)
    rows.append(row("paddlenlp_fused/cuda policy as committed", lambda: policy.forward(0), policy.fwdbwd))
    index0 = Plan(p, tuning.FWD_GELU_EPILOGUE, tuning.BGRAD_EPILOGUE, lambda *a: 0)
    rows.append(row("paddlenlp_fused/cuda heuristic 0", lambda: index0.forward(0), index0.fwdbwd))
    if quick and not gated:  # a smoke run: autotuning compiles 16 GEMM variants
        skipped["paddlenlp_fused/triton"] = "not run with --quick"
    elif not gated:
        rows.append(_triton_row(p, row))

    leaves = p.torch_leaves()
    params = [t for t in leaves if t is not None]

    def torch_fwdbwd(forward=p.torch_forward):
        for t in params:
            t.grad = None
        out = forward(leaves)
        out.backward(p.dy)
        x, w1, b1, w2, b2 = leaves
        return [out.detach(), x.grad, w1.grad.t(), b1.grad if b1 is not None else None, w2.grad.t(),
                b2.grad if b2 is not None else None]

    def torch_fwd(forward=p.torch_forward):
        with torch.no_grad():
            return forward(leaves)

    torch_row = row("torch", torch_fwd, torch_fwdbwd, leaves=params, forward=lambda: p.torch_forward(leaves))
    rows.append(torch_row)
    if quick:  # a smoke run: compiling takes longer than the rest of it
        skipped["torch.compile"] = "not run with --quick"
    else:
        compiled = torch.compile(p.torch_forward)
        optional_row(rows, skipped, "torch.compile", lambda: row("torch.compile", lambda: torch_fwd(compiled),
                                                                 lambda: torch_fwdbwd(compiled), leaves=params))
    floor_row = {"impl": "floor: six plain GEMMs, best index each", **floor}
    timed.append((floor_row, floor_fn))
    rows.append(floor_row)

    _time_in_rounds(timed)
    torch_ms = torch_row["fwdbwd_ms"]
    for r in rows:
        if r.get("fwdbwd_ms"):
            r["fwdbwd_TFLOPs"] = TFLOPs(fwdbwd_flops, r["fwdbwd_ms"])
            r["vs_torch"] = r["fwdbwd_ms"] / torch_ms
    fwd_gelu, bgrad, levels = _pick_plan(plans)
    checks = {
        "fastest_plan": levels[0]["impl"],
        "levels_bit_identical": identical,
        "level0_vs_torch": levels[0]["fwdbwd_ms"] / torch_ms,
        "level0_target_vs_torch": 0.95 if gated else 0.97,
        "floor_vs_torch": floor_row["fwdbwd_ms"] / torch_ms,
        "level1_time_vs_level0": levels[1]["fwdbwd_ms"] / levels[0]["fwdbwd_ms"],
        "level2_time_vs_level0": levels[2]["fwdbwd_ms"] / levels[0]["fwdbwd_ms"],
        "level2_saved_vs_level0": levels[2]["saved_GiB"] / max(levels[0]["saved_GiB"], 1e-12),
        # level 2 recomputes GEMM1 in backward, so it costs at least level 0 plus GEMM1 at its best index
        "level2_floor_vs_level0": 1 + min(per_gemm["fwd1 x@W1"][k]["ms"][str(per_gemm["fwd1 x@W1"][k]["best"])]
                                          for k in ("fwd_bias", "fwd") if k in per_gemm["fwd1 x@W1"])
                                  / levels[0]["fwdbwd_ms"],
    }
    checks["level0_met"] = checks["level0_vs_torch"] <= checks["level0_target_vs_torch"]
    checks["level2_met"] = checks["level2_saved_vs_level0"] <= 1 / 3 and checks["level2_time_vs_level0"] <= 1.15
    shape = {"M": M, "in": D, "hidden": H, "out": D, "activation": "swiglu" if gated else "gelu_approx",
             "bias": bias, "dtype": "bfloat16"}
    return {"shape": shape, "flops": {"fwd": fwd_flops, "fwdbwd": fwdbwd_flops}, "rows": rows,
            "per_gemm": per_gemm, "checks": checks, "skipped": skipped,
            "fastest_plan": {"FWD_GELU_EPILOGUE": fwd_gelu, "BGRAD_EPILOGUE": bgrad}}, best


def _time_in_rounds(timed):
    """fwd+bwd ms of every row: the median of ROUNDS do_bench medians taken round-robin over the rows,
    so that a drift of the GPU's clocks during the run falls on every row alike."""
    samples = [[] for _ in timed]
    for _ in range(ROUNDS):
        for (r, fn), got in zip(timed, samples):
            got.append(bench_ms(fn))
    for (r, _), got in zip(timed, samples):
        r["fwdbwd_ms"] = sorted(got)[len(got) // 2]
        r["fwdbwd_ms_rounds"] = got


def _triton_row(p: Problem, row):
    M, D, H = p.M, p.D, p.H
    e = p.provider.empty

    def fwd():
        out1, pre, out = e((M, H), "bfloat16"), e((M, H), "bfloat16"), e((M, D), "bfloat16")
        tr.gemm(p.x, p.w1, out1, bias=p.b1, activation="gelu_approx", pre=pre)
        tr.gemm(out1, p.w2, out, bias=p.b2)
        return out, out1, pre

    def fwdbwd():
        out, out1, pre = fwd()
        dw2, db2, dpre = e((H, D), "bfloat16"), e((D,), "bfloat16"), e((M, H), "bfloat16")
        tr.gemm(out1, p.dy, dw2, dbias=db2, trans_a=True)
        tr.gemm(p.dy, p.w2, dpre, activation="gelu_approx", pre=pre, act_grad=True, trans_b=True)
        dw1, db1, dx = e((D, H), "bfloat16"), e((H,), "bfloat16"), e((M, D), "bfloat16")
        tr.gemm(p.x, dpre, dw1, dbias=db1, trans_a=True)
        tr.gemm(dpre, p.w1, dx, trans_b=True)
        return [out, dx, dw1, db1, dw2, db2]

    fwdbwd()  # autotunes every GEMM once, outside the timing
    return row("paddlenlp_fused/triton", fwd, fwdbwd)


def _tuning_lines(best: dict, fastest: dict) -> list:
    """The lines for kernels/cuda/fused_dense_tuning.py that this run measured best."""
    entries = ", ".join(f"{k!r}: {v}" for k, v in sorted(best.items()) if v != tuning.DEFAULT_HEURISTIC)
    return [f"HEURISTIC = {{{entries}}}", f"FWD_GELU_EPILOGUE = {fastest['FWD_GELU_EPILOGUE']}",
            f"BGRAD_EPILOGUE = {fastest['BGRAD_EPILOGUE']}"]


def run(provider, quick: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    M = 2048 if quick else 16384
    gelu, best_gelu = _case(provider, torch, F, M, 4096, 16384, gated=False, bias=True, quick=quick)
    torch.cuda.empty_cache()
    swiglu, best_swiglu = _case(provider, torch, F, M, 4096, 14336, gated=True, bias=False, quick=quick)
    lines = _tuning_lines({**best_gelu, **best_swiglu}, gelu["fastest_plan"])
    for line in lines:
        print("tuning:", line)
    return {**gelu, "llama8b_swiglu": swiglu,
            "tuning": {"py": lines, "from": "the gelu case's chosen plan (_pick_plan); HEURISTIC from both cases' per-GEMM sweeps"},
            "target": {"gelu_vs_torch": 0.97, "swiglu_vs_torch": 0.95, "level2_saved_vs_level0": 1 / 3,
                       "level2_time_vs_level0": 1.15}}
