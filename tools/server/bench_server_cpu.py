#!/usr/bin/env python3
"""The server's CPU time per request at a load near its knee, this checkout against an earlier one.

    python tools/server/bench_server_cpu.py --against REV [--qps 128] [--num-prompts 512] [--rounds 2]

Each side runs `python solution.py serve` (the toy model, its defaults) from its own tree on
127.0.0.1, and this checkout's load generator sends the same Alpaca-like requests at `--qps`
(open loop, Poisson arrivals, seed 0). The figure is the CPU seconds the server's processes (the
engine's and the forked HTTP front end's, read from /proc) spent during the load, over the
requests that completed: what one request costs the server, whatever the machine's other load
does to wall time. The sides alternate, `--rounds` times each. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import solution  # noqa: E402
from loadtest.benchmark_serving import loadtest  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def tree_at(rev: str) -> Path:
    """The repository at `rev`, unpacked into a scratch folder."""
    where = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def cpu_seconds(pid: int) -> float:
    """User + system CPU of `pid` and its live children (the front end is a forked child)."""
    pids, total = [pid], 0.0
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
    parser.add_argument("--against", required=True, metavar="REV")
    parser.add_argument("--qps", type=float, default=128.0)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    trees = {args.against: tree_at(args.against), "this checkout": ROOT}
    per_request: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            spent, done = measure(tree, args.qps, args.num_prompts)
            if done == 0:
                raise SystemExit(f"{name}: no request completed")
            per_request[name].append(spent / done * 1e3)
            print(f"{name}: {spent:.2f} s of server CPU for {done} requests at {args.qps:g} req/s", flush=True)
    for name, values in per_request.items():
        print(f"{name:<16} server CPU per request: {min(values):.2f} ms (best of {len(values)}; all: "
              f"{', '.join(f'{v:.2f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
