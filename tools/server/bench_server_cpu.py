#!/usr/bin/env python3
"""The server's CPU time per request at a load near its knee, one git revision against another.

    python -m tools.server.bench_server_cpu 6521113 56cc7bd [--qps 128] [--num-prompts 512] [--rounds 2]
    python -m tools.server.bench_server_cpu --against REV      # that revision and this checkout

Each side runs `python solution.py serve` (the toy model, its defaults) from its own tree on
127.0.0.1 (a revision's tree unpacked from git), and this checkout's load generator sends the
same Alpaca-like requests at `--qps` (open loop, Poisson arrivals, seed 0). The figure is the
CPU seconds the server's processes (the engine's and the forked HTTP front end's, read from
/proc) spent during the load, over the requests that completed: what one request costs the
server, whatever the machine's other load does to wall time. The sides alternate, `--rounds`
times each, in the opposite order every other round; the last side's cost over the first's is
given per round too. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import solution
from loadtest.benchmark_serving import loadtest
from tools.bench_common import ROOT, tree_at

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its live children (the front end is a forked child)."""
    pids = [pid]
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(c) for c in (task / "children").read_text().split()]
    for p in pids:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(tree: Path, qps: float, num_prompts: int) -> tuple[float, int]:
    """(server CPU seconds during the load, requests completed) for the server of `tree`."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "solution.py", "serve", "--port", str(port)], cwd=tree,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        proc.stdout.readline()  # the banner: it accepts connections
        time.sleep(0.5)
        before = cpu_seconds(proc.pid)
        summaries = loadtest(solution, f"http://127.0.0.1:{port}", [qps], num_prompts, "alpaca", 0, "token-ids",
                             None, None, None, None, None, 60.0, log=lambda *a: None)
        spent = cpu_seconds(proc.pid) - before
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return spent, int(summaries[0]["completed"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revisions", nargs="*", metavar="REV", help="the git revisions whose servers to measure")
    parser.add_argument("--against", metavar="REV", help="this revision's server, then this checkout's")
    parser.add_argument("--qps", type=float, default=128.0)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    revisions = [args.against] * bool(args.against) + args.revisions
    trees = {rev: tree_at(rev) for rev in revisions}
    if args.against or not args.revisions:
        trees["this checkout"] = ROOT
    per_request: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.rounds):
        for name, tree in list(trees.items())[::-1 if i % 2 else 1]:  # the order reversed every other round
            spent, done = measure(tree, args.qps, args.num_prompts)
            if done == 0:
                raise SystemExit(f"{name}: no request completed")
            per_request[name].append(spent / done * 1e3)
            print(f"{name}: {spent:.2f} s of server CPU for {done} requests at {args.qps:g} req/s", flush=True)
    for name, values in per_request.items():
        print(f"{name:<16} server CPU per request: {min(values):.2f} ms (best of {len(values)}; all: "
              f"{', '.join(f'{v:.2f}' for v in values)})")
    names = list(trees)
    if len(names) > 1:
        a = per_request[names[0]]
        b = per_request[names[-1]]
        ratios = [after / before for before, after in zip(a, b)]
        print(f"{names[-1]} / {names[0]}: {min(b) / min(a):.3f} (best of each); per round "
              f"{min(ratios):.3f}-{max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
