#!/usr/bin/env python3
"""Gradescope's autograder for the student's copy: the zip, and the grader inside it.

    python -m tools.handout.student_copy DIR --autograder FILE.zip   # writes the copy, then the zip

The zip follows Gradescope's autograder specification
(https://gradescope-autograders.readthedocs.io/en/latest/specs/): `setup.sh` and `run_autograder`
at its root; Gradescope unpacks it into /autograder/source, runs setup.sh once as root when it
builds the image, then for each submission runs run_autograder in /autograder, with the
student's files in /autograder/submission, and shows the student /autograder/results/results.json.

An exercise scores its points (points.json: `{"1": 10, ...}`, every exercise a number >= 0; 0
leaves it out of the grade) times the share of its own tests that pass; results.json says so,
with the points. setup.sh refuses a points.json that names an unknown exercise, leaves one out, or
gives one a negative or non-numeric value, naming the entry: the image is not built.

    setup.sh         checks points.json, then a virtual environment in source/.venv with the
                     copy's dependencies
    run_autograder   runs grade.py with that environment's Python
    grade.py         this file: grades one submission
    points.json      the points of each exercise: the one file a course edits to weigh them
    README.md        what the zip holds, and the points it was built with
    requirements.txt the copy's dependencies (pyproject.toml's, with the test extra)
    autograder.json  the exercises (number and title)
    lab/             the student's copy, as the course hands it out

grade.py takes only `lab.py` from the submission: it copies source/lab/ to a fresh folder, puts
the submitted lab.py in it and runs the copy's own suite there with `--grade` (conftest.py), so a
student's edited tests or conftest are never used. A submission with no lab.py, one that does not
import, one that is not the lab (no EXERCISES table) or one whose tests do not finish in the time
limit scores 0 with one message saying which. Any other error of the grader itself also scores 0
and says so, with the traceback on stdout (Gradescope shows stdout to instructors only).

`AUTOGRADER_ROOT` (default /autograder) moves the whole layout, so that CI can run it anywhere;
`AUTOGRADER_TIME_LIMIT` is the limit in seconds for the suite (default 600: set Gradescope's own
limit above it). Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

TIME_LIMIT = 600.0  # seconds for the whole suite (a finished lab takes about a minute on 2 cores)
IMPORT_LIMIT = 60.0  # seconds for `import lab`
SUBMITTED = "lab.py"

SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image: the points checked,
# then the copy's dependencies in a virtual environment of their own. The lab needs Python 3.10
# or newer (Gradescope's Ubuntu 22.04 base image has it).
set -euo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
python3 "$ROOT/source/grade.py" --check-points
if ! python3 -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q python3 python3-venv python3-pip
fi
python3 -c 'import sys; sys.exit(sys.version_info < (3, 10) and "setup.sh: the lab needs Python 3.10 or newer")'
python3 -m venv "$ROOT/source/.venv"
"$ROOT/source/.venv/bin/python" -m pip install -q --disable-pip-version-check -r "$ROOT/source/requirements.txt"
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this for every submission: grade.py grades the submitted lab.py alone and
# writes results/results.json.
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PYTHON="$ROOT/source/.venv/bin/python"
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" "$ROOT/source/grade.py"
"""

SKIP = {".venv", "__pycache__", ".pytest_cache", ".hypothesis", ".git"}
POINTS = "points.json"


# --- the points of each exercise (both sides) ------------------------------------------------------

def read_points(text: str, exercises: dict[int, str]) -> dict[int, float]:
    """Each exercise's points from points.json's `text`: a JSON object naming every exercise of
    `exercises` ({number: title}) once, by its number, with a number >= 0. A ValueError names the
    entry that is not."""
    try:
        entries = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{POINTS} is not JSON: {exc}") from None
    if not isinstance(entries, dict):
        raise ValueError(f'{POINTS} must be one JSON object, {{"1": 10, ...}}, not {type(entries).__name__}')
    points = {}
    for key, value in entries.items():
        if not (key.isdigit() and int(key) in exercises):
            raise ValueError(f"{POINTS}: {key!r}: no such exercise (the lab has {_span(exercises)})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (
                float("inf"), float("-inf")):
            raise ValueError(f"{POINTS}: {key!r}: {json.dumps(value)} is not a number of points")
        if value < 0:
            raise ValueError(f"{POINTS}: {key!r}: {value} is negative (0 leaves an exercise out of the grade)")
        points[int(key)] = float(value)
    missing = [n for n in exercises if n not in points]
    if missing:
        raise ValueError(f"{POINTS}: no points for exercise(s) {', '.join(map(str, missing))} (give each one; 0 "
                         "leaves it out of the grade)")
    if not sum(points.values()):
        raise ValueError(f"{POINTS}: every exercise has 0 points: nothing would be graded")
    return dict(sorted(points.items()))


def _span(exercises: dict[int, str]) -> str:
    return f"exercises {min(exercises)}-{max(exercises)}"


def points_text(points: dict[int, float]) -> str:
    """`Exercise 1: 10, ... (80 in all)`: the points as results.json and the README state them."""
    return ", ".join(f"Exercise {n}: {p:g}" for n, p in points.items()) + f" ({sum(points.values()):g} in all)"


def readme(exercises: dict[int, str], points: dict[int, float]) -> str:
    rows = "\n".join(f"| {n} | {exercises[n]} | {points[n]:g} |" for n in exercises)
    return f"""# The lab's autograder (Gradescope)

Upload this zip as a Gradescope programming assignment's autograder. Gradescope runs `setup.sh`
once, when it builds the image, then `run_autograder` for each submission: `grade.py` takes only
`lab.py` from the submission and grades it with the student's copy's own tests (`lab/`), writing
`results/results.json`.

## Points

Each exercise scores its points times the share of its own tests that pass; the tests of the
provided code are not graded. Built with these points (`{POINTS}`):

| exercise | | points |
| --- | --- | --- |
{rows}
| | in all | {sum(points.values()):g} |

To weigh the exercises otherwise, edit `{POINTS}` (`{{"1": 10, "2": 10, ...}}`: every exercise, by
its number, a number >= 0; 0 leaves it out of the grade) and zip the folder again. `setup.sh`
refuses a `{POINTS}` that names an unknown exercise, leaves one out, or gives one a negative or
non-numeric value, naming the entry. Each `results.json` states the points it was graded with.
"""


# --- building the zip (the maintainers' side) ----------------------------------------------------

def requirements(pyproject: str) -> list[str]:
    """The copy's dependencies and its test extra, from pyproject.toml's two lists."""
    found = []
    for key in ("dependencies", "test"):
        match = re.search(rf"^{key} = \[(.*?)\]", pyproject, re.M | re.S)
        if not match:
            raise ValueError(f"pyproject.toml has no `{key} = [...]` list")
        found += re.findall(r'"([^"]+)"', match.group(1))
    return found


def build_zip(copy: Path, out: Path, exercises: dict[int, str], points: dict[int, float]) -> list[str]:
    """Write the autograder zip of the copy in `copy` to `out`, grading `exercises` ({number:
    title}) with `points` (checked by read_points); returns its entries."""
    points_json = json.dumps({str(n): points[n] for n in exercises}, indent=1) + "\n"
    read_points(points_json, exercises)
    files = {
        "setup.sh": (SETUP_SH, 0o755),
        "run_autograder": (RUN_AUTOGRADER, 0o755),
        "grade.py": (Path(__file__).read_text(), 0o644),
        POINTS: (points_json, 0o644),
        "README.md": (readme(exercises, points), 0o644),
        "requirements.txt": ("\n".join(requirements((copy / "pyproject.toml").read_text())) + "\n", 0o644),
        "autograder.json": (json.dumps({"exercises": {str(n): t for n, t in exercises.items()}}, indent=1) + "\n",
                            0o644),
    }
    names = []
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, (text, mode) in files.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = (0o100000 | mode) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, text)
            names.append(name)
        for path in sorted(copy.rglob("*")):
            rel = path.relative_to(copy)
            if path.is_file() and not SKIP & set(rel.parts):
                archive.write(path, f"lab/{rel.as_posix()}")
                names.append(f"lab/{rel.as_posix()}")
    return names


# --- grading one submission (the zip's side: grade.py) -------------------------------------------

def find_submission(submission: Path) -> tuple[Path | None, str]:
    """The submitted lab.py, or None and why not."""
    if (submission / SUBMITTED).is_file():
        return submission / SUBMITTED, ""
    found = [p for p in submission.rglob(SUBMITTED) if not SKIP & set(p.relative_to(submission).parts)] \
        if submission.is_dir() else []
    if len(found) == 1:
        return found[0], ""
    if found:
        where = ", ".join(str(p.relative_to(submission)) for p in found[:4])
        return None, f"Your submission holds {len(found)} files named lab.py ({where}): submit one, yours."
    return None, ("Your submission has no lab.py. Submit the lab.py you wrote: it is the only file graded "
                  "(the tests and every other file come from the course's copy).")


def run_bounded(argv: list[str], cwd: Path, env: dict, limit: float, log: Path) -> int | None:
    """Run `argv` in a session of its own with its output in `log`; its exit status, or None when
    it ran past `limit` seconds (then it and every process it started are killed)."""
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            return proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return None


def source_points(root: Path) -> dict[int, float]:
    """The points of each exercise, from the autograder's source/points.json (read_points)."""
    exercises = json.loads((root / "source" / "autograder.json").read_text())["exercises"]
    return read_points((root / "source" / POINTS).read_text(), {int(n): t for n, t in exercises.items()})


def weigh(graded: dict, points: dict[int, float]) -> dict:
    """The suite's results.json with each exercise's score its points times the share of its own
    tests that passed (`extra_data`, written by conftest.py's --grade)."""
    for test in graded["tests"]:
        number = int(re.match(r"Exercise (\d+):", test["name"]).group(1))
        share = test["extra_data"]["passed"] / test["extra_data"]["total"] if test["extra_data"]["total"] else 0.0
        test["score"] = round(points[number] * share, 2)
        test["max_score"] = points[number]
    graded["score"] = round(sum(t["score"] for t in graded["tests"]), 2)
    graded["max_score"] = sum(points.values())
    return graded


def import_problem(text: str) -> str:
    """The last line of an import's traceback, with the line of lab.py it points at."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else "no error message"
    where = re.findall(r'File "[^"]*lab\.py", line (\d+)', text)
    return f"{last} (lab.py, line {where[-1]})" if where and "line" not in last else last


def last_test_started(log: str) -> str | None:
    """With -v, pytest writes a test's id before it runs it: the last id that has no outcome."""
    tail = log.rstrip().splitlines()[-1:] or [""]
    match = re.match(r"^(\S+::\S+)", tail[0])
    return match.group(1) if match and not re.search(r"(PASSED|FAILED|SKIPPED|STUB|ERROR)", tail[0]) else None


def grade(root: Path, time_limit: float = TIME_LIMIT, import_limit: float = IMPORT_LIMIT,
          pytest_args: tuple[str, ...] = ()) -> dict:
    """Grade root/submission's lab.py against the copy in root/source/lab; the results.json dict."""
    started = time.monotonic()
    points = source_points(root)
    config = {"exercises": len(points), "points": points}

    def zero(message: str) -> dict:
        return {"score": 0.0, "max_score": sum(points.values()), "output": message, "tests": []}

    submitted, why = find_submission(root / "submission")
    if submitted is None:
        return zero(why)
    work = Path(tempfile.mkdtemp(prefix="lab-graded-"))
    try:
        shutil.copytree(root / "source" / "lab", work, dirs_exist_ok=True, ignore=shutil.ignore_patterns(*SKIP))
        shutil.copyfile(submitted, work / "lab.py")
        graded = run_suite(root, work, config, zero, time_limit, import_limit, pytest_args)
        graded["execution_time"] = round(time.monotonic() - started, 1)
        return graded
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_suite(root: Path, work: Path, config: dict, zero, time_limit: float, import_limit: float,
              pytest_args: tuple[str, ...]) -> dict:
    """The checks and the suite in `work` (the copy with the submitted lab.py)."""
    # The suite's own settings, whatever the image's environment says; LAB_REPORT passes through
    # (CI checks each graded run as it checks the copy's: tools/handout/half_way.py).
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTEST", "LAB_", "HYPOTHESIS", "PYTHON")) or k == "LAB_REPORT"}
    env |= {"PYTHONPATH": str(work), "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "LAB_MODULE": "lab",
            "HYPOTHESIS_PROFILE": "ci"}
    log = root / "results" / "pytest.log"
    probe = f"import lab, sys; sys.exit(0 if len(getattr(lab, 'EXERCISES', {{}})) == {config['exercises']} else 3)"
    status = run_bounded([sys.executable, "-c", probe], work, env, import_limit, log)
    if status is None:
        return zero(f"Importing your lab.py did not finish within {import_limit:.0f} s, so no test could run: "
                    "is there code at its top level that never ends?")
    if status == 3:
        return zero("Your lab.py imports, but it is not the lab: it has no EXERCISES table of "
                    f"{config['exercises']} exercises. Submit the lab.py of your copy, with your answers in it.")
    if status != 0:
        return zero(f"Your lab.py does not import, so no test could run: {import_problem(log.read_text())}. "
                    "Run `python -m pytest` in your copy before you submit.")
    results = root / "results" / "results.json"
    results.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--grade", str(results), *pytest_args]
    status = run_bounded(argv, work, env, time_limit, log)
    text = log.read_text(errors="replace")
    print(text[-4000:])  # stdout: the instructor's view of the run
    if status is None:
        hung = last_test_started(text)
        return zero(f"The tests did not finish within {time_limit:.0f} s, so none is graded"
                    + (f"; the last one running was {hung.split('::', 1)[-1]}" if hung else "")
                    + ". Does a loop of yours never end? Run `python -m pytest` in your copy.")
    if status not in (0, 1) or not results.exists():
        errors = [line for line in text.splitlines() if line.startswith(("E ", "ERROR"))]
        return zero(f"The tests could not run on your lab.py (pytest exited {status})"
                    + (f": {errors[0].lstrip('E ').strip()[:300]}" if errors else "")
                    + ". Run `python -m pytest` in your copy before you submit.")
    graded = weigh(json.loads(results.read_text()), config["points"])
    done = sum(t["extra_data"]["passed"] == t["extra_data"]["total"] > 0 for t in graded["tests"])
    graded["output"] = (f"Graded your lab.py with the course's tests: {done} of {len(graded['tests'])} exercises "
                        "pass all their tests. Each exercise scores its points times the share of its tests that "
                        f"pass; the points: {points_text(config['points'])}.")
    return graded


def main(argv: list[str]) -> int:
    root = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder"))
    if argv == ["--check-points"]:  # setup.sh: a points.json the grade cannot use stops the build
        try:
            print(f"{POINTS}: {points_text(source_points(root))}")
        except ValueError as exc:
            print(f"setup.sh: {exc}", file=sys.stderr)
            return 1
        return 0
    (root / "results").mkdir(parents=True, exist_ok=True)
    try:
        graded = grade(root, float(os.environ.get("AUTOGRADER_TIME_LIMIT", TIME_LIMIT)))
    except Exception:  # the grader's own failure: the student gets a score and a sentence, never a traceback
        traceback.print_exc(file=sys.stdout)
        graded = {"score": 0.0, "output": "The autograder failed on this submission (an error of the autograder, "
                  "not of your lab.py): please tell your instructor.", "tests": []}
    (root / "results" / "results.json").write_text(json.dumps(graded, indent=1) + "\n")
    print(f"score {graded['score']}: {graded['output']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
