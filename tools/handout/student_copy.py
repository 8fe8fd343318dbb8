#!/usr/bin/env python3
"""Write the lab as a course hands it out: the repository without the reference or its answers.

    python -m tools.handout.student_copy DIR                          # DIR must not exist yet, or be empty
    python -m tools.handout.student_copy DIR --autograder FILE.zip    # ... and Gradescope's autograder of it
    python -m tools.handout.student_copy DIR --autograder FILE.zip --points POINTS.json  # ... weighing the exercises

The copy holds every file git tracks here except MAINTAINERS_ONLY: `solution.py`, the planted
mistakes, the tools that exist to check the reference against the lab, and the graders' page. It
changes these files:
- README.md and docs/*.md lose the parts written for maintainers (between `<!-- maintainers -->`
  and `<!-- /maintainers -->`: whole blocks, or words inside a line such as a table's row), and
  their commands run the lab where the maintainers' run the reference (`python solution.py`
  becomes `python lab.py`: COPY_WORDS); README.md opens with a line that says what the copy is;
- pyproject.toml installs `lab` alone (there is no `solution` to install), and loses the lines
  between `# <!-- maintainers -->` and `# <!-- /maintainers -->` (the tools' tests, their lint rule).
It adds `docs/reference-traces/`: each trace workload recorded on the reference engine
(`python solution.py trace`), so a student can watch a correct run before their own Exercise 5
exists.

Before it writes anything it checks that no shipped file holds an exercise's answer (three or
more lines of one solution region of `solution.py` that the stubbed lab does not have): a file
added later that quotes the reference makes this command fail, not the course leak. Likewise
for the pages' words (tools/pages/check_words.py): a phrase of the project's history, a link to a file
the copy lacks, or a command that needs the reference, a maintainers' tool or the git history;
and for every shipped file's words: none names a file or folder the copy does not hold
(check_words.unheld_names), but solution.py, which a course hands out later.
With `--autograder FILE.zip` it also writes the zip Gradescope takes (tools/handout/autograder.py):
setup.sh, run_autograder and the copy, grading the submitted lab.py alone with the copy's suite.
docs/teaching.md says how an instructor builds, checks and grades the copy.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.handout import autograder
from tools.handout.make_lab import BEGIN, END, ROOT, make_lab
from tools.pages.check_words import copy_problems, unheld_names

# Paths (a trailing slash: a folder) that stay with the maintainers: the reference, the tools that
# make the lab and its copy (tools/handout/), the planted mistakes and the checks of the reference
# against the lab (tools/checks/: they read solution.py), the pages' checks (tools/pages/: they run
# the pages' commands on the reference), the tooling's tests and what they share, the graders' page.
MAINTAINERS_ONLY = (
    "solution.py",
    ".ci/",
    "tools/handout/",
    "tools/checks/",
    "tools/pages/",
    "tools/test_tooling.py",
    "tools/tool_support.py",
    "docs/teaching.md",  # the graders' page
)
MAINTAINERS = re.compile(r"\n?<!-- maintainers -->.*?<!-- /maintainers -->\n?", re.S)
MAINTAINERS_LINES = re.compile(r"^# <!-- maintainers -->\n.*?^# <!-- /maintainers -->\n", re.M | re.S)  # TOML
TRACE_WORKLOADS = ("skewed", "shared-prefix", "memory-pressure", "arrivals")
SHORTEST_ANSWER_LINE = 24  # shorter lines (`return x`, `else:`) are too common to call a leak
LEAK_LINES = 3  # lines of one solution region in one shipped file that make it a leak


def tracked_files(root: Path = ROOT) -> list[str]:
    """The files git tracks under `root`."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, text=True, check=True)
    return [path for path in tracked.stdout.split("\0") if path]


def shipped_files(root: Path = ROOT) -> list[str]:
    """The files git tracks under `root`, less MAINTAINERS_ONLY."""
    return sorted(path for path in tracked_files(root) if not path.startswith(MAINTAINERS_ONLY)
                  and path not in MAINTAINERS_ONLY)


def answer_regions(solution: str) -> list[set[str]]:
    """Per solution region of solution.py, its stripped lines that the generated lab lacks."""
    lab_lines = {line.strip() for line in make_lab(solution).splitlines()}
    regions: list[set[str]] = []
    for line in solution.splitlines():
        if BEGIN.match(line):
            regions.append(set())
        elif END.match(line):
            regions[-1] -= lab_lines
            regions.append(None)  # outside a region until the next BEGIN
        elif regions and regions[-1] is not None and len(line.strip()) >= SHORTEST_ANSWER_LINE \
                and not line.strip().startswith("#"):
            regions[-1].add(line.strip())
    return [region for region in regions if region]


def leaks(files: dict[str, str], solution: str) -> list[str]:
    """`path: N lines of one answer` for every shipped text file that holds LEAK_LINES or more
    lines of one solution region (a line or two alike is a common idiom, not an answer)."""
    regions = answer_regions(solution)
    found = []
    for path, text in files.items():
        lines = {line.strip() for line in text.splitlines()}
        for region in regions:
            shared = sorted(region & lines)
            if len(shared) >= LEAK_LINES:
                found.append(f"{path}: {len(shared)} lines of one answer, such as {shared[0]!r}")
    return found


# The copy has no solution.py: where the maintainers' pages run the reference, the copy's run the lab.
COPY_WORDS = ((re.compile(r"\bpython solution\.py\b"), "python lab.py"),
              (re.compile(r"\bsolution as lab\b"), "lab"),
              (re.compile(r"--module solution\b"), "--module lab"),
              (re.compile(r"\bLAB_MODULE=solution "), ""))


def is_page(path: str) -> bool:
    """README.md and docs/*.md: the pages whose words the copy rewrites."""
    return path == "README.md" or bool(re.fullmatch(r"docs/[^/]+\.md", path))


def student_page(path: str, text: str) -> str:
    """A page as the copy ships it: the maintainers' parts out, the reference's commands the lab's."""
    if path == "README.md":
        return student_readme(text)
    text = MAINTAINERS.sub(lambda m: "\n" if m.group().startswith("\n") else "", text)  # a block, or words in a line
    for pattern, words in COPY_WORDS:
        text = pattern.sub(words, text)
    return text


def student_readme(readme: str) -> str:
    intro = ("> **The student's copy.** Your course made this copy of the lab: "
             "it has no `solution.py`, so you write every exercise in `lab.py` and the tests tell you when it "
             "is right. `docs/reference-traces/` holds recorded runs of a correct engine to compare yours with.\n")
    body = student_page("docs/README.md", readme)
    title, _, rest = body.partition("\n")
    return f"{title}\n\n{intro}{rest}"


def words_unfit(texts: dict[str, str], binaries: list[str]) -> list[str]:
    """What in the copy's pages does not fit the copy (tools/pages/check_words.py's copy_problems)."""
    files = {*texts, *binaries, *(f"docs/reference-traces/{w}.html" for w in TRACE_WORKLOADS)}
    return copy_problems({path: text for path, text in texts.items() if is_page(path)}, files)


def names_unheld(texts: dict[str, str], binaries: list[str]) -> list[str]:
    """Where the copy's files name a file or folder the copy does not hold (check_words.unheld_names)."""
    held = {*texts, *binaries, *(f"docs/reference-traces/{w}.html" for w in TRACE_WORKLOADS)}
    return unheld_names(texts, held, set(tracked_files()))


def student_pyproject(text: str) -> str:
    changed = MAINTAINERS_LINES.sub("", text.replace('py-modules = ["solution", "lab"]', 'py-modules = ["lab"]'))
    changed = changed.rstrip("\n") + "\n"
    if changed == text:
        raise SystemExit("tools/handout/student_copy.py: pyproject.toml no longer lists "
                         "py-modules = [\"solution\", \"lab\"]")
    return changed


def record_reference_traces(out: Path) -> None:
    """Each workload's trace, recorded on the reference engine, into out/docs/reference-traces/."""
    where = out / "docs" / "reference-traces"
    where.mkdir(parents=True, exist_ok=True)
    for workload in TRACE_WORKLOADS:
        subprocess.run([sys.executable, str(ROOT / "solution.py"), "trace", "--workload", workload,
                        "--out", str(where / f"{workload}.html")], cwd=tempfile.gettempdir(), check=True,
                       capture_output=True, text=True)


def copy_files() -> tuple[dict[str, str], list[str]]:
    """The copy's text files by path, as it ships them (pages and pyproject.toml rewritten), and
    the paths of its binary files (copied as they are)."""
    texts: dict[str, str] = {}
    binaries: list[str] = []
    for path in shipped_files():
        try:
            texts[path] = (ROOT / path).read_text(encoding="utf-8")
        except UnicodeDecodeError:  # an image: copied as it is
            binaries.append(path)
    for path in filter(is_page, texts):
        texts[path] = student_page(path, texts[path])
    texts["pyproject.toml"] = student_pyproject(texts["pyproject.toml"])
    return texts, binaries


def write_copy(out: Path) -> list[str]:
    """Write the copy into `out`; returns the paths written (relative)."""
    out = out.resolve()  # the reference traces are recorded from another folder
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"tools/handout/student_copy.py: {out} is not empty: name a new folder")
    solution = (ROOT / "solution.py").read_text()
    texts, binaries = copy_files()
    found = leaks(texts, solution)
    if found:
        raise SystemExit("tools/handout/student_copy.py: these shipped files hold lines of the exercises' answers:\n  "
                         + "\n  ".join(found))
    unfit = words_unfit(texts, binaries)
    if unfit:
        raise SystemExit("tools/handout/student_copy.py: these words of the copy's pages do not fit the copy (see "
                         "tools/pages/check_words.py):\n  " + "\n  ".join(unfit))
    unheld = names_unheld(texts, binaries)
    if unheld:
        raise SystemExit("tools/handout/student_copy.py: these files of the copy name a file or folder the copy does "
                         "not hold (tools/pages/check_words.py's unheld_names):\n  " + "\n  ".join(unheld))
    for path, text in texts.items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(text, encoding="utf-8")
    for path in binaries:
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_bytes((ROOT / path).read_bytes())
    record_reference_traces(out)
    return sorted([*texts, *binaries])


def write_autograder(copy: Path, out: Path, points: Path | None = None) -> list[str]:
    """Gradescope's autograder zip of the copy in `copy` (tools/handout/autograder.py), with the
    points of `points` (a points.json; None: conftest.py's GRADE_PER_EXERCISE each); its entries."""
    table = re.search(r"^EXERCISES = \{\n(.*?)^\}", (copy / "lab.py").read_text(), re.M | re.S)
    each = re.search(r"^GRADE_PER_EXERCISE = (\d+)", (copy / "conftest.py").read_text(), re.M)
    if not table or not each:
        raise SystemExit("tools/handout/student_copy.py: lab.py's EXERCISES or conftest.py's GRADE_PER_EXERCISE "
                         "is gone")
    exercises = {int(n): title for n, title in re.findall(r'^\s+(\d+): "([^":]+)', table.group(1), re.M)}
    try:
        weights = {n: float(each.group(1)) for n in exercises} if points is None else \
            autograder.read_points(points.read_text(), exercises)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"tools/handout/student_copy.py: --points {points}: {exc}") from None
    return autograder.build_zip(copy, out, exercises, weights)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write the student's copy of the lab (no solution.py) into DIR")
    parser.add_argument("dir", type=Path, help="where to write it: a new or empty folder")
    parser.add_argument("--autograder", type=Path, metavar="FILE.zip",
                        help="also write Gradescope's autograder of the copy (docs/teaching.md)")
    parser.add_argument("--points", type=Path, metavar="POINTS.json",
                        help='the autograder\'s points per exercise, {"1": 10, ...} (default: 10 each)')
    args = parser.parse_args(argv)
    if args.autograder and args.autograder.resolve().is_relative_to(args.dir.resolve()):
        parser.error("--autograder: write the zip outside DIR (the zip holds DIR)")
    if args.points and not args.autograder:
        parser.error("--points: the points are the autograder's; give --autograder FILE.zip too")
    written = write_copy(args.dir)
    print(f"wrote the student's copy to {args.dir}: {len(written)} files and docs/reference-traces/ "
          f"(left out: {', '.join(MAINTAINERS_ONLY)})")
    if args.autograder:
        entries = write_autograder(args.dir, args.autograder, args.points)
        print(f"wrote Gradescope's autograder to {args.autograder}: {len(entries)} files (setup.sh, run_autograder, "
              "grade.py, points.json and the copy in lab/); upload it as the assignment's autograder")
    print(f"next: cd {args.dir} and follow its README (a virtual environment, then python -m pytest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
