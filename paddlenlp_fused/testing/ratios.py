"""Summary of a flake hunt: the checks that came closest to their bounds.

Run the suite with ``PADDLENLP_FUSED_RATIO_LOG=LOG`` (each check appends its error / bound, norm-wise
and elementwise, to LOG; repeat the run for more seeds: each test draws a fresh seed), then
``python -m paddlenlp_fused.testing.ratios LOG [--top N]`` prints, per check, the number of calls and
the largest ratios with the test and seed that gave them. A ratio near 1 is a flake waiting to happen.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict


def summarise(lines, top: int = 25):
    """[(worst ratio, check key, calls, test of the worst)] for the ``top`` checks, worst first. A
    check's key drops the test's parameters and seed, so one check over every call is one row."""
    by_key = defaultdict(lambda: [0.0, 0, ""])
    for line in lines:
        rec = json.loads(line)
        test = rec["test"]
        key = re.sub(r"\[.*", "", test.split(" seed=")[0]) + " :: " + rec["check"]
        ratio = max(r for r in (rec["norm"], rec["elementwise"]) if r is not None)
        row = by_key[key]
        row[1] += 1
        if not ratio <= row[0]:  # NaN/inf rise to the top
            row[0], row[2] = ratio, test
    rows = sorted(((r[0], k, r[1], r[2]) for k, r in by_key.items()),
                  key=lambda r: -r[0] if r[0] == r[0] else float("-inf"))
    return rows[:top]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    with open(args.log) as f:
        lines = f.readlines()
    print(f"{len(lines)} checks")
    for ratio, key, calls, test in summarise(lines, args.top):
        print(f"{ratio:7.3f}  {calls:6d} calls  {key}\n         worst: {test}")


if __name__ == "__main__":
    main()
