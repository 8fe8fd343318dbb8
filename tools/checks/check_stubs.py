#!/usr/bin/env python3
"""With one exercise stubbed at a time, every red test must fail on that exercise's stub.

CI checks the states a student moves through in order, Exercises 1..k written and the rest stubs
(tools/handout/half_way.py). This tool checks a student who skipped one: for each exercise N, the lab
with only N stubbed, the suite run on it, and every test that fails for a reason other than a
stub reported (a server test that reads an error event mid-stream as a broken stream, say), and
any exercise whose stub no test reaches. It takes about a minute per exercise, two at a time: a
maintainer's check, not CI's.

    python -m tools.checks.check_stubs          # every exercise
    python -m tools.checks.check_stubs 4 5      # only these
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.handout.make_lab import BEGIN, ROOT, make_lab


def exercises(source: str) -> list[str]:
    return sorted({m.group(2) for line in source.splitlines() if (m := BEGIN.match(line))}, key=int)


def check_one(exercise: str, source: str, workdir: Path) -> list[str]:
    """The problems of the suite against the lab with only `exercise` stubbed."""
    module = f"lab_only_{exercise}"
    (workdir / f"{module}.py").write_text(make_lab(source, only={exercise}))
    report = workdir / f"{module}.json"
    env = dict(os.environ, LAB_MODULE=module, LAB_REPORT=str(report), HYPOTHESIS_PROFILE="ci",
               PYTHONPATH=f"{workdir}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_lab.py", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    if not report.exists():
        return [f"pytest exited {proc.returncode} without a report: {proc.stdout[-300:]}"]
    rows = json.loads(report.read_text())
    problems = [f"{r['test']} fails, not on a stub" for r in rows
                if r["outcome"] == "failed" and not (r["stub"] and (r["exercise"] or r.get("needs")))]
    if not any(r["outcome"] == "failed" and r["stub"] for r in rows):
        problems.append("no test reaches its stub")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("exercise", nargs="*", help="exercise numbers (default: all)")
    parser.add_argument("-j", type=int, default=2, help="suites run at a time")
    args = parser.parse_args(argv)
    source = (ROOT / "solution.py").read_text()
    chosen = args.exercise or exercises(source)
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        results = dict(zip(chosen, pool.map(lambda n: check_one(n, source, Path(tmp)), chosen)))
    for exercise, problems in results.items():
        print(f"Exercise {exercise} alone stubbed: " + ("every red test fails on its stub" if not problems else
                                                          "\n  " + "\n  ".join(problems)))
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
