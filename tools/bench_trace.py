"""`python tools/bench.py trace`: what recording a trace costs.

Run through tools/bench.py, which sets `lab` (the module measured) and `clock` here."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from bench_common import _best_side_by_side  # noqa: E402

from course import trace  # noqa: E402
from loadtest import datasets  # noqa: E402

lab = None  # the module under test (solution or lab): tools/bench.py sets it before any benchmark runs
clock = time.perf_counter  # or time.process_time with --cpu-time (tools/bench.py sets it)


def bench_trace(repeats: int = 7, log=print) -> str:
    """`python tools/bench.py trace`: what recording costs. Each workload of `python solution.py
    trace` runs on a fresh engine of the module, untraced (the chapter's code, nothing wrapped:
    what every engine that is not traced runs) and traced (`trace.record`: the same run with the
    recorder reading the queues, the pool and the tables after every step), in turns, best of
    `repeats`; then the size of the page of a 200-step trace (a 64-request ShareGPT-like
    `loadtest --save-workload` file replayed, cut at 200 steps)."""
    lines = []

    def say(text: str) -> None:
        lines.append(text)
        log(text)

    say(f"== The trace's recorder: one engine run of each workload, untraced and traced, best of {repeats} ==")
    say(f"{'workload':<17}{'steps':>6}{'untraced ms':>13}{'traced ms':>11}{'traced/untraced':>17}{'page KB':>9}")
    for name in trace.WORKLOADS:
        workload = trace.get_workload(name)
        best = _best_side_by_side({
            "untraced": lambda: trace.drive(trace.build_engine(lab, workload), lab, workload),
            "traced": lambda: trace.record(lab, workload),
        }, repeats)
        recorded = trace.record(lab, workload)
        kb = len(trace.render_page(recorded).encode()) / 1024
        say(f"{name:<17}{len(recorded.frames) - 1:>6}{best['untraced'] * 1e3:>13.1f}{best['traced'] * 1e3:>11.1f}"
            f"{best['traced'] / best['untraced']:>16.2f}x{kb:>9.0f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sharegpt-64.jsonl")
        datasets.save_workload(datasets.make_workload(lab, "sharegpt", 64, seed=0), path)
        long = trace.record(lab, trace.get_workload(path), max_steps=200)
    page = trace.render_page(long).encode()
    say(f"a {len(long.frames) - 1}-step trace ({len(long.workload.arrivals)} requests of a ShareGPT-like workload, "
        f"{long.workload.engine['num_blocks']} blocks): the page is {len(page) / 1024:.0f} KB, "
        f"{len(page) / 1024 / (len(long.frames) - 1):.1f} KB a step")
    say("An engine that is not traced runs the chapter's code unchanged: the recorder wraps methods of the traced "
        "engine's own scheduler instance, never a class.")
    return "\n".join(lines)
