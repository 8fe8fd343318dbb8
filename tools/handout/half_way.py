#!/usr/bin/env python3
"""The states a student sits in: the lab with Exercises 1..k written and the rest still stubs.

The promise is "red only where you still have to write" at every step, not only at the two ends
(all stubs, all written). State k is the lab with the bodies of Exercises 1..k taken from
solution.py and Exercises k+1..8 stubbed (tools/handout/make_lab.py's markers). In each state, the check
asks of the suite's report (LAB_REPORT, .ci/check_lab_report.py) that every failure is a stub's,
named by an exercise not yet written; that the provided code's tests pass; that every exercise
still stubbed has a red test; and that the scoreboard lists no failure pytest did not print.

    python -m tools.handout.half_way write K OUT.py          # the lab of state K, written to OUT.py
    python -m tools.handout.half_way check DIR               # every state 0..8 in DIR (the student's copy)
    python -m tools.handout.half_way check DIR --states 3 5  # only these

`check` runs in DIR with DIR's own virtual environment (DIR/.venv) when it has one: state 0 is
DIR's own lab.py (as the copy hands it out); state k > 0 is written to DIR/lab_k<k>.py and run as
LAB_MODULE=lab_k<k>. With `--graded ROOT` (the autograder zip unpacked in ROOT/source and set up
by its setup.sh: tools/handout/autograder.py), every state is submitted to the autograder instead, as
Gradescope would run it, and its report and grade are checked (Exercises 1..k full marks, the
others 0); state 0's submission is DIR's own lab.py. Two runs at a time (-j); one line a state
with its tests, its time and what failed the check. A maintainers' tool (it reads solution.py),
run by .ci/run on the copy.

Where a wrong answer's blame lands is proved the same way, once for every wrong answer: the last
state's lab is `instrumented`, each exercise's code recording which test ran it (pytest's
PYTEST_CURRENT_TEST: child processes inherit it, the server's engine thread reads it), and the
check asks that no test ran an exercise after the one whose row counts it. One more run, the
provided code's tests alone on that lab, proves that none of them runs any exercise's code, even
through what an earlier test computed and left behind. A slip can only change what runs its
exercise's code, so it cannot turn the provided row red (the shared servers are checked between
tests: tests/support.py's SharedServer).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.handout.make_lab import BEGIN, ROOT, make_lab, refresh_reading_map

CHECKER = ROOT / ".ci" / "check_lab_report.py"
# Defined in the instrumented lab, before its `__main__`; called first in every exercise's code.
RECORDER = '''
def _reached(exercise, _seen=set()):  # the instrumented lab's: tools/handout/half_way.py
    """Record that the test pytest is running ran Exercise `exercise`'s code (once a test). Outside
    every test (the scoreboard's speed line) nothing: no test's outcome can depend on it."""
    import json
    import os
    key = (os.environ.get("PYTEST_CURRENT_TEST"), exercise)
    if key[0] and key not in _seen:
        _seen.add(key)
        with open({log!r}, "a", encoding="utf-8") as records:
            records.write(json.dumps(key) + "\\n")


'''


def exercise_numbers(source: str) -> list[int]:
    return sorted({int(m.group(2)) for line in source.splitlines() if (m := BEGIN.match(line))})


def state(source: str, k: int) -> str:
    """The lab text with Exercises 1..k written (solution.py's bodies) and the others stubs."""
    numbers = exercise_numbers(source)
    if not 0 <= k <= max(numbers):
        raise ValueError(f"k must be 0..{max(numbers)}, not {k}")
    return refresh_reading_map(make_lab(source, only={str(n) for n in numbers if n > k}))


def instrumented(text: str, log: Path) -> str:
    """The lab `text` with every written exercise's code recording, as it runs, which test ran it:
    one line of JSON `[PYTEST_CURRENT_TEST, exercise]` a test and exercise, appended to `log`."""
    lines = []
    for line in text.splitlines(keepends=True):
        lines.append(line)
        begin = BEGIN.match(line)
        if begin:
            lines.append(f"{begin.group(1)}_reached({begin.group(2)})\n")
    text = "".join(lines)
    main = text.rindex('\nif __name__ == "__main__":')
    return text[:main] + RECORDER.format(log=str(log)) + text[main:]


def python_of(folder: Path) -> str:
    venv = folder / ".venv" / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    return str(venv) if venv.exists() else sys.executable


def run_checker(folder: Path, module: str, report: Path, log: Path, reach: Path | None = None
                ) -> subprocess.CompletedProcess:
    env = dict(os.environ, LAB_MODULE=module)
    argv = [python_of(folder), str(CHECKER), str(report), str(log), *(["--reach", str(reach)] if reach else [])]
    return subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)


def module_of(folder: Path, source: str, k: int, reach: Path | None = None) -> str:
    """The module of state k in `folder`: its own lab.py for 0 (checked to be the stubbed lab),
    else lab_k<k>.py, written (`instrumented`, recording into `reach`, when it is given)."""
    if k == 0:
        if (folder / "lab.py").read_text() != state(source, 0):
            raise ValueError("state 0: DIR/lab.py is not the stubbed lab that solution.py generates")
        return "lab"
    text = state(source, k)
    (folder / f"lab_k{k}.py").write_text(instrumented(text, reach) if reach else text)
    return f"lab_k{k}"


def reach_log(where: Path, source: str, k: int) -> Path | None:
    """Where the last state's instrumented lab records which test ran which exercise (None for the others)."""
    if k != max(exercise_numbers(source)):
        return None
    where.unlink(missing_ok=True)
    return where


def check_state(folder: Path, source: str, k: int, extra: list[str]) -> tuple[int, str, float]:
    """State k run in `folder` as a student runs it (`python -m pytest -q`, LAB_MODULE for k > 0),
    its report checked: (exit status, lines, seconds)."""
    reach = reach_log(folder / f".state_{k}.reach.jsonl", source, k)
    module = module_of(folder, source, k, reach)
    report, log = folder / f".state_{k}.json", folder / f".state_{k}.log"
    env = dict(os.environ, LAB_MODULE=module, LAB_REPORT=str(report), HYPOTHESIS_PROFILE="ci",
               PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([python_of(folder), "-m", "pytest", "-q", *extra], cwd=folder, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    text = log.read_text()
    final = text.strip().splitlines()[-1].strip("= ") if text.strip() else "(no output)"
    expected = 0 if k == max(exercise_numbers(source)) else 1
    if proc.returncode != expected or not report.exists():
        tail = "\n    ".join(text.strip().splitlines()[-30:])
        return 1, f"state {k}: pytest exited {proc.returncode}, expected {expected}:\n    {tail}", seconds
    check = run_checker(folder, module, report, log, reach)
    lines = f"state {k} in the copy ({module}, {seconds:.0f} s): {final}\n  {check.stdout.strip()}"
    if check.returncode == 0:
        for path in (report, log, reach):
            if path:
                path.unlink(missing_ok=True)
    return check.returncode, lines, seconds


def provided_alone(folder: Path, source: str) -> tuple[int, str, float]:
    """The provided code's tests alone (no exercise's row counts them), on the last state's lab
    `instrumented`: none of them may run any exercise's code, even through what another test left."""
    k = max(exercise_numbers(source))
    reach = reach_log(folder / ".provided.reach.jsonl", source, k)
    (folder / "lab_provided.py").write_text(instrumented(state(source, k), reach))
    report, log = folder / ".provided.json", folder / ".provided.log"
    rows = " or ".join(["needs", "reaches", *(f"exercise{n}" for n in exercise_numbers(source))])
    env = dict(os.environ, LAB_MODULE="lab_provided", LAB_REPORT=str(report), HYPOTHESIS_PROFILE="ci",
               PYTHONDONTWRITEBYTECODE="1")
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.run([python_of(folder), "-m", "pytest", "-q", "-m", f"not ({rows})"], cwd=folder, env=env,
                              stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    text = log.read_text()
    final = text.strip().splitlines()[-1].strip("= ") if text.strip() else "(no output)"
    if proc.returncode != 0 or not report.exists():
        tail = "\n    ".join(text.strip().splitlines()[-30:])
        return 1, f"the provided code's tests alone: pytest exited {proc.returncode}, expected 0:\n    {tail}", seconds
    check = run_checker(folder, "lab_provided", report, log, reach)
    lines = f"the provided code's tests alone, every exercise written ({seconds:.0f} s): {final}\n  " \
            f"{check.stdout.strip()}"
    if check.returncode == 0:
        for path in (report, log, reach, folder / "lab_provided.py"):
            path.unlink(missing_ok=True)
    return check.returncode, lines, seconds


def grade_state(folder: Path, graders: Path, source: str, k: int) -> tuple[int, str, float]:
    """State k submitted to the autograder unpacked in `graders` (its source/, set up by its
    setup.sh): the run's report checked as check_state's, and the grade: Exercises 1..k full
    marks, the others 0."""
    module = module_of(folder, source, k)
    root = graders.parent / f"{graders.name}-state{k}"
    shutil.rmtree(root, ignore_errors=True)
    (root / "submission").mkdir(parents=True)
    (root / "source").symlink_to(graders / "source", target_is_directory=True)
    reach = reach_log(root / "reach.jsonl", source, k)
    (root / "submission" / "lab.py").write_text(instrumented(state(source, k), reach) if reach else state(source, k))
    report = root / "report.json"
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), LAB_REPORT=str(report))
    start = time.perf_counter()
    run = subprocess.run(["bash", str(root / "source" / "run_autograder")], env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    results = root / "results" / "results.json"
    if run.returncode != 0 or not results.exists() or not report.exists():
        return 1, f"state {k} graded: run_autograder exited {run.returncode}:\n    {run.stdout[-2000:]}", seconds
    graded = json.loads(results.read_text())
    check = run_checker(folder, module, report, root / "results" / "pytest.log", reach)
    scores = [t["score"] for t in graded["tests"]]
    full = [t["max_score"] for t in graded["tests"]]
    want = [m if n <= k else 0 for n, m in enumerate(full, 1)]
    problems = [] if scores == want and graded["score"] == sum(want) else [
        f"FAIL: the grade is {graded['score']} ({scores}); Exercises 1..{k} written must score {sum(want)} ({want})"]
    lines = (f"state {k} graded by the autograder ({seconds:.0f} s): {graded['score']:g}/{graded['max_score']:g}\n  "
             + "\n  ".join([check.stdout.strip(), *problems]))
    code = check.returncode or bool(problems)
    if not code:
        shutil.rmtree(root)
    return code, lines, seconds


def guarded(fn, *args) -> tuple[int, str, float]:
    try:
        return fn(*args)
    except (ValueError, OSError) as exc:
        return 1, f"FAIL: {exc}", 0.0


def failed_states(results: dict) -> list[int]:
    return sorted({k for (k, kind), (code, _, _) in results.items() if code and kind != "provided"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    write = sub.add_parser("write", help="write the lab of state K (Exercises 1..K written) to OUT")
    write.add_argument("k", type=int)
    write.add_argument("out", type=Path)
    check = sub.add_parser("check", help="run and check every state in DIR (the student's copy)")
    check.add_argument("dir", type=Path)
    check.add_argument("--states", type=int, nargs="+", help="which k (default: 0..8)")
    check.add_argument("--graded", type=Path, metavar="ROOT",
                       help="an autograder unpacked in ROOT/source and set up: every state runs through it, its "
                            "report and grade checked")
    check.add_argument("-j", type=int, default=2, help="runs at a time (default 2)")
    check.add_argument("pytest_args", nargs="*", help="after --: passed on to pytest (runs in DIR only)")
    args = parser.parse_args(argv)
    source = (ROOT / "solution.py").read_text()
    if args.command == "write":
        try:
            args.out.write_text(state(source, args.k))
        except ValueError as exc:
            parser.error(str(exc))
        print(f"wrote {args.out}: Exercises 1..{args.k} written, the rest stubs")
        return 0
    states = args.states if args.states is not None else [0, *exercise_numbers(source)]
    folder = args.dir.resolve()
    jobs = {(k, "graded"): (grade_state, (folder, args.graded.resolve(), source, k)) for k in states} \
        if args.graded else {}
    jobs |= {(k, "copy"): (check_state, (folder, source, k, args.pytest_args)) for k in states
             if not args.graded}
    if max(exercise_numbers(source)) in states:  # the shortest run: last
        jobs[(-1, "provided")] = (provided_alone, (folder, source))
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.j) as pool:
        # The slowest (most exercises written: the server's tests run) first, so that the
        # workers finish together.
        futures = {key: pool.submit(guarded, fn, *fargs) for key, (fn, fargs) in sorted(jobs.items(), reverse=True)}
        results = {key: futures[key].result() for key in sorted(jobs)}
    for k in set(states) - set(failed_states(results)) - {0}:
        (folder / f"lab_k{k}.py").unlink(missing_ok=True)
    for _, lines, _ in results.values():
        print(lines)
    failed = failed_states(results)
    alone = results.get((-1, "provided"))
    print(f"half-way states {sorted(states)}: {len(states) - len(failed)} honest, failed {failed or 'none'}"
          + (f"; the provided code's tests alone ran no exercise's code: {alone[0] == 0}" if alone else "")
          + f" ({len(jobs)} runs, {time.perf_counter() - start:.0f} s wall, "
          f"{sum(s for _, _, s in results.values()):.0f} s of runs, {args.j} at a time)")
    return 1 if failed or (alone and alone[0]) else 0


if __name__ == "__main__":
    sys.exit(main())
