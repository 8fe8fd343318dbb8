#!/usr/bin/env python3
"""Where a wrong answer's blame lands: plant a slip inside one exercise's code, run the whole suite
on it as a student with that slip runs it, and read the rows its failures count under.

CI proves the blame for every slip at once (tools/handout/half_way.py: no test of the provided
code runs an exercise's code, and no test runs an exercise past its row's). This tool shows it on
real runs, one slip at a time, about a minute each on 2 cores: a maintainers' tool, not CI's. A
slip is a planted mistake of mutants_chapter.py whose edit lies inside one exercise's solution
region (the others are slips in provided code, whose row should go red).

    python -m tools.checks.blame                 # every such slip (an hour or more)
    python -m tools.checks.blame -k residual     # those whose name contains a word
    python -m tools.checks.blame --sample 12     # 12 of them, spread over the exercises (seeded)

One line a slip: its exercise, the failures per row (`Ex 2` an exercise's own tests, `Ex 5+` the
provided code that runs Exercises 1-5, counted under Exercise 5) and the provided row; `ok` when the
blame held: the provided row whole, every failure under the slip's exercise or a later one, and
at least one failure (the slip was caught).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.checks.mutants_chapter import CHAPTER
from tools.handout.make_lab import BEGIN, END, ROOT


def regions(source: str) -> list[tuple[int, int, int]]:
    """(start, end, exercise): the character span of each solution region of `source`."""
    spans = []
    offset = 0
    start = None
    for line in source.splitlines(keepends=True):
        begin = BEGIN.match(line)
        if begin:
            start = offset + len(line)
            exercise = int(begin.group(2))
        elif END.match(line) and start is not None:
            spans.append((start, offset, exercise))
            start = None
        offset += len(line)
    return spans


def slips(source: str) -> list[tuple[str, int, str]]:
    """(name, exercise, mutated source) of every planted mistake inside one exercise's region."""
    found = []
    for name, _, old, new, *where in CHAPTER:
        if where or source.count(old) != 1:
            continue
        at = source.index(old)
        inside = [n for start, end, n in regions(source) if start <= at and at + len(old) <= end]
        if inside:
            found.append((name, inside[0], source.replace(old, new)))
    return found


def run(name: str, exercise: int, text: str, where: Path) -> tuple[bool, str, float]:
    """The whole suite on the slip: whether the blame held, and the rows its failures count under."""
    module = "slip_" + "".join(c if c.isalnum() else "_" for c in name)[:40]
    where.mkdir(parents=True)
    (where / f"{module}.py").write_text(text)
    report = where / "report.json"
    env = dict(os.environ, LAB_MODULE=module, LAB_REPORT=str(report), HYPOTHESIS_PROFILE="ci",
               PYTHONPATH=f"{where}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if not report.exists():
        return False, f"no report (pytest exited {proc.returncode}): {proc.stdout[-300:]}", seconds
    rows = json.loads(report.read_text())
    failed = [r for r in rows if r["outcome"] == "failed"]
    by_row = collections.Counter(f"Ex {r['row']}" + ("" if r["exercise"] else "+") for r in failed if r["row"])
    provided = [r for r in rows if not r["row"]]
    broken = [r["test"] for r in provided if r["outcome"] == "failed"]
    early = [r["test"] for r in failed if r["row"] and r["row"] < exercise]  # an earlier exercise's row
    held = bool(failed) and not broken and not early
    summary = ", ".join(f"{row}: {n}" for row, n in sorted(by_row.items(), key=lambda kv: (int(kv[0][3:].strip("+")),
                                                                                        kv[0]))) or "nothing failed"
    summary += f"; provided {len(provided) - len(broken)}/{len(provided)}"
    rules = {r["test"]: r["rule"] for r in rows}
    for test in (broken + early)[:3]:
        summary += f"\n   blamed elsewhere: {test}: {rules.get(test)}"
    return held, summary, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only the slips whose name contains this")
    parser.add_argument("--sample", type=int, help="this many slips, spread over the exercises")
    parser.add_argument("--seed", type=int, default=0, help="which sample (default 0)")
    parser.add_argument("-j", type=int, default=2, help="runs at a time (default 2)")
    args = parser.parse_args(argv)
    chosen = [s for s in slips((ROOT / "solution.py").read_text()) if args.k in s[0]]
    if args.sample:
        by_exercise = collections.defaultdict(list)
        for slip in random.Random(args.seed).sample(chosen, len(chosen)):
            by_exercise[slip[1]].append(slip)
        queues = [collections.deque(v) for _, v in sorted(by_exercise.items())]
        chosen = []
        while len(chosen) < args.sample and any(queues):  # one of each exercise in turn
            chosen += [q.popleft() for q in queues if q][: args.sample - len(chosen)]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, args.j)) as pool:
        runs = [pool.submit(run, name, n, text, Path(tmp) / str(i)) for i, (name, n, text) in enumerate(chosen)]
        for (name, n, _), future in zip(chosen, runs):
            held, summary, seconds = future.result()
            failed += not held
            print(f"{'ok' if held else '!!'} Exercise {n}: {name}: {summary}  ({seconds:.0f} s)", flush=True)
    print(f"{len(chosen)} slip(s), the blame held for {len(chosen) - failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
