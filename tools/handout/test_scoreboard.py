"""conftest.py's accounting, on a lab of one exercise and a handful of tests made to fail each way:
a stub's failure is counted, not printed; a `needs(N)` test waits (is not run) while N is a stub;
a test of provided code that runs an exercise counts under that exercise's row, pointing at the
exercise whose own tests fail; the scoreboard lists only the failures pytest printed, and its
"... and N more" counts them; the grade carries each failed test's rule; LAB_REPORT says which
stub each test waits for; and CI's instrumented run (tools/handout/half_way.py, checked by
.ci/check_lab_report.py --reach) catches a provided code's test that runs an exercise."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools.handout.half_way import instrumented

ROOT = Path(__file__).resolve().parents[2]

TINY_LAB = '''
EXERCISES = {1: "the one: double, half"}


def double(x):
    """Exercise 1."""
    # BEGIN SOLUTION: Exercise 1
    {double}
    # END SOLUTION


def half(x):
    if x < 0:
        raise ValueError("x must be >= 0")
    # BEGIN SOLUTION: Exercise 1
    {half}
    # END SOLUTION


def quadruple(x):
    """Provided code that runs Exercise 1's code, and says None where it meets the stub."""
    try:
        return double(double(x))
    except NotImplementedError:
        return None


if __name__ == "__main__":
    print(quadruple(1))
'''

TESTS = '''
import pytest
from conftest import lab

RAN = __import__("pathlib").Path(__file__).parent / "ran"


@pytest.mark.exercise1
def test_double():
    assert lab.double(2) == 4, "rule 1: double(2) is 4"


@pytest.mark.provided  # half's argument check runs before its body: provided code, green on the stub
def test_half_refuses_a_negative():
    with pytest.raises(ValueError):
        lab.half(-1)


@pytest.mark.exercise1
def test_half():
    assert lab.half(4) == 2, "rule 2: half(4) is 2\\nand more words on a second line"


@pytest.mark.provided
def test_provided_reaching_a_stub_unmarked():
    lab.double(1)


@pytest.mark.provided
@pytest.mark.parametrize("n", range(7))
def test_provided_broken(n):
    assert n < 0, f"rule 9: provided rule {n} broke"


@pytest.mark.needs(1)
def test_needs_the_exercise():
    RAN.write_text("ran")
    assert lab.double(3) == 6


@pytest.mark.reaches(1)
def test_provided_code_running_the_exercise_at_every_step():
    assert lab.quadruple(1) in (None, 4), "rule 5: quadruple(1) is 4, or None on the stub"
'''


def run(tmp_path: Path, double: str, half: str, *args: str, tests: str = TESTS,
        lab: str = TINY_LAB) -> tuple[str, list[dict]]:
    (tmp_path / "conftest.py").write_text((ROOT / "conftest.py").read_text())
    (tmp_path / "lab_tiny.py").write_text(lab.replace("{double}", double).replace("{half}", half))
    (tmp_path / "test_tiny.py").write_text(tests)
    shutil.rmtree(tmp_path / "ran", ignore_errors=True)
    report = tmp_path / "report.json"
    env = dict(os.environ, LAB_MODULE="lab_tiny", LAB_REPORT=str(report), PYTHONPATH=str(ROOT),
               HYPOTHESIS_PROFILE="ci")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rN", "test_tiny.py",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:]
    return proc.stdout, json.loads(report.read_text())


STUB_DOUBLE = 'raise NotImplementedError("Exercise 1: double")'
STUB_HALF = 'raise NotImplementedError("Exercise 1: half")'


@pytest.fixture(scope="module")
def stubbed(tmp_path_factory) -> tuple[Path, str, list[dict]]:
    """The tiny lab with both functions stubs: its folder, the run's output and its report."""
    where = tmp_path_factory.mktemp("tiny")
    return (where, *run(where, STUB_DOUBLE, STUB_HALF))


@pytest.mark.provided
def test_stubs_are_counted_and_a_needs_test_waits_without_running(stubbed):
    tmp_path, out, rows = stubbed
    by_test = {r["test"].split("::")[-1]: r for r in rows}
    assert not (tmp_path / "ran").exists(), "a needs(1) test ran while Exercise 1 is a stub: it must wait"
    waiting = by_test["test_needs_the_exercise"]
    assert waiting["outcome"] == "failed" and waiting["stub"] and waiting["stub_of"] == 1, waiting
    assert "\n  provided code running Exercise 1 (the server, the command line): 1/2, waiting for double " \
           "(Exercise 1)\n" in out, "needs and reaches tests count under the row of the exercise they run"
    assert "_ test_double _" not in out and "_ test_needs_the_exercise _" not in out, "stubs are counted, not printed"
    assert by_test["test_half_refuses_a_negative"]["outcome"] == "passed"


@pytest.mark.provided
def test_the_provided_row_lists_only_what_pytest_printed_and_counts_the_rest_right(stubbed):
    _, out, _ = stubbed
    board = out[out.index("scoreboard (lab_tiny)"):]
    assert "provided code (nothing to write): 1/9, 1 on stubs (double (Exercise 1))" in board, board
    listed = re.findall(r"^  failed: (\S+)", board, re.M)
    assert "test_provided_reaching_a_stub_unmarked" not in listed, "a stub's failure is not a failure of provided code"
    assert len(listed) == 5 and "  ... and 2 more failed (see above)" in board, board
    printed = re.findall(r"^_+ (test_provided_broken\[\d\]) _+$", out, re.M)
    assert len(printed) == 7 and set(listed) <= set(printed), f"the scoreboard lists {listed}; pytest printed {printed}"


@pytest.mark.provided
def test_the_grade_is_the_share_passed_and_carries_each_failed_tests_rule(tmp_path):
    grade = tmp_path / "results.json"
    run(tmp_path, STUB_DOUBLE, STUB_HALF, "--grade", str(grade))
    test = json.loads(grade.read_text())["tests"][0]
    assert test["score"] == 0 and "write double, half" in test["output"], "a stubbed exercise scores 0"
    run(tmp_path, STUB_DOUBLE, "return x // 2", "--grade", str(grade))  # half written
    test = json.loads(grade.read_text())["tests"][0]
    assert test["score"] == 5 and "write double" in test["output"], "a half-written exercise earns its share"
    run(tmp_path, "return 2 * x", "return x // 3", "--grade", str(grade))
    test = json.loads(grade.read_text())["tests"][0]
    assert test["score"] == 5, test
    assert "failed: test_half: rule 2: half(4) is 2" in test["output"], test["output"]
    assert "second line" not in test["output"], "only the rule's first line"


@pytest.mark.provided
def test_a_wrong_answer_fails_its_provided_code_under_its_row_pointing_at_its_own_tests(tmp_path):
    out, rows = run(tmp_path, "return 3 * x", "return x // 2")
    by_test = {r["test"].split("::")[-1]: r for r in rows}
    assert by_test["test_needs_the_exercise"]["row"] == 1, by_test["test_needs_the_exercise"]
    assert by_test["test_provided_code_running_the_exercise_at_every_step"]["row"] == 1, by_test
    board = out[out.index("scoreboard (lab_tiny)"):]
    assert "\n  provided code running Exercise 1 (the server, the command line): 0/2; Exercise 1 fails tests of its "\
           "own: fix it first (python -m pytest -m exercise1)\n" in board, board
    assert "provided code (nothing to write): 2/9" in board, "the wrong answer is not the provided code's failure"


@pytest.mark.provided
def test_the_instrumented_run_catches_a_provided_codes_test_that_runs_an_exercise(tmp_path):
    reach = tmp_path / "reach.jsonl"
    lab = instrumented(TINY_LAB, reach)
    unmarked = TESTS.replace("@pytest.mark.reaches(1)\ndef test_provided_code_running",
                             "@pytest.mark.provided\ndef test_provided_code_running")
    assert unmarked != TESTS, "test setup: the reaches(1) test is no longer where this test looks"
    env = dict(os.environ, LAB_MODULE="lab_tiny", PYTHONPATH=str(ROOT))
    checker = [sys.executable, str(ROOT / ".ci" / "check_lab_report.py"), str(tmp_path / "report.json"),
               "--reach", str(reach)]
    run(tmp_path, "return 2 * x", "return x // 2", tests=unmarked, lab=lab)
    check = subprocess.run(checker, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert check.returncode == 1 and "test_provided_code_running_the_exercise_at_every_step is counted under the " \
        "provided code's row but ran Exercise 1's code" in check.stdout, check.stdout + check.stderr
    assert "test_needs_the_exercise is counted" not in check.stdout, "a needs(1) test may run Exercise 1's code"
    reach.unlink()
    run(tmp_path, "return 2 * x", "return x // 2", lab=lab)  # marked reaches(1): within its row
    check = subprocess.run(checker, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert "ran Exercise" in check.stdout and "test_provided_code_running" not in check.stdout, (
        "marked reaches(1), the test is within its row (the provided test left unmarked still is not)", check.stdout)


@pytest.mark.provided
def test_a_skipped_test_says_why_in_the_projects_configuration_and_a_failure_is_not_summarised_again(tmp_path):
    for name in ("conftest.py", "pyproject.toml"):  # the project's pytest configuration: its addopts
        (tmp_path / name).write_text((ROOT / name).read_text())
    lab_tiny = TINY_LAB.replace("{double}", "return 2 * x").replace("{half}", "return x / 2")
    (tmp_path / "lab_tiny.py").write_text(lab_tiny)
    (tmp_path / "test_tiny.py").write_text(
        "import pytest\n\n\n@pytest.mark.provided\n@pytest.mark.skipif(True, reason='needs a browser: apt-get install "
        "chromium')\ndef test_skipped():\n    pass\n\n\n@pytest.mark.provided\ndef test_fails():\n    assert False, "
        "'rule 1: a failure'\n")
    env = dict(os.environ, LAB_MODULE="lab_tiny", PYTHONPATH=str(ROOT), COLUMNS="60")
    proc = subprocess.run([sys.executable, "-m", "pytest", "test_tiny.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert "SKIPPED [1] test_tiny.py:4: needs a browser: apt-get install chromium" in proc.stdout, (
        f"a skip prints its reason whole, however narrow the terminal (-rs):\n{proc.stdout[-2000:]}")
    assert "FAILED test_tiny.py" not in proc.stdout, (
        f"a failure is shown once, short (its traceback and the scoreboard), with no summary line:\n{proc.stdout}")
