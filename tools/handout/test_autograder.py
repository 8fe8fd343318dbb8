"""The autograder zip (tools/handout/autograder.py, `student_copy.py DIR --autograder FILE.zip`): its
layout is Gradescope's, it grades the submitted lab.py alone, and every submission it cannot
grade scores 0 with one sentence. The suite runs on blocks_needed's tests only (`pytest_args`),
on this interpreter (the zip's setup.sh is run by CI: .ci/run)."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXERCISE_1 = ("test_lab.py", "-m", "exercise1", "-k", "blocks_needed")


def load_tool(name: str):
    here = Path(__file__).parent  # tools/handout/: the autograder, the copy, the half-way states
    spec = importlib.util.spec_from_file_location(name, here / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(here))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(here))
    return module


@pytest.fixture(scope="module")
def zipped(tmp_path_factory) -> Path:
    """The autograder zip of a fresh student's copy."""
    where = tmp_path_factory.mktemp("autograder")
    student_copy = load_tool("student_copy")
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
    text = load_tool("half_way").state((ROOT / "solution.py").read_text(), 1)
    line = "    return (num_tokens + block_size - 1) // block_size\n"
    assert text.count(line) == 1, "blocks_needed's body changed: update this test's planted lines"
    return text.replace(line, first_exercise)


def grade(root: Path, **options) -> dict:
    return load_tool("autograder").grade(root, **{"pytest_args": EXERCISE_1} | options)


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
    (root / "submission" / "lab.py").write_text(load_tool("half_way").state((ROOT / "solution.py").read_text(), 1))
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
