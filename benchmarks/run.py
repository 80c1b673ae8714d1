"""Benchmark runner: ``python benchmarks/run.py CASE [CASE ...] | all [--sweeps] [--out DIR]`` on a GPU
machine; ``python benchmarks/run.py --table`` anywhere.

Each case (``benchmarks/cases/<case>.py``, a ``run(provider, quick[, sweep])`` returning shape, rows
and extras) times our kernels, the torch composition and the peers side by side in one process. The
runner adds device, date, command, versions and ceilings, prints a table and the case's wall time,
and writes ``<out>/<case>.json`` (the schema of PERFORMANCE.md) and ``<out>/<case>.png``; a case
that fails is reported and the others still run. ``--table`` rewrites the results table of
benchmarks/README.md and docs/performance.md (between their ``results`` markers) from
``benchmarks/results/*.json`` (no GPU needed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import inspect
import json
import pathlib
import shlex
import sys
import textwrap
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
TABLE_FILES = (HERE / "README.md", HERE.parent / "docs" / "performance.md")
MARKERS = ("<!-- results:start -->", "<!-- results:end -->")
OURS = "paddlenlp_fused"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import measure_ceilings  # noqa: E402


# 'all' runs the quick cases first and ssd (mamba_ssm's autotuned kernels, torch.compile of the chunked
# composition) last, so a run stopped at its time limit keeps the most results
FIRST = ("swiglu", "layer_norm", "rms_norm", "causal_conv1d", "selective_scan", "adamw", "contrastive")


def available_cases():
    return sorted(p.stem for p in (HERE / "cases").glob("*.py") if not p.stem.startswith("_"))


def all_cases():
    cases = available_cases()
    return [c for c in FIRST if c in cases] + [c for c in cases if c not in FIRST and c != "ssd"] + (
        ["ssd"] if "ssd" in cases else [])


def _fmt(value):
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def print_table(result: dict) -> None:
    rows = result["rows"]
    keys = [k for k in rows[0] if k != "impl"]
    for row in rows[1:]:
        keys += [k for k in row if k not in keys and k != "impl"]
    print(f"\n{result['case']}  {json.dumps(result['shape'])}  on {result['device']}  "
          f"(ceilings this run: copy {_copy_TBps(result):.2f} TB/s, bf16 GEMM "
          f"{result['ceiling'].get('bf16_gemm_TFLOPs', 0):.0f} TFLOP/s)")
    print(" | ".join(["impl"] + keys))
    for row in rows:
        print(" | ".join([row["impl"]] + [_fmt(row.get(k)) for k in keys]))
    for impl, why in result.get("skipped", {}).items():
        print(f"skipped {impl}: {why}")


def _copy_TBps(result: dict) -> float:
    """The copy ceiling a result was measured against (results before 2026-12-08 kept the H200's
    nominal figure under ``copy_TBps`` and the run's own under ``copy_TBps_measured``)."""
    ceiling = result.get("ceiling", {})
    return ceiling.get("copy_TBps_measured") or ceiling.get("copy_TBps")


def _per_batch(rows) -> bool:
    """Rows timed on different batches (selective_scan's torch loop runs batch 1): compare per batch
    element."""
    return any("fwdbwd_per_batch_ms" in r for r in rows)


def _time_keys(rows):
    suffix = "_per_batch_ms" if _per_batch(rows) else "_ms"
    return [(f"fwd{suffix}", "fwd"), (f"fwdbwd{suffix}", "fwd+bwd")]


def _floors_ms(result: dict) -> dict:
    """Time floors of the case from its bytes at this run's copy ceiling, or its FLOPs at the bf16 GEMM
    ceiling: {"fwd": ms, "fwdbwd": ms}, per batch element where the rows are."""
    ceiling = result.get("ceiling", {})
    per = result["shape"].get("batch", 1) if _per_batch(result["rows"]) else 1
    copy = _copy_TBps(result)
    floors = {}
    for key in ("fwd", "fwdbwd"):
        for work, rate in (("bytes", copy), ("flops", ceiling.get("bf16_gemm_TFLOPs"))):
            counts = result.get(work, {})
            amount = counts.get(f"floor_{key}", counts.get(key))  # the least work, where a case names it
            if isinstance(amount, (int, float)) and rate and key not in floors:
                floors[key] = amount / (rate * 1e12) * 1e3 / per
    return floors


def plot(result: dict, path: pathlib.Path) -> None:
    """One figure a case: every row's fwd and fwd+bwd time (bars; dashed lines: the floors at the
    ceilings) and, in a second panel, its peak memory."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    metrics = [(k, label) for k, label in _time_keys(rows) if any(r.get(k) for r in rows)]
    fig, (ax, mem) = plt.subplots(1, 2, figsize=(4 + 2.2 * len(rows), 4.4),
                                  gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / max(len(metrics), 1)
    names = [r["impl"].replace(" (", "\n(") for r in rows]
    floors = _floors_ms(result)
    values_all = []
    for i, (metric, label) in enumerate(metrics):
        values = [r.get(metric) or 0.0 for r in rows]
        values_all += [v for v in values if v > 0]
        bars = ax.bar([j + i * width for j in range(len(rows))], values, width, label=label, color=f"C{i}")
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
        floor = floors.get(metric.split("_")[0])
        if floor:
            ax.axhline(floor, color=f"C{i}", linestyle="--", linewidth=1,
                       label=f"{label} floor at the {'copy' if 'bytes' in result else 'bf16 GEMM'} ceiling")
    if values_all and max(values_all) / min(values_all) > 30:
        ax.set_yscale("log")
    ax.set_xticks([j + width * (len(metrics) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    per = " per batch element" if _per_batch(rows) else ""
    ax.set_ylabel(f"ms{per}, median (lower is better)")
    ax.legend(fontsize=7)
    peaks = [r.get("peak_GiB") for r in rows]
    bars = mem.bar(range(len(rows)), [p or 0.0 for p in peaks], 0.6, color="C2")
    mem.bar_label(bars, labels=["" if p is None else f"{p:.3g}" for p in peaks], fontsize=7)
    mem.set_xticks(range(len(rows)))
    mem.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    mem.set_ylabel("peak GiB of one fwd+bwd (README)")
    shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
    fig.suptitle(textwrap.fill(f"{result['case']}: {shape}", 140) + f"\n{result.get('device', '')}, "
                 f"{result.get('date', '')}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _versions() -> dict:
    versions = {}
    for name in ("torch", "triton"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    try:
        import torch

        versions["cuda"] = torch.version.cuda
    except ImportError:
        pass
    return versions


def run_case(name: str, provider, out_dir: pathlib.Path, ceiling: dict, quick: bool, sweep: bool, argv) -> dict:
    case = importlib.import_module(f"cases.{name}")
    options = {"sweep": sweep} if "sweep" in inspect.signature(case.run).parameters else {}
    body = case.run(provider, quick=quick, **options)
    result = {
        "case": name,
        "device": provider.device_name(),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in argv),
        "provider": provider.name,
        "versions": _versions(),
        **body,
        "ceiling": dict(ceiling, measured="this run, this card (common.measure_ceilings)"),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out_dir / f"{name}.png")
    print_table(result)
    return result


FLOOR = "floor:"  # impl prefix of a floor row (vs_best_other)


def _primary(row: dict, rows) -> float | None:
    for key, _ in reversed(_time_keys(rows)):  # fwd+bwd where timed, else fwd (an optimizer step)
        if row.get(key):
            return row[key]
    return None


def vs_best_other(rows) -> list:
    """Each row's time over the best row of the other side at the same size (``B`` where rows carry
    it): ours against the fastest of torch and the peers, each of those against our fastest. A floor
    row (``impl`` "floor: ...", e.g. the MLP's plain GEMMs alone) is no competitor: it gets its ratio
    to our fastest but counts for no row of ours."""
    ratios = []
    for row in rows:
        mine = row["impl"].startswith(OURS)
        others = [_primary(r, rows) for r in rows if r["impl"].startswith(OURS) != mine
                  and not (mine and r["impl"].startswith(FLOOR))
                  and r.get("B") == row.get("B") and _primary(r, rows)]
        t = _primary(row, rows)
        ratios.append(t / min(others) if t and others else None)
    return ratios


def table_lines(results_dir: pathlib.Path = RESULTS) -> list:
    lines = ["| case | shape | impl | fwd ms | fwd+bwd ms | vs best other | achieved | peak GiB | rel err | date |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    runs, skipped = [], []
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
        for row, ratio in zip(result["rows"], vs_best_other(result["rows"])):
            achieved = row.get("fwdbwd_TBps") or row.get("fwd_TBps")
            achieved = f"{achieved:.2f} TB/s" if achieved else (
                f"{row['fwdbwd_TFLOPs']:.0f} TFLOP/s" if row.get("fwdbwd_TFLOPs") else "")
            lines.append(f"| {result['case']} | {shape} | {row['impl']} | {_fmt(row.get('fwd_ms'))} | "
                         f"{_fmt(row.get('fwdbwd_ms'))} | {'' if ratio is None else f'{ratio:.3g}x'} | {achieved} | "
                         f"{_fmt(row.get('peak_GiB'))} | {_fmt(row.get('rel_err'))} | {result['date']} |")
        versions = ", ".join(f"{k} {v}" for k, v in result.get("versions", {}).items())
        runs.append(f"- {result['case']}: `{result['command']}` on {result['device']}, {result['date']}"
                    + (f" ({versions})" if versions else ""))
        skipped += [f"- {result['case']}: {impl}: {why}" for impl, why in result.get("skipped", {}).items()]
    lines += ["", "Runs:", ""] + runs
    if skipped:
        lines += ["", "Rows not in these runs:", ""] + skipped
    return lines


def write_tables(results_dir: pathlib.Path = RESULTS, files=TABLE_FILES) -> list:
    """Rewrite the table between the markers of each file that has them; returns the files written."""
    start, end = MARKERS
    lines = table_lines(results_dir)
    written = []
    for path in files:
        if not path.is_file() or start not in path.read_text():
            continue
        head, rest = path.read_text().split(start, 1)
        tail = rest.split(end, 1)[1]
        path.write_text(head + "\n".join([start, ""] + lines + ["", end]) + tail)
        written.append(path)
    return written


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="paddlenlp_fused GPU benchmarks")
    parser.add_argument("cases", nargs="*", help=f"'all' or cases to run: {', '.join(available_cases())}")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where JSON and PNG go")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run, not for results/)")
    parser.add_argument("--sweeps", action="store_true",
                        help="also the launch-configuration sweeps (minutes; the defaults came from them)")
    parser.add_argument("--table", action="store_true",
                        help="rewrite the results tables of benchmarks/README.md and docs/performance.md")
    args = parser.parse_args(argv)
    if args.table:
        for path in write_tables():
            print(f"wrote {path}")
        return 0
    cases = all_cases() if args.cases == ["all"] else args.cases
    unknown = [c for c in cases if c not in available_cases()]
    if unknown or not cases:
        parser.error(f"cases: expected 'all' or some of {available_cases()}, got {args.cases}")
    from paddlenlp_fused.testing.providers import gpu_provider

    provider = gpu_provider()
    if provider is None:
        print("no GPU: benchmarks need a CUDA device (Paddle GPU build or torch with CUDA)")
        return 2
    ceiling = measure_ceilings(provider)
    print(f"ceilings: {ceiling}", flush=True)
    failed, start = [], time.perf_counter()
    for name in cases:
        case_start = time.perf_counter()
        try:
            run_case(name, provider, args.out, ceiling, args.quick, args.sweeps, argv)
        except Exception:  # one case failing leaves the others' results standing
            traceback.print_exc()
            failed.append(name)
        print(f"== {name}: {time.perf_counter() - case_start:.0f} s (total {time.perf_counter() - start:.0f} s)"
              f"{' FAILED' if name in failed else ''}", flush=True)
        if hasattr(provider, "torch"):  # compiled graphs hold the case's tensors; free them for the next
            provider.torch._dynamo.reset()
            provider.torch.cuda.empty_cache()
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
