"""Benchmark runner: ``python benchmarks/run.py CASE [CASE ...] [--out DIR]`` on a GPU machine.

Each case (``benchmarks/cases/<case>.py``, a ``run(provider, quick)`` returning shape, rows and
extras) times our kernels and the torch composition side by side in one process. The runner adds
device, date, command and ceilings, prints a table, and writes ``<out>/<case>.json`` (the schema of
PERFORMANCE.md) and ``<out>/<case>.png``. ``--table`` rewrites the table in benchmarks/README.md from
``benchmarks/results/*.json`` (no GPU needed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import pathlib
import shlex
import sys

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from common import CEILING, measure_copy_TBps  # noqa: E402


def available_cases():
    return sorted(p.stem for p in (HERE / "cases").glob("*.py") if not p.stem.startswith("_"))


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
          f"(copy ceiling this run {result['ceiling']['copy_TBps_measured']:.2f} TB/s)")
    print(" | ".join(["impl"] + keys))
    for row in rows:
        print(" | ".join([row["impl"]] + [_fmt(row.get(k)) for k in keys]))


def plot(result: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    metrics = [m for m in ("fwd_ms", "fwdbwd_ms") if any(m in r for r in rows)]
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(rows), 3.6))
    width = 0.8 / max(len(metrics), 1)
    for i, metric in enumerate(metrics):
        values = [r.get(metric) or 0.0 for r in rows]
        bars = ax.bar([j + i * width for j in range(len(rows))], values, width, label=metric)
        ax.bar_label(bars, fmt="%.3g", fontsize=7)
    ax.set_xticks([j + width * (len(metrics) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["impl"] for r in rows], rotation=15, fontsize=8)
    ax.set_ylabel("ms (median, lower is better)")
    ax.set_title(f"{result['case']} {result['shape']}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_case(name: str, provider, out_dir: pathlib.Path, copy_TBps: float, quick: bool, argv) -> dict:
    case = importlib.import_module(f"cases.{name}")
    body = case.run(provider, quick=quick)
    result = {
        "case": name,
        "device": provider.device_name(),
        "date": datetime.date.today().isoformat(),
        "command": "python benchmarks/run.py " + " ".join(shlex.quote(a) for a in argv),
        "provider": provider.name,
        **body,
        "ceiling": dict(CEILING, copy_TBps_measured=round(copy_TBps, 3)),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out_dir / f"{name}.png")
    print_table(result)
    return result


def write_readme_table(results_dir: pathlib.Path = RESULTS) -> None:
    readme = HERE / "README.md"
    text = readme.read_text()
    start, end = "<!-- results:start -->", "<!-- results:end -->"
    lines = [start, "", "| case | shape | impl | fwd ms | fwd+bwd ms | achieved | peak GiB | rel err | date |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        shape = ", ".join(f"{k}={v}" for k, v in result["shape"].items())
        for row in result["rows"]:
            achieved = row.get("fwdbwd_TBps") or row.get("fwd_TBps")
            achieved = f"{achieved:.2f} TB/s" if achieved else (
                f"{row['fwdbwd_TFLOPs']:.0f} TFLOP/s" if row.get("fwdbwd_TFLOPs") else "")
            lines.append(f"| {result['case']} | {shape} | {row['impl']} | {_fmt(row.get('fwd_ms'))} | "
                         f"{_fmt(row.get('fwdbwd_ms'))} | {achieved} | {_fmt(row.get('peak_GiB'))} | "
                         f"{_fmt(row.get('rel_err'))} | {result['date']} |")
    lines += ["", end]
    head, rest = text.split(start, 1)
    tail = rest.split(end, 1)[1]
    readme.write_text(head + "\n".join(lines) + tail)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description="paddlenlp_fused GPU benchmarks")
    parser.add_argument("cases", nargs="*", help=f"cases to run: {', '.join(available_cases())}")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="where JSON and PNG go")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (smoke run, not for results/)")
    parser.add_argument("--table", action="store_true", help="rewrite benchmarks/README.md from results/")
    args = parser.parse_args(argv)
    if args.table:
        write_readme_table()
        return 0
    unknown = [c for c in args.cases if c not in available_cases()]
    if unknown or not args.cases:
        parser.error(f"cases: expected some of {available_cases()}, got {args.cases}")
    from paddlenlp_fused.testing.providers import gpu_provider

    provider = gpu_provider()
    if provider is None:
        print("no GPU: benchmarks need a CUDA device (Paddle GPU build or torch with CUDA)")
        return 2
    copy = measure_copy_TBps(provider)
    for name in args.cases:
        run_case(name, provider, args.out, copy, args.quick, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
