"""The autograder zip (tools/handout/autograder.py, `student_copy.py DIR --autograder FILE.zip`): its
layout is Gradescope's, it grades the submitted lab.py alone, and every submission it cannot
grade scores 0 with one sentence. The suite runs on blocks_needed's tests only (`pytest_args`),
on this interpreter (the zip's setup.sh is run by CI: .ci/run)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.handout import autograder, half_way, student_copy

ROOT = Path(__file__).resolve().parents[2]
EXERCISE_1 = ("test_lab.py", "-m", "exercise1", "-k", "blocks_needed")


@pytest.fixture(scope="module")
def zipped(tmp_path_factory) -> Path:
    """The autograder zip of a fresh student's copy."""
    where = tmp_path_factory.mktemp("autograder")
    student_copy.write_copy(where / "copy")
    student_copy.write_autograder(where / "copy", where / "autograder.zip")
    return where / "autograder.zip"


@pytest.fixture
def root(zipped, tmp_path) -> Path:
    """AUTOGRADER_ROOT as Gradescope lays it out: source/ (the zip), submission/, results/."""
    with zipfile.ZipFile(zipped) as archive:
        archive.extractall(tmp_path / "source")
    (tmp_path / "submission").mkdir()
    (tmp_path / "results").mkdir()
    return tmp_path


def lab_with(first_exercise: str) -> str:
    """The lab with Exercise 1 written as `first_exercise` (its body's one line) and the rest stubs."""
    text = half_way.state((ROOT / "solution.py").read_text(), 1)
    line = "    return (num_tokens + block_size - 1) // block_size\n"
    assert text.count(line) == 1, "blocks_needed's body changed: update this test's planted lines"
    return text.replace(line, first_exercise)


def grade(root: Path, **options) -> dict:
    return autograder.grade(root, **{"pytest_args": EXERCISE_1} | options)


@pytest.mark.provided
def test_the_zip_has_gradescopes_layout_and_the_copy_without_the_reference(zipped):
    with zipfile.ZipFile(zipped) as archive:
        names = set(archive.namelist())
        modes = {info.filename: info.external_attr >> 16 for info in archive.infolist()}
        requirements = archive.read("requirements.txt").decode().split()
    assert {"setup.sh", "run_autograder", "grade.py", "lab/lab.py", "lab/test_lab.py", "lab/conftest.py"} <= names
    for script in ("setup.sh", "run_autograder"):
        assert modes[script] & stat.S_IXUSR, f"{script} must be executable: Gradescope runs it as it is"
    assert not any(name.startswith(("lab/solution.py", "lab/.ci/", "lab/tools/mutants")) for name in names)
    assert any(r.startswith("numpy") for r in requirements) and any(r.startswith("pytest") for r in requirements)


@pytest.mark.provided
def test_a_submission_without_lab_py_scores_0_and_says_to_submit_it(root):
    (root / "submission" / "answers.txt").write_text("see attached")
    graded = grade(root)
    assert graded["score"] == 0 and "no lab.py" in graded["output"] and "Traceback" not in graded["output"]


@pytest.mark.provided
def test_a_lab_that_does_not_import_scores_0_and_names_the_line(root):
    (root / "submission" / "lab.py").write_text("import numpy\n\ndef broken(:\n    pass\n")
    graded = grade(root)
    assert graded["score"] == 0 and "does not import" in graded["output"], graded
    assert "SyntaxError" in graded["output"] and "line 3" in graded["output"] and "Traceback" not in graded["output"]


@pytest.mark.provided
def test_a_lab_whose_import_hangs_scores_0_within_the_limit(root):
    (root / "submission" / "lab.py").write_text("import time\ntime.sleep(60)\n")
    graded = grade(root, import_limit=1)
    assert graded["score"] == 0 and "did not finish within 1 s" in graded["output"], graded


@pytest.mark.provided
def test_a_lab_whose_tests_hang_scores_0_and_names_the_test_that_was_running(root):
    (root / "submission" / "lab.py").write_text(lab_with("    while True:\n        pass\n"))
    graded = grade(root, time_limit=5)
    assert graded["score"] == 0 and "did not finish within 5 s" in graded["output"], graded
    assert "the last one running was test_" in graded["output"], graded


@pytest.mark.provided
def test_only_lab_py_is_taken_from_the_submission(root):
    # Exercise 1 written, beside a conftest that fails every test and a test file that does: if
    # either were used, Exercise 1 would not get full marks.
    (root / "submission" / "lab.py").write_text(half_way.state((ROOT / "solution.py").read_text(), 1))
    (root / "submission" / "conftest.py").write_text(
        "import pytest\n\n@pytest.hookimpl(tryfirst=True)\ndef pytest_runtest_call(item):\n"
        "    raise AssertionError('the submitted conftest ran')\n")
    (root / "submission" / "test_lab.py").write_text(
        "import pytest\n\n@pytest.mark.exercise1\ndef test_blocks_needed():\n    assert False\n")
    graded = grade(root)
    exercise1 = graded["tests"][0]
    assert exercise1["score"] == exercise1["max_score"] > 0 and graded["score"] == exercise1["score"], graded


@pytest.mark.provided
def test_a_failed_test_carries_the_first_line_of_its_rule_and_the_exercise_its_share(root):
    (root / "submission" / "lab.py").write_text(lab_with("    return num_tokens // block_size\n"))
    graded = grade(root)
    exercise1 = graded["tests"][0]
    failures = [line for line in exercise1["output"].splitlines() if line.startswith("failed: ")]
    assert 0 < exercise1["score"] < exercise1["max_score"] and failures, exercise1
    assert all(line.count(": ") >= 2 for line in failures), f"each failed test names its rule: {failures}"
    assert all(len(line) < 500 for line in failures), "a rule's line is capped"
    assert json.dumps(graded) and graded["score"] == exercise1["score"]


def points_file(**changed) -> str:
    """points.json's text: 10 points each, but for `changed` ({"e1": 30}: Exercise 1 gets 30)."""
    return json.dumps({str(n): 10 for n in range(1, 9)} | {key[1:]: value for key, value in changed.items()})


@pytest.mark.provided
def test_the_zip_states_its_points_in_its_readme_and_points_json(zipped):
    with zipfile.ZipFile(zipped) as archive:
        points = json.loads(archive.read("points.json"))
        readme = archive.read("README.md").decode()
    assert points == {str(n): 10 for n in range(1, 9)}, "by default every exercise weighs 10 points"
    assert "| 1 | blocks and the allocator | 10 |" in readme and "| | in all | 80 |" in readme, readme
    assert "edit `points.json`" in readme, "the README says where a course changes the points"


@pytest.mark.provided
def test_points_json_weighs_each_exercise_and_results_json_states_the_points(root):
    (root / "source" / "points.json").write_text(points_file(e1=30, e2=0, e8=2.5))
    (root / "submission" / "lab.py").write_text(half_way.state((ROOT / "solution.py").read_text(), 1))
    graded = grade(root)
    exercise1 = graded["tests"][0]
    assert (exercise1["score"], exercise1["max_score"]) == (30, 30), exercise1
    assert graded["max_score"] == 30 + 0 + 5 * 10 + 2.5 == 82.5 and graded["score"] == 30, graded
    assert [t["max_score"] for t in graded["tests"]] == [30, 0, 10, 10, 10, 10, 10, 2.5]
    assert "Exercise 1: 30, Exercise 2: 0, " in graded["output"] and "(82.5 in all)" in graded["output"], (
        "results.json states the points it was graded with", graded["output"])


@pytest.mark.provided
@pytest.mark.parametrize("text, says", [
    (points_file(e9=10), "'9': no such exercise"),
    (json.dumps({"one": 10}), "'one': no such exercise"),
    (points_file(e3=-1), "'3': -1 is negative"),
    (points_file(e4="ten"), "'4': \"ten\" is not a number"),
    (points_file(e5=True), "'5': true is not a number"),
    (json.dumps({str(n): 10 for n in range(1, 8)}), "no points for exercise(s) 8"),
    ("[10, 10]", "one JSON object"),
    ("{", "is not JSON"),
])
def test_a_bad_points_json_fails_setup_naming_the_entry(root, text, says):
    (root / "source" / "points.json").write_text(text)
    setup = subprocess.run(["bash", str(root / "source" / "setup.sh")], env=dict(os.environ, AUTOGRADER_ROOT=str(root)),
                           capture_output=True, text=True, timeout=60)
    assert setup.returncode != 0 and says in setup.stderr, (setup.returncode, setup.stderr)
    assert not (root / "source" / ".venv").exists(), "setup stops before it installs anything"


@pytest.mark.provided
def test_setup_accepts_points_json_as_built_and_says_the_points(root):
    check = subprocess.run([sys.executable, str(root / "source" / "grade.py"), "--check-points"],
                           env=dict(os.environ, AUTOGRADER_ROOT=str(root)), capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "Exercise 8: 10 (80 in all)" in check.stdout, check
