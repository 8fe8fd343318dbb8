#!/usr/bin/env python3
"""Where `fleet`'s time goes: the README's fleet command on this checkout and on another revision,
side by side.

    python -m tools.fleet.bench_fleet --against 669cb96 --repeats 2

The command (`python solution.py fleet --model llama-2-13b --gpu a100-80gb --qps 100 ...`, as the
README shows it) runs once per revision per repeat, the revisions in turn, so that drift on a
shared machine falls on both. A revision other than this checkout runs from `git archive REV` in a
scratch folder. For each run: its wall time, the CPU time of the command and of the searches it
forks, the 1-minute load average before and after, the searches and the simulated runs its progress
lines count (each ends "(N runs)"), by step cost (measured or roofline; a revision from before the
measured cost searched the roofline alone), the CPU per run, and its pick (the line "Pick: ..."),
which must be the same for every run of a revision.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

from tools.bench_common import ROOT, tree_at

COMMAND = ["fleet", "--model", "llama-2-13b", "--gpu", "a100-80gb", "--qps", "100", "--p99-ttft-ms", "200",
           "--p99-tpot-ms", "50", "--workload", "sharegpt", "--usd-per-gpu-hour", "2"]
PROGRESS = re.compile(r"^\s+\[\s*\d+/\d+\s+[\d.]+ s\] .*\((?P<runs>\d+) runs\)$")
COST = re.compile(r" \((measured|roofline)[^)]*\): ")  # absent before the measured cost: the roofline alone


def run_once(tree: Path) -> dict:
    """One run of the command in `tree`: wall and CPU seconds, load, searches and runs by cost, the pick."""
    load_before = os.getloadavg()[0]
    cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(tree / "solution.py"), *COMMAND], cwd=tree, capture_output=True,
                          text=True, check=True)
    wall = time.perf_counter() - start
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    searches = {"measured": [0, 0], "roofline": [0, 0]}  # cost -> [searches, runs]
    for line in proc.stdout.splitlines():
        found = PROGRESS.match(line)
        if found:
            cost = COST.search(line)
            tally = searches[cost.group(1) if cost else "roofline"]
            tally[0] += 1
            tally[1] += int(found["runs"])
    pick = next((line for line in proc.stdout.splitlines() if line.startswith("Pick:")), "(no pick)")
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    return dict(wall=wall, cpu=cpu, load=(load_before, os.getloadavg()[0]), searches=searches,
                pick=pick.split(":")[1].strip(), picks=proc.stdout.count("Pick:"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", metavar="REV", help="also run the command of this git revision, in turns")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {"this checkout": ROOT}
    if args.against:
        trees = {args.against: tree_at(args.against), **trees}
    print(f"python solution.py {' '.join(COMMAND)}; {os.cpu_count()} CPUs, {time.strftime('%Y-%m-%d %H:%M %Z')}")
    print(f"{'revision':<14} {'wall s':>7} {'CPU s':>7} {'load before/after':>18} {'searches m+r':>13} "
          f"{'runs m+r':>9} {'CPU/run s':>10} {'Pick:':>6}  pick")
    for _ in range(args.repeats):
        for name, tree in trees.items():
            r = run_once(tree)
            (ms, mr), (rs, rr) = r["searches"]["measured"], r["searches"]["roofline"]
            print(f"{name:<14} {r['wall']:>7.1f} {r['cpu']:>7.1f} {r['load'][0]:>8.2f} / {r['load'][1]:<7.2f} "
                  f"{f'{ms}+{rs}':>13} {f'{mr}+{rr}':>9} {r['cpu'] / max(mr + rr, 1):>10.2f} {r['picks']:>6}  "
                  f"{r['pick']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
