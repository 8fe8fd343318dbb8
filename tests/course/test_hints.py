"""test_hints.py: `hint`, `quiz` and `status` (course/hints.py, course/quiz/, course/cli.py) on a
fresh lab (every exercise a stub), a half-written one and a finished one.

The labs are generated from solution.py into a temporary directory (so those tests run in the
maintainers' checkout only), so that no test reads or moves the `.hints.json` of the lab.py a
student is working in. Only the last tests run the quiz on the module under test, and they are
marked with the exercise they need.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import lab
from course import cli, hints, quiz
from course.quiz.questions import question
from tests.support import REFERENCE, ROOT, needs_reference, reraise_stub

TIMEOUT = 60


def _make_lab_text(only: set[str] | None = None) -> str:
    from tools.handout.make_lab import make_lab
    return make_lab(REFERENCE.read_text(), only=only)


@pytest.fixture(scope="module")
def labs(tmp_path_factory) -> dict[str, Path]:
    """A fresh lab (all stubs), a half-written one (only Exercise 1 left) and a finished one."""
    where = tmp_path_factory.mktemp("labs")
    paths = {"fresh": where / "lab_fresh.py", "half": where / "lab_half.py", "finished": REFERENCE}
    paths["fresh"].write_text(_make_lab_text())
    paths["half"].write_text(_make_lab_text(only={"1"}))
    return paths


SCORED_SEED = 7


def scored_answers() -> tuple[list, str]:
    """The reference's quiz 2 at SCORED_SEED, and answers to it: right, wrong, not a number then
    right, wrong."""
    questions = quiz.make_questions(importlib.import_module(REFERENCE.stem), 2, seed=SCORED_SEED)
    answers = [questions[0].answer, questions[1].answer + 1, "not a number", questions[2].answer,
               questions[3].answer + 3]
    return questions, "".join(f"{a}\n" for a in answers)


@pytest.fixture(scope="module")
def runs(labs) -> dict[str, subprocess.CompletedProcess]:
    """Every command-line run of this file, started at once and then awaited: each is a Python that
    imports NumPy and serving/ (most of a second), and one after the other they took ~10 s."""
    calls = {
        "status fresh": (labs["fresh"], ("status",), ""),
        "status half": (labs["half"], ("status",), ""),
        "status finished": (labs["finished"], ("status",), ""),
        "hint fresh": (labs["fresh"], ("hint", "4"), ""),
        "unknown exercise": (Path(lab.__file__), ("hint", "12"), ""),
        "quiz half stubbed": (labs["half"], ("quiz", "1"), ""),
        "quiz half written": (labs["half"], ("quiz", "6", "--seed", "2"), "0\n"),
        "quiz scored": (labs["finished"], ("quiz", "2", "--seed", str(SCORED_SEED)), scored_answers()[1]),
    }
    started = {name: start(path, *args, stdin=stdin) for name, (path, args, stdin) in calls.items()}
    return {name: finish(proc) for name, proc in started.items()}


def start(path: Path, *args: str, stdin: str = "") -> subprocess.Popen:
    """`python <path> ARGS`, started (several run at once: the tests stay fast)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.Popen([sys.executable, str(path), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=path.parent)
    proc.stdin.write(stdin)
    proc.stdin.close()
    return proc


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, proc.stdout.read(), proc.stderr.read())


def module_copy(name: str, directory: Path, **replaced) -> types.ModuleType:
    """The module under test under another file name (so `hint` keeps its state in `directory`), with
    some of its attributes replaced."""
    copy = types.ModuleType(name)
    copy.__dict__.update(vars(lab))
    copy.__file__ = str(directory / f"{name}.py")
    copy.__dict__.update(replaced)
    return copy


def cli_run(module: types.ModuleType, capsys, *args: str) -> tuple[int, str, str]:
    """course.cli.main in this process: (exit status, stdout, stderr)."""
    try:
        status = cli.main(module, list(args))
    except SystemExit as exc:
        status = exc.code
    out, err = capsys.readouterr()
    return status, out, err


# =====================================================================================
# The hints: one file, three levels each
# =====================================================================================


@pytest.mark.provided
def test_the_hints_file_has_a_nudge_an_idea_and_a_method_for_every_exercise():
    found = hints.load_hints()
    assert sorted(found) == sorted(lab.EXERCISES), (
        f"{hints.HINTS_FILE} must have one `## Exercise N` section per exercise {sorted(lab.EXERCISES)}; "
        f"found {sorted(found)}")
    for number, levels in found.items():
        assert sorted(levels) == [1, 2, 3], f"Exercise {number}: levels {sorted(levels)}, expected 1, 2 and 3"
        assert [levels[k][0] for k in (1, 2, 3)] == ["Nudge", "Idea", "Method"], f"Exercise {number}"
        for level, (name, text) in levels.items():
            assert len(text) > 100, f"Exercise {number}, level {level} ({name}) is (nearly) empty: {text!r}"


@pytest.mark.provided
@needs_reference
def test_each_method_names_every_function_its_exercise_writes():
    methods = {n: levels[3][1] for n, levels in hints.load_hints().items()}
    stubs = re.findall(r'raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)', _make_lab_text())
    missing = [f"Exercise {n}: {name}" for n, name in stubs if name.split(".")[-1] not in methods[int(n)]]
    assert not missing, f"level 3 (the method) must cover every function to write; it never names {missing}"


@pytest.mark.provided
def test_the_parser_ignores_the_introduction_and_other_sections():
    text = ("# Hints\nintro\n## How to\nnot a hint\n### 1. Nudge\nnor this\n## Exercise 2: x\n### 1. Nudge\na\n"
            "### 2. Idea\nb\nb2\n### 3. Method\nc\n## Appendix\nz\n")
    assert hints.parse_hints(text) == {2: {1: ("Nudge", "a"), 2: ("Idea", "b\nb2"), 3: ("Method", "c")}}


@pytest.mark.provided
def test_hint_shows_the_levels_in_order_then_says_there_are_no_more(tmp_path, capsys):
    copy = module_copy("lab_copy", tmp_path)
    levels = hints.load_hints()[2]
    for level in (1, 2, 3):
        status, out, _ = cli_run(copy, capsys, "hint", "2")
        assert status == 0 and f"hint {level} of 3: {levels[level][0]}" in out and levels[level][1] in out
    assert "hint 2` shows hint" not in out and "--level K" in out, "the last level says there are no more"
    status, out, _ = cli_run(copy, capsys, "hint", "2")
    assert status == 0 and "No more hints for Exercise 2" in out and "hint 2 --level K" in out
    assert (tmp_path / ".hints.json").exists(), "the levels seen live in .hints.json beside the module"
    status, out, _ = cli_run(copy, capsys, "hint", "5")
    assert "Exercise 5" in out and "hint 1 of 3" in out, "each exercise has its own next hint"


@pytest.mark.provided
def test_hint_level_shows_that_level_and_does_not_move_the_next_one(tmp_path, capsys):
    copy = module_copy("lab_copy", tmp_path)
    status, out, _ = cli_run(copy, capsys, "hint", "4", "--level", "3")
    assert status == 0 and "hint 3 of 3: Method" in out and hints.load_hints()[4][3][1] in out
    assert not (tmp_path / ".hints.json").exists(), "--level K neither reads nor writes the state"
    status, out, _ = cli_run(copy, capsys, "hint", "4")
    assert "hint 1 of 3: Nudge" in out


@pytest.mark.provided
def test_hint_starts_over_from_a_corrupt_state_file_and_says_when_it_cannot_write_one(tmp_path, capsys):
    (tmp_path / ".hints.json").write_text("{not json")
    copy = module_copy("lab_copy", tmp_path)
    assert "hint 1 of 3" in cli_run(copy, capsys, "hint", "1")[1]
    assert "hint 2 of 3" in cli_run(copy, capsys, "hint", "1")[1]
    gone = module_copy("lab_copy", tmp_path / "no such directory")
    status, out, _ = cli_run(gone, capsys, "hint", "1")
    assert status == 0 and "hint 1 of 3" in out and "Could not remember" in out


@pytest.mark.provided
@pytest.mark.parametrize("args, says", [
    (("hint", "9"), "there is no exercise 9 (the exercises are 1 to 8)"),
    (("hint", "0"), "there is no exercise 0"),
    (("hint", "x"), "'x' is not an exercise number"),
    (("hint", "1.5"), "'1.5' is not an exercise number"),
    (("hint",), "required: N"),
    (("hint", "1", "--level", "4"), "the levels are 1 to 3, got '4'"),
    (("hint", "1", "--level", "0"), "the levels are 1 to 3, got '0'"),
    (("hint", "1", "--level", "two"), "the levels are 1 to 3, got 'two'"),
    (("quiz", "9"), "there is no exercise 9"),
    (("quiz", "-1"), "there is no exercise -1"),
    (("quiz", "one"), "'one' is not an exercise number"),
    (("quiz", "1", "--seed", "x"), "--seed"),
    (("quiz", "1", "--seed", "-5"), "--seed"),
])
def test_hint_and_quiz_refuse_bad_input_with_one_line_and_exit_status_2(args, says, capsys):
    status, out, err = cli_run(lab, capsys, *args)
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and says in lines[0], (
        f"{args}: expected exit 2 and one line saying {says!r}; got {status}, {lines}")


@pytest.mark.provided
@needs_reference
def test_an_unknown_exercise_is_exit_status_2_from_the_command_line(runs):
    proc = runs["unknown exercise"]
    assert proc.returncode == 2 and "there is no exercise 12" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1


@pytest.mark.provided
@needs_reference
def test_hint_from_the_command_line_on_a_fresh_lab(runs, labs):
    proc = runs["hint fresh"]
    assert proc.returncode == 0 and "Exercise 4 (paged attention), hint 1 of 3: Nudge" in proc.stdout, proc.stderr
    assert "`python lab_fresh.py hint 4` shows hint 2 of 3" in proc.stdout
    assert (labs["fresh"].parent / ".hints.json").exists()


# =====================================================================================
# The quiz: questions with numbers, answered by the module it runs on
# =====================================================================================


@pytest.mark.provided
@pytest.mark.parametrize("text, value", [("3", 3.0), (" 0.25\n", 0.25), ("2/3", 2 / 3), ("1e-3", 1e-3),
                                         ("12,345", 12345.0), ("abc", None), ("", None), ("1/0", None),
                                         ("nan", None), ("inf", None)])
def test_the_quiz_reads_numbers_and_fractions(text, value):
    assert quiz.parse_answer(text) == (pytest.approx(value) if value is not None else None)


@pytest.mark.provided
def test_whole_answers_are_exact_and_the_others_within_their_stated_tolerance():
    whole = question("q", 3, 3, "why")
    near = question("q", 0.4, 0.4, "why", tolerance=0.01)
    relative = question("q", 200.0, 200.0, "why", tolerance=0.01, relative=True)
    assert quiz.is_right(whole, 3.0) and not quiz.is_right(whole, 3.4)
    assert quiz.is_right(near, 0.405) and not quiz.is_right(near, 0.42)
    assert relative.within == "1%" and quiz.is_right(relative, 201.5) and not quiz.is_right(relative, 203)


@pytest.mark.provided
@needs_reference
def test_the_quiz_scores_piped_answers_and_explains_each_on_the_reference(runs):
    questions = scored_answers()[0]
    proc = runs["quiz scored"]
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("  right: the answer is") == 2 and out.count("  wrong: the answer is") == 2, out
    assert f"wrong: the answer is {questions[1].answer}." in out
    assert out.count("  Why: ") == 4 and "is not a number" in out and "Score: 2 of 4 right." in out
    assert f"--seed {SCORED_SEED}" in out and "computed by solution.py itself" in out
    flat = " ".join(out.split())
    assert all(q.text in flat and q.explanation in flat for q in questions)


@pytest.mark.needs(1)
def test_the_quiz_ends_cleanly_at_the_end_of_its_input(tmp_path):
    module = module_copy("lab_copy", tmp_path)
    first = quiz.make_questions(module, 1, seed=3)[0]
    out = io.StringIO()
    assert quiz.run_quiz(module, 1, 3, "lab_copy.py", stdin=io.StringIO(f"{first.answer}\n"),
                         stdout=out) == 0
    assert "right: the answer is" in out.getvalue() and "Quiz ended before Q2: 1 right of 1 answered." in out.getvalue()


@pytest.mark.needs(5)
def test_the_same_seed_asks_the_same_questions_and_fresh_figures_come_without_one(capsys):
    texts = lambda seed: [q.text for q in quiz.make_questions(lab, 5, seed)]  # noqa: E731
    assert texts(11) == texts(11)
    assert len({tuple(texts(seed)) for seed in range(6)}) > 1


@pytest.mark.needs(1)
def test_the_quiz_says_when_the_modules_answer_disagrees_with_the_reasoning(tmp_path):
    floor = module_copy("broken", tmp_path, blocks_needed=lambda n, b: n // b)  # the classic off-by-one
    out = io.StringIO()
    quiz.run_quiz(floor, 1, 1, "broken.py", stdin=io.StringIO("0\n0\n0\n"), stdout=out)
    reraise_stub(out.getvalue())
    flat = " ".join(out.getvalue().split())
    assert "Note: the reasoning above gives" in flat and "broken.py computes" in flat and "pytest -m exercise1" in flat


@pytest.mark.needs(1)
def test_a_module_that_fails_for_another_reason_than_a_stub_stops_the_quiz_with_exit_status_1(tmp_path, capsys):
    def boom(num_tokens, block_size):
        raise ValueError("boom")

    status, _, err = cli_run(module_copy("broken", tmp_path, blocks_needed=boom), capsys, "quiz", "1")
    reraise_stub(err)
    assert status == 1 and "broken.py quiz: error: ValueError: boom" in err


@pytest.mark.provided
def test_the_quiz_help_says_the_answers_come_from_the_module_itself(capsys):
    status, out, _ = cli_run(lab, capsys, "quiz", "--help")
    flat = " ".join(out.split())
    assert status == 0 and "computed by THIS module's own code" in flat and "not your code" in flat


@pytest.mark.provided
@needs_reference
def test_the_quiz_on_a_half_written_lab_asks_what_is_written_and_names_what_is_not(runs):
    stubbed, written = runs["quiz half stubbed"], runs["quiz half written"]
    assert stubbed.returncode == 1 and "Exercise 1: blocks_needed is still a stub: write it first" in stubbed.stderr, (
        stubbed.stderr)
    assert "Q1 of" not in stubbed.stdout, "a stub stops the quiz before its first question"
    assert written.returncode == 0 and "Q1 of 4" in written.stdout and "Quiz ended before Q2" in written.stdout


# =====================================================================================
# status: fresh, half-written and finished
# =====================================================================================


@pytest.mark.provided
@needs_reference
def test_status_on_a_fresh_a_half_written_and_a_finished_lab(runs):
    status = {state: runs[f"status {state}"] for state in ("fresh", "half", "finished")}
    for state, proc in status.items():
        assert proc.returncode == 0, f"{state}: {proc.stderr}"
        assert re.search(r"`python \S+ hint N`.*`python \S+ quiz N`", proc.stdout), f"{state}: {proc.stdout}"
    fresh, half, finished = (status[state].stdout for state in ("fresh", "half", "finished"))
    assert fresh.count("to do:") == len(lab.EXERCISES) and "done" not in fresh
    assert half.count("to do:") == 1 and "to do: blocks_needed, BlockAllocator.num_free_blocks" in half
    assert half.count("      done") == len(lab.EXERCISES) - 1
    assert "to do:" not in finished and finished.count("      done") == len(lab.EXERCISES)
