#!/usr/bin/env python3
"""One exercise's test run, as a student types it, on the tree of each git revision named, in turns.

    OPENBLAS_NUM_THREADS=1 python -m tools.benchmarks.bench_test_run 6521113 56cc7bd
    python -m tools.benchmarks.bench_test_run 6521113 56cc7bd -m exercise4 --rounds 7

Each revision's tree is unpacked from git into a scratch folder, and `python -m pytest -q -m
exercise1` runs there with LAB_MODULE=solution (every exercise written: each test runs to its
end, none stops at a stub), this interpreter and its packages. Two ways, each timed in turns
across the trees (in the opposite order every other round) so that a noisy minute of the machine
moves every tree alike: with PYTHONDONTWRITEBYTECODE=1 (as CI runs: nothing is cached, pytest
rewrites the test files' asserts at every run), and with bytecode written (a student's machine:
a first, untimed run caches it). Wall seconds and the run's CPU seconds (its process and
children), best and worst of `--rounds`; a run that does not exit 0 or passes no test stops the
benchmark.
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

from tools.bench_common import tree_at

MODES = {"no bytecode (CI)": {"PYTHONDONTWRITEBYTECODE": "1"}, "bytecode cached": {}}


def run_once(tree: Path, marker: str, env: dict) -> tuple[float, float, int]:
    """(wall seconds, CPU seconds, tests passed) of one `python -m pytest -q -m MARKER` in `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", marker], cwd=tree, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    passed = re.search(r"(\d+) passed", proc.stdout)
    if proc.returncode != 0 or not passed:
        raise SystemExit(f"{tree}: pytest -m {marker} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, int(passed.group(1))


def run_env(tree: Path, changes: dict) -> dict:
    """The environment of a run in `tree`: its modules first, the reference as the lab."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "LAB_MODULE", "PYTHONPATH")}
    env |= {"LAB_MODULE": "solution", "PYTHONPATH": str(tree)} | changes
    found = subprocess.run([sys.executable, "-c", "import solution; print(solution.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(found).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"{tree}: solution imports from {found}, not from the tree")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="+", metavar="REV", help="the git revisions whose trees to time")
    parser.add_argument("-m", dest="marker", default="exercise1", help="the exercise's marker (default exercise1)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    trees = {rev: tree_at(rev) for rev in args.revisions}
    print(f"python -m pytest -q -m {args.marker}, LAB_MODULE=solution, in each revision's tree; best and worst "
          f"of {args.rounds} in turns; Python {sys.version.split()[0]}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}")
    for mode, changes in MODES.items():
        envs = {rev: run_env(tree, changes) for rev, tree in trees.items()}
        counts = {rev: run_once(tree, args.marker, envs[rev])[2] for rev, tree in trees.items()}  # warm-up
        times: dict[str, list[tuple[float, float]]] = {rev: [] for rev in trees}
        for i in range(args.rounds):
            for rev, tree in list(trees.items())[::-1 if i % 2 else 1]:  # the order reversed every other round
                times[rev].append(run_once(tree, args.marker, envs[rev])[:2])
        print(f"{mode}:")
        for rev, runs in times.items():
            walls, cpus = sorted(w for w, _ in runs), sorted(c for _, c in runs)
            print(f"  {rev:<12} {counts[rev]:4d} passed: wall {walls[0]:.2f}-{walls[-1]:.2f} s, "
                  f"CPU {cpus[0]:.2f}-{cpus[-1]:.2f} s")
        first = args.revisions[0]
        last = args.revisions[-1]
        if first != last:
            wall = [b[0] / a[0] for a, b in zip(times[first], times[last])]
            cpu = [b[1] / a[1] for a, b in zip(times[first], times[last])]
            print(f"  {last} / {first} per round: wall {min(wall):.2f}-{max(wall):.2f}, "
                  f"CPU {min(cpu):.2f}-{max(cpu):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
