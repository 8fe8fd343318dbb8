"""Test-suite plumbing: which module is under test, hypothesis profiles, the scoreboard.

- `LAB_MODULE` names the module under test (default `lab`); tests use it as
  `from conftest import lab`.
- `HYPOTHESIS_PROFILE=ci` picks the derandomised profile (no deadline, no example database);
  the default profile is fast, for the student loop.
- A test that fails because a stub raised NotImplementedError is reported in one line that
  names the exercise and the function to write.
- At the end of every run, a scoreboard: one line per exercise, passed/total.
- `LAB_REPORT=path.json` writes every test's outcome, exercise and whether it hit a stub
  (`.ci/run` uses it to prove the lab is red only on stubs).
"""

from __future__ import annotations

import importlib
import json
import os
import re

import pytest
from hypothesis import HealthCheck, Phase, settings

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

# No "explain" phase: it slows down every failing run, and in the student loop most failures are stubs.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink]
# The exercises' titles come from the module itself ("blocks and the allocator: ..." -> the part before ":").
EXERCISES = {n: title.split(":")[0] for n, title in getattr(lab, "EXERCISES", {}).items()}

settings.register_profile("default", max_examples=40, deadline=None, phases=_PHASES,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=60, deadline=None, derandomize=True, database=None,
                          phases=_PHASES, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


_EXERCISE_OF: dict[str, int | None] = {}  # nodeid -> exercise number (None: provided code)
_RESULTS: dict[str, tuple[int | None, str, bool]] = {}  # nodeid -> (exercise, outcome, failed on a stub)


def pytest_configure(config: pytest.Config) -> None:
    if _IMPORT_ERROR:
        raise pytest.UsageError(_IMPORT_ERROR)


def pytest_report_header(config: pytest.Config) -> str:
    return f"module under test: {LAB_MODULE} ({getattr(lab, '__file__', '?')})"


def exercise_of(item: pytest.Item) -> int | None:
    for mark in item.iter_markers():
        if mark.name.startswith("exercise") and mark.name[8:].isdigit():
            return int(mark.name[8:])
    return None


def stub_hit(excinfo: pytest.ExceptionInfo | None) -> re.Match | None:
    """The stub's message if this failure is a stub's NotImplementedError."""
    if excinfo is None or not excinfo.errisinstance(NotImplementedError):
        return None
    return STUB.match(str(excinfo.value))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A stub's failure becomes one line, built here so that pytest never formats (and then
    throws away) its traceback: the all-red first run stays fast."""
    # unittest-style items (hypothesis state machines) keep their exception on the item.
    pending = getattr(item, "_excinfo", None)
    stub = stub_hit(pending[0] if pending else call.excinfo)
    if not stub:
        return None  # pytest's own report
    if pending:
        pending.pop(0)  # reported here, so it must not come back at teardown
    return pytest.TestReport(
        item.nodeid, item.location, {k: 1 for k in item.keywords}, "failed",
        f"Exercise {stub.group(1)} is not done yet: write {stub.group(2)} in {LAB_MODULE}.py",
        call.when, [], call.duration, start=call.start, stop=call.stop, user_properties=item.user_properties,
    )


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


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config):
    """The scoreboard comes after pytest's own summary (the outermost wrapper finishes last),
    right above the final count, where a student looks."""
    yield
    _scoreboard(terminalreporter)


def _scoreboard(terminalreporter) -> None:
    results = _RESULTS
    if not results:
        return
    terminalreporter.section(f"scoreboard ({LAB_MODULE})")
    for number, title in EXERCISES.items():
        mine = [r for r in results.values() if r[0] == number]
        if not mine:
            continue
        passed = sum(r[1] == "passed" for r in mine)
        stubs = sum(r[2] for r in mine)
        mark = "done" if passed == len(mine) else (f"{stubs} on stubs" if stubs else "")
        terminalreporter.write_line(f"Exercise {number} ({title}): {passed}/{len(mine)} {mark}".rstrip())
    provided = [r for r in results.values() if r[0] is None]
    if provided:
        passed = sum(r[1] == "passed" for r in provided)
        terminalreporter.write_line(f"provided code (nothing to write): {passed}/{len(provided)}")
    path = os.environ.get("LAB_REPORT")
    if path:
        rows = [{"test": k, "exercise": e, "outcome": o, "stub": s} for k, (e, o, s) in results.items()]
        with open(path, "w") as fh:
            json.dump(rows, fh, indent=1)
