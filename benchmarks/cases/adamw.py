"""AdamW step over 1.1e9 bf16 parameters (PERFORMANCE.md): our multi-tensor kernel against torch's
``AdamW(fused=True)`` in the same process.

The parameters are TinyLlama-1.1B's 201 tensors (vocab 32000, hidden 2048, 22 layers, MLP 5632,
4-head GQA k/v of 256): embeddings and LM head of 65.5M, projections of 0.5M-11.5M, norms of 2048.
Ours: bf16 params and grads, fp32 master weights, bf16 moments = 22 B per parameter moved
(param 2, grad 2, m 2, v 2, master 4 read; param, m, v, master written), stochastic rounding of
the moments (and round-to-nearest for comparison). Torch: fp32 params and states (28 B/param) and
bf16 params and states (14 B/param).

``step_ms``: median device time of one step (``triton.testing.do_bench``); ours is the launch with
its tables in place (``fwd_ms`` repeats it so the runner's table and plot show it).
``step_wall_ms``: host wall clock per step over 20 synchronised steps; ours then also does what
FusedAdamW does on the host every step (offsets table from the addresses, the scalar table
uploaded by a synchronous copy, the launch). Launch configurations (block, iters, warps, register
cap) are swept with ``run.py --sweeps``, each checked against float64 on one tensor; the rows use the
module's default.
"""

from __future__ import annotations

import time

import numpy as np
from common import TBps, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton.adamw import (BLOCK, ITERS, MAXNREG, NUM_WARPS, adamw_multi_tensor, hyper_rows,
                                                  offsets_table, plan_chunks, step_seed, table_aligned)
from paddlenlp_fused.testing.numerics import rel_err

LR, BETAS, EPS, WEIGHT_DECAY, STEP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 100
DEFAULT = (BLOCK, ITERS, NUM_WARPS, MAXNREG)
SWEEP = [DEFAULT, (1024, 4, 4, 64), (1024, 16, 4, 64), (2048, 4, 8, 64), (2048, 8, 8, 64), (512, 16, 2, 64),
         (1024, 8, 4, 80)]  # (block, iters, num_warps, maxnreg)
CHECKED = 3  # index of the tensor (a k projection) checked against float64 after one step


def llama_shapes(layers: int = 22, hidden: int = 2048, intermediate: int = 5632, vocab: int = 32000,
                 kv: int = 256):
    shapes = [(vocab, hidden)]
    for _ in range(layers):
        shapes += [(hidden,), (hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (hidden,),
                   (intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    return shapes + [(hidden,), (vocab, hidden)]


def _adamw64(w, g, m, v, decays, step):
    b1, b2 = BETAS
    w = w * (1 - LR * (WEIGHT_DECAY if decays else 0.0))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return w - LR / (1 - b1**step) * m / (np.sqrt(v) / np.sqrt(1 - b2**step) + EPS)


def _wall_ms(provider, fn, steps: int = 20) -> float:
    """Host wall clock of ``steps`` calls, synchronised at both ends: host work included."""
    fn()
    provider.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    provider.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def _ours(provider, shapes, sweep):
    import torch

    params = [provider.randn(s, "bfloat16") for s in shapes]
    grads = [provider.randn(s, "bfloat16", scale=1e-2) for s in shapes]
    exp_avgs = [provider.randn(s, "bfloat16", scale=1e-3) for s in shapes]
    exp_avg_sqs = [torch.randn(s, device="cuda").mul_(1e-3).square_().to(torch.bfloat16) for s in shapes]
    masters = [p.float() for p in params]
    lists = (params, grads, exp_avgs, exp_avg_sqs, masters)
    decays = np.array([len(s) > 1 for s in shapes])  # no decay for norms, as usual
    b1p, b2p = np.float32(BETAS[0]) ** STEP, np.float32(BETAS[1]) ** STEP
    hyper = hyper_rows(LR, np.where(decays, WEIGHT_DECAY, 0.0), BETAS[0], BETAS[1], EPS, b1p, b2p)
    numels = [int(np.prod(s)) for s in shapes]

    def kernel_fn(config, stochastic_rounding, per_step_host_work=False):
        """The launch with tables in place; with ``per_step_host_work`` also what FusedAdamW does on
        the host every step: the offsets table from the addresses, the scalar table uploaded
        (a synchronous copy), the launch."""
        block, iters, num_warps, maxnreg = config
        chunk_tensor, first_chunk = plan_chunks(numels, block * iters)
        offsets = offsets_table(*lists, first_chunk)
        aligned = table_aligned(offsets, *lists)
        tables = [provider.from_numpy(chunk_tensor, "int32"), provider.from_numpy(offsets, "int64"),
                  provider.from_numpy(hyper, "float32")]
        launch = dict(seed=step_seed(7, STEP), stochastic_rounding=stochastic_rounding, block=block, iters=iters,
                      num_warps=num_warps, maxnreg=maxnreg, validate=False)

        def step():
            now_aligned = aligned
            if per_step_host_work:
                now_aligned = table_aligned(offsets_table(*lists, first_chunk), *lists)
                tables[2] = provider.from_numpy(hyper, "float32")
            adamw_multi_tensor(*lists, *tables, aligned=now_aligned, **launch)
        return step

    def checked(config, stochastic_rounding):
        """One step (compiles), then the fp32 master of a k projection against float64."""
        fn = kernel_fn(config, stochastic_rounding)
        before = [provider.to_numpy(t[CHECKED]) for t in (masters, grads, exp_avgs, exp_avg_sqs)]
        fn()
        provider.synchronize()
        return fn, rel_err(provider.to_numpy(masters[CHECKED]), _adamw64(*before, decays[CHECKED], STEP))

    configs = []
    for config in SWEEP if sweep else ():
        fn, err = checked(config, True)
        configs.append({"block": config[0], "iters": config[1], "num_warps": config[2], "maxnreg": config[3],
                      "step_ms": bench_ms(fn), "rel_err": err})
    rows = []
    for name, sr in (("paddlenlp_fused/triton", True), ("paddlenlp_fused/triton nearest", False)):
        fn, err = checked(DEFAULT, sr)
        rows.append({"impl": name, "step_ms": bench_ms(fn), "peak_GiB": peak_GiB(provider, fn), "rel_err": err,
                     "step_wall_ms": _wall_ms(provider, kernel_fn(DEFAULT, sr, per_step_host_work=True)),
                     "bytes_per_param": 22, "stochastic_rounding": sr})
    return rows, configs


def _torch(provider, shapes, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=dtype)) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p).mul_(1e-2)
    decays = [p for p, s in zip(params, shapes) if len(s) > 1]
    no_decay = [p for p, s in zip(params, shapes) if len(s) == 1]
    groups = [{"params": decays, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)
    opt.step()  # creates the state
    checked = params[CHECKED]
    state = opt.state[checked]
    before = [provider.to_numpy(t) for t in (checked, checked.grad, state["exp_avg"], state["exp_avg_sq"])]
    step = int(state["step"]) + 1
    opt.step()
    provider.synchronize()
    err = rel_err(provider.to_numpy(checked), _adamw64(*before, True, step))
    label = "fp32" if dtype_name == "float32" else "bf16"
    row = {"impl": f"torch AdamW(fused) {label}", "step_ms": bench_ms(opt.step),
           "peak_GiB": peak_GiB(provider, opt.step), "rel_err": err, "step_wall_ms": _wall_ms(provider, opt.step),
           "bytes_per_param": 28 if dtype_name == "float32" else 14, "stochastic_rounding": False}
    del opt, params
    return row


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    import torch

    shapes = llama_shapes(layers=2 if quick else 22)
    n = sum(int(np.prod(s)) for s in shapes)
    rows, configs = _ours(provider, shapes, sweep)
    torch.cuda.empty_cache()
    rows += [_torch(provider, shapes, "float32"), _torch(provider, shapes, "bfloat16")]
    for entry in configs:
        entry["TBps"] = TBps(22 * n, entry["step_ms"])
    by_name = {row["impl"]: row for row in rows}
    for row in rows:
        row["fwd_ms"] = row["step_ms"]
        row["step_TBps"] = row["fwd_TBps"] = TBps(row["bytes_per_param"] * n, row["step_ms"])
        row["speedup_vs_torch_fp32"] = by_name["torch AdamW(fused) fp32"]["step_ms"] / row["step_ms"]
        row["speedup_vs_torch_bf16"] = by_name["torch AdamW(fused) bf16"]["step_ms"] / row["step_ms"]
    return {"shape": {"params": n, "tensors": len(shapes), "param_dtype": "bfloat16", "master": "float32",
                      "moments": "bfloat16"},
            "rows": rows, "sweep": configs,
            "skipped": {"torch.compile": "not run: torch's own fused AdamW (one multi-tensor CUDA kernel) is the "
                                         "torch row"},
            "default_config": {"block": BLOCK, "iters": ITERS, "num_warps": NUM_WARPS, "maxnreg": MAXNREG},
            "note": "fwd_ms = one optimizer step; TB/s over the bytes each implementation moves per parameter",
            "target": {"step_TBps": 3.0, "step_ms_at_1e9": 7.3}}
