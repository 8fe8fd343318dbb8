"""Test-suite plumbing: which module is under test, hypothesis profiles, the scoreboard.

- `LAB_MODULE` names the module under test (default `lab`); tests use it as
  `from conftest import lab`.
- `HYPOTHESIS_PROFILE=ci` picks the derandomised profile (no deadline, no example database);
  the default profile is fast, for the student loop.
- A test that fails because a stub raised NotImplementedError is counted, not printed: it shows
  as `w` in the progress line and as "N on stubs" in the final count (`-v` prints each, in one
  line that names the exercise and the function to write). It still fails the run.
- A test of provided code that runs the exercises' code (the server, a child process, the command
  line, the pages) is marked by the last exercise it runs: `needs(N)` when a stub's error would
  stop it (it comes back as an HTTP 500 or a child's stderr), `reaches(N)` when the provided code
  says itself which stub it met and the test checks that. A `needs(N)` test waits while Exercise
  N or an earlier one is a stub (`course.status.unsolved_exercises`): it is not run, and counts
  as on that stub, the earliest one. Once 1..N are written it runs, and a failure is a failure.
  Either counts under Exercise N's row, never under the provided code's: a wrong answer that
  breaks it is the exercise's, and the row names the earliest of Exercises 1..N whose own tests
  fail. CI proves that no test counted under the provided code runs an exercise's code.
- At the end of every run, a scoreboard: one line per exercise, passed/total, the functions still
  to write and the tests that fail for another reason, then the provided code that runs it (pytest's
  short summary lists skips alone, each with its reason: `-rs` in pyproject.toml; its failure lines
  are cut to the terminal's width).
- Once every Exercise 4 test passes, the scoreboard also shows the kernel's speed against
  contiguous attention, measured here in well under a second and never asserted.
- Hypothesis writes no `.hypothesis/patches` file and prints no "git apply" footer.
- `--grade results.json` writes the scoreboard as a Gradescope autograder result: one test a
  exercise, scored by the share of its tests that passed (each of them fails while the exercise is
  a stub: CI checks it), each failed test with the first line of its rule.
- `-m exerciseN` collects only the test files that mark tests with an exercise (test_lab.py and
  the few in tests/ that do): the rest would be deselected anyway, and importing them cost most of
  one exercise's run.
- `LAB_REPORT=path.json` writes every test's outcome, exercise, marks, row and whether it hit a
  stub (CI uses it to prove the lab is red only on stubs, and which rows a test may run).
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, settings

from course.status import unsolved_exercises
from measure.timing import best_side_by_side

LAB_MODULE = os.environ.get("LAB_MODULE", "lab")
STUB = re.compile(r"^Exercise (\d+): (\S+)$")

try:
    lab = importlib.import_module(LAB_MODULE)
    _IMPORT_ERROR = None
except ModuleNotFoundError as exc:
    if exc.name != LAB_MODULE:
        raise
    lab = None
    _IMPORT_ERROR = f"LAB_MODULE={LAB_MODULE!r}: no module of that name here (try lab or solution)"

# The exercises still stubs, read once a run (the module does not change while it runs).
UNSOLVED = unsolved_exercises(lab) if lab is not None else {}

# No "explain" phase: it slows down every failing run, and in the student loop most failures are stubs.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
# The exercises' titles come from the module itself ("blocks and the allocator: ..." -> the part before ":").
EXERCISES = {n: title.split(":")[0] for n, title in getattr(lab, "EXERCISES", {}).items()}

# report_multiple_bugs=False: a wrong solution gets one failing example, not an exception group.
settings.register_profile("default", max_examples=40, deadline=None, phases=_PHASES, report_multiple_bugs=False,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, database=None,
                          phases=_PHASES, report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_EXERCISE_OF: dict[str, int | None] = {}  # nodeid -> exercise number (None: provided code)
_NEEDS: dict[str, int | None] = {}  # nodeid -> the exercise a test of provided code waits for (`needs(N)`), or None
_REACHES: dict[str, int | None] = {}  # nodeid -> the last exercise a test of provided code runs (`reaches(N)`), or None
_RESULTS: dict[str, tuple[int | None, str, bool]] = {}  # nodeid -> (exercise, outcome, failed on a stub)
_STUB_OF: dict[str, tuple[int, str]] = {}  # nodeid -> (exercise, function) of the stub it hit
_SELECTED: dict[int | None, int] = {}  # exercise -> how many of its tests this run selected
_RULE: dict[str, str] = {}  # nodeid -> the first line of its failure's message (the rule it names)
RULE_CHARS = 300  # a rule's line, as the grade file carries it, at most this long


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--grade", metavar="RESULTS_JSON", default=None,
                     help="write the scoreboard as a Gradescope results.json (one test a exercise)")


def pytest_configure(config: pytest.Config) -> None:
    if _IMPORT_ERROR:
        raise pytest.UsageError(_IMPORT_ERROR)
    if config.getoption("--grade") and "HYPOTHESIS_PROFILE" not in os.environ:
        settings.load_profile("ci")  # a grade is derandomised: the same code, the same grade
    # One home for the list of exercises: the module's EXERCISES names the markers too.
    for number, title in EXERCISES.items():
        config.addinivalue_line("markers", f"exercise{number}: Exercise {number}, {title}")
    config.addinivalue_line("markers", "provided: provided code the exercises build on (green from the start)")
    config.addinivalue_line("markers", "needs(n): provided code (serving/, the command line) that runs the code of "
                                       "exercises 1..n: waits while one is a stub, green once they are written")
    config.addinivalue_line("markers", "reaches(n): provided code that runs the code of exercises 1..n where they are "
                                       "written, and says which stub it met where not: green at every step")
    config.addinivalue_line("markers", "reference: reads solution.py, so runs only in the maintainers' checkout")


def pytest_report_header(config: pytest.Config) -> str:
    return f"module under test: {LAB_MODULE} ({getattr(lab, '__file__', '?')})"


def exercise_of(item: pytest.Item) -> int | None:
    for mark in item.iter_markers():
        if mark.name.startswith("exercise") and mark.name[8:].isdigit():
            return int(mark.name[8:])
    return None


def needs_of(item: pytest.Item, name: str = "needs") -> int | None:
    mark = item.get_closest_marker(name)
    return None if mark is None else int(mark.args[0])


def row_of(nodeid: str) -> int | None:
    """The exercise whose row counts a test: its own exercise, else the last one it runs through
    provided code (`needs`, `reaches`); None for the provided code's own tests."""
    return _EXERCISE_OF.get(nodeid) or _NEEDS.get(nodeid) or _REACHES.get(nodeid)


def stub_hit(excinfo: pytest.ExceptionInfo | None) -> re.Match | None:
    """The stub's message if this failure is a stub's NotImplementedError (or, when Hypothesis
    found several distinct failures and raised them as a group, if every one of them is)."""
    if excinfo is None:
        return None
    errors = [excinfo.value]
    found = []
    while errors:
        error = errors.pop(0)
        if getattr(error, "exceptions", None):  # an exception group: look at its members
            errors.extend(error.exceptions)
        elif isinstance(error, NotImplementedError) and STUB.match(str(error)):
            found.append(STUB.match(str(error)))
        else:
            return None
    return min(found, key=lambda m: int(m.group(1)), default=None)  # the earliest exercise first


def waits_for(item: pytest.Item) -> tuple[int, str] | None:
    """(exercise, function) of the earliest stub a `needs(N)` test waits for: the first function
    still to write of the first unsolved exercise in 1..N; None when it can run."""
    needed = _NEEDS.get(item.nodeid)
    waiting = [n for n in sorted(UNSOLVED) if needed is not None and n <= needed]
    return (waiting[0], UNSOLVED[waiting[0]][0]) if waiting else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A `needs(N)` test waits while an exercise it needs is a stub: it fails here as that stub,
    before its fixtures start a server (the hooks after this one do not run)."""
    stub = waits_for(item)
    if stub:
        raise NotImplementedError(f"Exercise {stub[0]}: {stub[1]}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A stub's failure becomes one line, built here so that pytest never formats (and then
    throws away) its traceback: the all-red first run stays fast."""
    # unittest-style items (hypothesis state machines) keep their exception on the item.
    pending = getattr(item, "_excinfo", None)
    # Hypothesis turns failing examples into a patch file and a "git apply .hypothesis/patches/..."
    # footer (its pytest plugin reads this attribute after us); meaningless to a student: drop it.
    item.__dict__.pop("_hypothesis_failing_examples", None)
    excinfo = pending[0] if pending else call.excinfo
    stub = stub_hit(excinfo)
    if not stub:
        if excinfo is not None and not excinfo.errisinstance((pytest.skip.Exception, pytest.xfail.Exception)):
            _RULE.setdefault(item.nodeid, first_line(excinfo))
        return None  # pytest's own report
    if pending:
        pending.pop(0)  # reported here, so it must not come back at teardown
    _STUB_OF[item.nodeid] = (int(stub.group(1)), stub.group(2))
    return pytest.TestReport(
        item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
        f"Exercise {stub.group(1)} is not done yet: write {stub.group(2)} in {LAB_MODULE}.py",
        call.when, [], call.duration, start=call.start, stop=call.stop, user_properties=item.user_properties,
    )


def pytest_report_teststatus(report: pytest.TestReport, config: pytest.Config):
    """A stub's failure is a to-do, not a bug: counted ("N on stubs", `w` in the progress line) and
    left out of the failures printed above the scoreboard, unless `-v` asks for each one."""
    if report.failed and report.nodeid in _STUB_OF:
        if config.get_verbosity() <= 0:
            return "on stubs", "w", "STUB"
        if report.when == "setup":  # a needs(N) test that waits: a failure on that stub, not an error
            return "failed", "F", "WAITING"
    return None


def first_line(excinfo: pytest.ExceptionInfo) -> str:
    """The first line of a failure's message: the rule a test names (`AssertionError: ` dropped),
    capped at RULE_CHARS."""
    error = excinfo.value
    while getattr(error, "exceptions", None):  # a group (Hypothesis): its first member
        error = error.exceptions[0]
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    line = text if isinstance(error, AssertionError) and text else f"{type(error).__name__}: {text}".rstrip(": ")
    return line if len(line) <= RULE_CHARS else line[:RULE_CHARS - 3] + "..."


# -m exerciseN: a test file that marks no test with an exercise is not even imported.
_MARKS_AN_EXERCISE = re.compile(r"mark\.exercise\d|mark, f\"exercise")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not re.fullmatch(r"exercise\d+( or exercise\d+)*", (config.option.markexpr or "").strip()):
        return None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return not _MARKS_AN_EXERCISE.search(collection_path.read_text()) or None
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "call" and not report.failed:
        return
    results = _RESULTS
    previous = results.get(report.nodeid)
    if previous is None or previous[1] == "passed":
        stub = report.failed and isinstance(report.longrepr, str) and "is not done yet" in report.longrepr
        results[report.nodeid] = (_EXERCISE_OF.get(report.nodeid), report.outcome, stub)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _EXERCISE_OF.update({item.nodeid: exercise_of(item) for item in items})
    _NEEDS.update({item.nodeid: needs_of(item) for item in items})
    _REACHES.update({item.nodeid: needs_of(item, "reaches") for item in items})
    # A property test of an exercise that is still a stub fails on its first example; shrinking
    # that failure only costs the student seconds. Those tests skip the shrink phase.
    stubbed = set(UNSOLVED)
    for item in items:
        test = getattr(item, "obj", None)
        current = getattr(test, "_hypothesis_internal_use_settings", None)  # Hypothesis' own attribute
        needed = _EXERCISE_OF[item.nodeid] or _NEEDS[item.nodeid]
        if needed in stubbed and inspect.isfunction(test) and current is not None:
            test._hypothesis_internal_use_settings = settings(current, phases=[Phase.explicit, Phase.generate])


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # after -k / -m deselection
        number = _EXERCISE_OF.get(item.nodeid)
        _SELECTED[number] = _SELECTED.get(number, 0) + 1


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config):
    """The scoreboard comes after pytest's own summary (the outermost wrapper finishes last),
    right above the final count, where a student looks."""
    yield
    _scoreboard(terminalreporter)


def exercise_rows() -> list[dict]:
    """One row a exercise that ran: passed/total of its own tests, the functions still to write
    (what `status` knows, then the earlier exercises' stubs its tests hit) and the tests that
    failed otherwise; under `running`, the same of the provided code's tests it counts (`needs`,
    `reaches`: they run Exercises 1..N), and `blame`, the earliest of those exercises whose own
    tests fail. The scoreboard prints these rows and `--grade` writes them: one home for both."""
    rows = {}
    for number, title in EXERCISES.items():
        mine = {k: r for k, r in _RESULTS.items() if r[0] == number}
        running = {k: r for k, r in _RESULTS.items() if r[0] is None and row_of(k) == number}
        if not mine and not running:
            continue
        hit = [_STUB_OF[k] for k, r in mine.items() if r[2] and k in _STUB_OF]
        earlier = dict.fromkeys(f"{name} (Exercise {n})" for n, name in sorted(hit) if n != number)
        rows[number] = {"number": number, "title": title, **_tally(mine),
                        "to_write": UNSOLVED.get(number, []) + list(earlier),
                        "running": _tally(running) if running else None}
    for row in rows.values():
        if row["running"] and row["running"]["failed"]:
            row["running"]["blame"] = _blame(row["number"], rows)
    return list(rows.values())


def _tally(results: dict) -> dict:
    """passed/total of some tests, how many failed on a stub, the stubs they met (earliest
    first), and the tests that failed for another reason."""
    return {"total": len(results), "passed": sum(r[1] == "passed" for r in results.values()),
            "on_stubs": sum(r[2] for r in results.values()),
            "stubs": sorted({_STUB_OF[k] for k, r in results.items() if r[2] and k in _STUB_OF}),
            "failed": [k for k, r in results.items() if r[1] == "failed" and not r[2]]}


def _blame(number: int, rows: dict) -> str:
    """Where a failure of provided code that runs Exercises 1..number points the student: at the
    earliest of them whose own tests fail in this run."""
    span = "Exercise 1" if number == 1 else f"Exercises 1-{number}"
    broken = [n for n in range(1, number + 1) if n in rows and rows[n]["failed"]]
    if broken:
        return (f"Exercise {broken[0]} fails tests of its own: fix it first "
                f"(python -m pytest -m exercise{broken[0]})")
    if all(n in rows and rows[n]["total"] == _SELECTED.get(n) for n in range(1, number + 1) if n in EXERCISES):
        return f"{span} pass their own tests: the rule it names, above, is one they do not check"
    return (f"it runs {span}: python -m pytest -m \"{' or '.join(f'exercise{n}' for n in range(1, number + 1))}\" "
            "shows which of them fails")


def scoreboard_line(row: dict) -> str:
    line = f"Exercise {row['number']} ({row['title']}): {row['passed']}/{row['total']}"
    if row["total"] and row["passed"] == row["total"]:
        line += " done"
    if row["on_stubs"]:
        line += f", {row['on_stubs']} on stubs"
    if row["to_write"]:
        line += f"; write {', '.join(row['to_write'])} in {LAB_MODULE}.py"
    return line


def running_line(row: dict) -> str:
    """The line of the provided code's tests counted under an exercise: they run Exercises 1..N."""
    running, number = row["running"], row["number"]
    span = "Exercise 1" if number == 1 else f"Exercises 1-{number}"
    line = f"provided code running {span} (the server, the command line): {running['passed']}/{running['total']}"
    if running["stubs"]:
        line += f", waiting for {_stub_names(running['stubs'])}"
    if running.get("blame"):
        line += f"; {running['blame']}"
    return line


def _scoreboard(terminalreporter) -> None:
    results = _RESULTS
    if not results:
        return
    terminalreporter.section(f"scoreboard ({LAB_MODULE})")
    for row in exercise_rows():
        indent = ""
        if row["total"]:
            terminalreporter.write_line(scoreboard_line(row))
            _list_failures(terminalreporter, row["failed"])
            if row["number"] == 4 and row["passed"] == row["total"] == _SELECTED.get(4):
                for text in exercise4_speed():
                    terminalreporter.write_line(f"  {text}")
            indent = "  "
        if row["running"]:
            terminalreporter.write_line(indent + running_line(row))
            _list_failures(terminalreporter, row["running"]["failed"])
    provided = {k: r for k, r in results.items() if row_of(k) is None}
    if provided:
        passed = sum(r[1] == "passed" for r in provided.values())
        line = f"provided code (nothing to write): {passed}/{len(provided)}"
        stubs = sorted({_STUB_OF[k] for k, r in provided.items() if r[2] and k in _STUB_OF})
        if stubs:  # a test of provided code that reaches a stub, unmarked: say so, never "failed"
            line += f", {sum(r[2] for r in provided.values())} on stubs ({_stub_names(stubs)})"
        terminalreporter.write_line(line)
        _list_failures(terminalreporter, [k for k, r in provided.items() if r[1] == "failed" and not r[2]])
    if any(r[2] for r in results.values()) and terminalreporter.config.get_verbosity() <= 0:
        terminalreporter.write_line("(failures on stubs are counted, not printed: -v prints each)")
    path = os.environ.get("LAB_REPORT")
    if path:
        rows = [{"test": k, "exercise": e, "needs": _NEEDS.get(k), "reaches": _REACHES.get(k), "row": row_of(k),
                 "outcome": o, "stub": s, "stub_of": _STUB_OF[k][0] if s and k in _STUB_OF else None,
                 "rule": _RULE.get(k)}
                for k, (e, o, s) in results.items()]
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)
    grade = terminalreporter.config.getoption("--grade")
    if grade:
        write_grade(grade, exercise_rows())
        terminalreporter.write_line(f"grade written to {grade}")


GRADE_PER_EXERCISE = 10  # points of each exercise in `--grade`'s file (the autograder's points.json can change them)
GRADE_FAILURES = 10  # failed tests an exercise's output names, each with its rule's first line


def write_grade(path: str, rows: list[dict]) -> None:
    """A Gradescope autograder result (`score`, `max_score`, `tests` with `name`, `score`,
    `max_score`, `output`, `extra_data`): one test a exercise, its output the scoreboard's line and
    the tests that failed other than on a stub, each with the first line of its rule (up to
    GRADE_FAILURES), then the line of the provided code that runs it (not graded). An exercise
    scores GRADE_PER_EXERCISE points times the share of its own tests that pass (`extra_data`
    holds passed and total, for a grader that weighs the exercises otherwise): every one of them
    fails while the exercise is a stub (a test that passes anyway tests provided code and is marked
    `needs`, not with the exercise: CI holds it), so a stub scores 0 and a
    half-written exercise part of its points. An exercise none of whose tests ran scores 0 and says so."""
    ran = {row["number"]: row for row in rows if row["total"]}
    tests = []
    for number, title in EXERCISES.items():
        row = ran.get(number)
        if row is None:
            passed = 0
            total = 0
            output = "no test of this exercise ran (was it deselected with -m or -k?)"
        else:
            passed, total, failed = row["passed"], row["total"], row["failed"]
            more = [f"... and {len(failed) - GRADE_FAILURES} more failed tests"] if len(failed) > GRADE_FAILURES else []
            running = [running_line(row) + " (not graded)"] if row["running"] else []
            output = "\n".join([scoreboard_line(row)] + [failure_line(k) for k in failed[:GRADE_FAILURES]] + more
                               + running)
        tests.append({"name": f"Exercise {number}: {title}", "score": round(GRADE_PER_EXERCISE * passed / total, 2)
                      if total else 0.0, "max_score": GRADE_PER_EXERCISE, "output": output,
                      "extra_data": {"passed": passed, "total": total}})
    result = {"score": round(sum(t["score"] for t in tests), 2), "max_score": GRADE_PER_EXERCISE * len(tests),
              "output": f"module graded: {LAB_MODULE}; each exercise scores {GRADE_PER_EXERCISE} points times the "
                        "share of its own tests that pass", "tests": tests}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")


def failure_line(nodeid: str) -> str:
    """`failed: <test>: <the first line of its rule>` (the grade file's line for a failed test)."""
    rule = _RULE.get(nodeid)
    return f"failed: {nodeid.split('::', 1)[-1]}" + (f": {rule}" if rule else "")


def _stub_names(stubs: list[tuple[int, str]]) -> str:
    return ", ".join(f"{name} (Exercise {n})" for n, name in stubs)


def _list_failures(terminalreporter, nodeids: list[str], most: int = 5) -> None:
    """Tests that failed for a reason other than a stub, by name (the name says the rule): pytest
    printed each of them above, so "see above" holds."""
    for nodeid in nodeids[:most]:
        terminalreporter.write_line(f"  failed: {nodeid.split('::', 1)[-1]}")
    if len(nodeids) > most:
        terminalreporter.write_line(f"  ... and {len(nodeids) - most} more failed (see above)")


# --- Exercise 4: how fast the kernel is, shown once its tests pass, never asserted --------------
#
# A timed assertion would be flaky (a loaded machine, a slow laptop); a ratio against contiguous
# attention on the same data, measured side by side, is stable enough to read and to tell a
# vectorised kernel from a Python loop over tokens. The shape is small so that it all takes well
# under a second: batch 32, 256 tokens, 4 heads x 32, block size 16 (8 MiB of K+V). Measured on
# 2 cores, loaded or not: a kernel vectorised over the tokens of a block 1.6-2.8x, a loop over
# sequences ~3x, Python loops over tokens (heads vectorised) 33-94x, over tokens and heads ~900x.
SPEED_SHAPE = dict(batch=32, context_len=256, n_head=4, head_dim=32, block_size=16)
LOOKS_LIKE_A_LOOP = 10.0  # paged / contiguous at or above this: named a Python loop over tokens


def exercise4_speed() -> list[str]:
    """The scoreboard's lines on the module's paged_attention: its time over contiguous attention's."""
    batch, context_len, n_head, head_dim, block_size = SPEED_SHAPE.values()
    rng = np.random.default_rng(0)
    per_seq = -(-context_len // block_size)
    num_blocks = batch * per_seq + 8
    shape = (num_blocks, block_size, n_head, head_dim)
    k_cache = rng.standard_normal(shape, dtype=np.float32)
    v_cache = rng.standard_normal(shape, dtype=np.float32)
    tables = rng.permutation(num_blocks)[:batch * per_seq].reshape(batch, per_seq)  # shuffled blocks
    lens = np.full(batch, context_len)
    q = rng.standard_normal((batch, n_head, head_dim), dtype=np.float32)
    k_dense = k_cache[tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    v_dense = v_cache[tables].reshape(batch, -1, n_head, head_dim)[:, :context_len].copy()
    where = (f"batch {batch}, {context_len} tokens, {n_head} heads x {head_dim}, block size {block_size}; "
             f"full benchmark: python {LAB_MODULE}.py bench attention")
    try:  # the reference kernels: tools/benchmarks/bench_attention.py imports no module under test
        from tools.benchmarks.bench_attention import contiguous_decode_attention, per_token_loop_attention
    except ImportError as exc:  # a copy of the lab without tools/: the scoreboard still ends
        return [f"speed: not measured: the reference kernels could not be imported ({exc})"]
    dense = lambda: contiguous_decode_attention(q, k_dense, v_dense)
    loop = lambda: per_token_loop_attention(q[:1], k_cache, v_cache, tables[:1], lens[:1])
    fns = {"dense": dense, "loop": loop}
    try:
        # First 2 sequences only: a kernel that loops over tokens and heads would take seconds on
        # all 32. A slow one is timed on those 2 and scaled; a fast one on the whole batch.
        probe = lambda: lab.paged_attention(q[:2], k_cache, v_cache, tables[:2], lens[:2])
        start = time.perf_counter()
        out = probe()
        t = {}
        if (time.perf_counter() - start) * batch / 2 > 0.1:
            t["paged"] = best_side_by_side({"probe": probe}, 2, warm_up=False)["probe"] * batch / 2
        else:
            fns["paged"] = lambda: lab.paged_attention(q, k_cache, v_cache, tables, lens)
            out = fns["paged"]()
        if not np.allclose(out, dense()[:len(out)], atol=1e-4):
            return [f"speed: not measured: paged_attention disagrees with contiguous attention ({where})"]
        t |= best_side_by_side(fns, 15, warm_up=False, budget=0.3)
    except Exception as exc:  # feedback only: never fail or break the run
        return [f"speed: not measured: paged_attention raised {type(exc).__name__}: {exc} ({where})"]
    ratio, loop_ratio = t["paged"] / t["dense"], t["loop"] * batch / t["dense"]
    # Named a loop only when it is both far off contiguous attention and near the measured loop:
    # on a loaded machine one slow timing of a vectorised kernel must not earn that verdict.
    if ratio >= max(LOOKS_LIKE_A_LOOP, loop_ratio / 3):
        return [f"speed: your paged_attention looks like a Python loop over tokens ({ratio:.0f}x slower than "
                f"contiguous attention): vectorise over the tokens of a block",
                f"       ({where})"]
    # What it compares: the kernel against one contiguous (gathered-in-advance) K/V, on a small
    # shape, best of a few runs on a shared machine. Correct vectorised kernels land anywhere from
    # ~2x to ~10x here (the gather through the table is most of the cost, and timings move by
    # tens of percent between runs); only the loop's order of magnitude is a verdict.
    return [f"speed: your paged_attention takes {ratio:.1f}x the time of contiguous attention (noisy: a correct "
            f"vectorised kernel takes ~2-10x); a Python loop over tokens takes ~{loop_ratio:.0f}x",
            f"       ({where})"]
