"""`python -m tools.bench trace`: what recording a trace costs; `python -m tools.bench events`: what the
engine's events cost when no one listens."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from types import ModuleType

from course.pages import trace
from course.pages.trace_workloads import WORKLOADS, Arrival, Workload, get_workload
from loadtest import datasets
from measure.timing import best_side_by_side
from tools.bench_common import Report, solution_at


def bench_trace(lab: ModuleType, repeats: int = 7, log=print, clock=time.perf_counter) -> str:
    """`python -m tools.bench trace`: what recording costs on the module `lab`, timed by `clock`.
    Each workload of `python solution.py trace` runs on a fresh engine of the module, untraced (the
    chapter's code, nothing wrapped: what every engine that is not traced runs) and traced
    (`trace.record`: the same run with the recorder reading the queues, the pool and the tables
    after every step), in turns, best of `repeats`; then the size of the page of a 200-step trace
    (a 64-request ShareGPT-like `loadtest --save-workload` file replayed, cut at 200 steps)."""
    say = Report(log)
    say(f"== The trace's recorder: one engine run of each workload, untraced and traced, best of {repeats} ==")
    say(f"{'workload':<17}{'steps':>6}{'untraced ms':>13}{'traced ms':>11}{'traced/untraced':>17}{'page KB':>9}")
    for name in WORKLOADS:
        workload = get_workload(name)
        best = best_side_by_side({
            "untraced": lambda: trace.drive(trace.build_engine(lab, workload), lab, workload),
            "traced": lambda: trace.record(lab, workload),
        }, repeats, clock=clock)
        recorded = trace.record(lab, workload)
        kb = len(trace.render_page(recorded).encode()) / 1024
        say(f"{name:<17}{len(recorded.frames) - 1:>6}{best['untraced'] * 1e3:>13.1f}{best['traced'] * 1e3:>11.1f}"
            f"{best['traced'] / best['untraced']:>16.2f}x{kb:>9.0f}")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sharegpt-64.jsonl")
        datasets.save_workload(datasets.make_workload(lab, "sharegpt", 64, seed=0), path)
        long = trace.record(lab, get_workload(path), max_steps=200)
    page = trace.render_page(long).encode()
    say(f"a {len(long.frames) - 1}-step trace ({len(long.workload.arrivals)} requests of a ShareGPT-like workload, "
        f"{long.workload.engine['num_blocks']} blocks): the page is {len(page) / 1024:.0f} KB, "
        f"{len(page) / 1024 / (len(long.frames) - 1):.1f} KB a step")
    say("An engine that is not traced sends no event and runs the plain BlockAllocator: the recorder is the traced "
        "engine's observer and wraps nothing (`python -m tools.bench events` measures what the events cost).")
    return say.text()


# The chapter just before the engine's events were added: the baseline of `bench events`.
EVENTS_BASELINE = "6521113"


def chapter_at(revision: str):
    """solution.py as it was at a git revision of this checkout, imported as a module of its own;
    None where git or the revision is missing (a student's copy has no history)."""
    try:
        return solution_at(revision, "chapter_before_events")
    except (OSError, subprocess.SubprocessError):
        return None


def busy_workload() -> Workload:
    """Many short requests on a model so small that the scheduler's and the pool's Python is most of a
    step: where a cost of the events would show most."""
    arrivals = tuple(Arrival(i // 8, f"r{i}", tuple((7 * i + j) % 63 + 1 for j in range(6 + i % 11)),
                             4 + i % 9, seed=i) for i in range(96))
    model = dict(vocab_size=64, n_positions=64, n_embd=8, n_layer=1, n_head=2)
    engine = dict(num_blocks=96, block_size=4, max_num_seqs=32, max_num_batched_tokens=64, enable_prefix_caching=True)
    return Workload("busy", "96 short requests, 32 seats, a one-layer model 8 wide", "", engine, arrivals, model)


def bench_events(lab: ModuleType, repeats: int = 9, baseline: str = EVENTS_BASELINE, log=print,
                 clock=time.perf_counter) -> str:
    """`python -m tools.bench events`: an engine of the module `lab` with no observer, the way
    every engine but the trace's runs, against the chapter before the events existed (`baseline`,
    from git) and against the same engine with an observer that does nothing (what sending the
    events costs). Each workload of `python solution.py trace`, and `busy_workload`, whole runs in
    turns, best of `repeats`; the outputs of every contestant are checked equal first."""
    say = Report(log)

    def run(module, workload, observer=None):
        engine = trace.build_engine(module, workload, observer=observer)
        return trace.drive(engine, module, workload)

    def tokens(steps):
        return [[(o.request_id, list(o.new_token_ids), o.finish_reason) for o in out] for out in steps]

    before = chapter_at(baseline)
    say(f"== The engine's events: no observer, against the chapter at {baseline} (before the events) and "
        f"against an observer that does nothing; whole runs in turns, best of {repeats} ==")
    if before is None:
        say(f"(no git history or no revision {baseline} here: the baseline column is left out)")
    say(f"{'workload':<17}{'steps':>6}{'before ms':>11}{'none ms':>9}{'no-op ms':>10}"
        f"{'none/before':>13}{'no-op/none':>12}")
    workloads = [get_workload(name) for name in WORKLOADS] + [busy_workload()]
    for workload in workloads:
        none = tokens(run(lab, workload))
        assert tokens(run(lab, workload, lambda e: None)) == none, f"{workload.name}: an observer changed outputs"
        if before is not None:
            assert tokens(run(before, workload)) == none, f"{workload.name}: the outputs differ from {baseline}'s"
        contestants = {"none": lambda: run(lab, workload), "no-op": lambda: run(lab, workload, lambda e: None)}
        if before is not None:
            contestants["before"] = lambda: run(before, workload)
        best = best_side_by_side(contestants, repeats, clock=clock)
        before_ms = f"{best['before'] * 1e3:.1f}" if before is not None else "-"
        none_vs_before = f"{best['none'] / best['before']:.3f}x" if before is not None else "-"
        say(f"{workload.name:<17}{len(none):>6}{before_ms:>11}{best['none'] * 1e3:>9.1f}"
            f"{best['no-op'] * 1e3:>10.1f}{none_vs_before:>13}{best['no-op'] / best['none']:>11.3f}x")
    sys.modules.pop("chapter_before_events", None)
    return say.text()
