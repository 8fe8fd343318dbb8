"""Fail unless a run of the lab was honest: every failure a stub's, the provided code whole.

    python .ci/check_lab_report.py REPORT.json [RUN.log] [--reach REACH.jsonl]

REPORT.json is what the suite writes with LAB_REPORT=...; the module checked is LAB_MODULE's
(default lab), imported from the current folder. It checks that
- every failed test failed on a stub, in a test counted under an exercise's row (marked with the
  exercise, or with the last exercise it runs through provided code: `needs(N)`, `reaches(N)`),
  and on the stub of that exercise or an earlier one: a test of Exercise 3 that waits for
  Exercise 5, with 1-3 written, would tell a student who is done that they are not;
- every test of provided code (no row of an exercise) passed or skipped;
- every exercise still stubbed has a red test (else its stub is untested), and none of its tests
  passes: a test that passes while every function of its exercise is a stub tests provided code
  (mark it `needs(N)`), and would hand a stub points in the grade;
- with RUN.log (the run's output): the scoreboard lists no failure that pytest did not print;
- with --reach (the run was of a lab whose exercises record which test ran their code:
  tools/handout/half_way.py's `instrumented`): no test ran the code of an exercise after its row's,
  and no test of provided code ran any exercise's code. So a wrong answer in Exercise E can fail
  only tests counted under Exercise E or a later one, never the provided code's row.
"""

import argparse
import importlib
import json
import os
import re
import sys

sys.path.insert(0, ".")
from course.status import unsolved_exercises  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("report")
parser.add_argument("log", nargs="?")
parser.add_argument("--reach", metavar="REACH.jsonl", help="the records of an instrumented lab's run")
args = parser.parse_args()
module = os.environ.get("LAB_MODULE", "lab")
lab = importlib.import_module(module)
rows = json.load(open(args.report))
failed = [r for r in rows if r["outcome"] == "failed"]
bad = [r["test"] for r in failed if not (r["stub"] and r["row"])]
late = [f"{r['test']} (counted under Exercise {r['row']}, waits for Exercise {r['stub_of']})" for r in failed
        if r["stub"] and r.get("stub_of") and r["stub_of"] > (r["row"] or 0)]
provided = [r for r in rows if not r["row"]]
whole = all(r["outcome"] in ("passed", "skipped") for r in provided)
red = {r["exercise"] for r in failed if r["stub"] and r["exercise"]}
stubbed = sorted(unsolved_exercises(lab))
missing = [n for n in stubbed if n not in red]
free = [f"{r['test']} (Exercise {r['exercise']})" for r in rows
        if r["outcome"] == "passed" and r["exercise"] in stubbed]
lies = []
if args.log:
    log = open(args.log).read()
    cut = log.rfind(" scoreboard (")
    names = re.findall(r"^  failed: (.+)$", log[cut:], re.M)
    listed = len(names) + sum(int(n) for n in re.findall(r"^  \.\.\. and (\d+) more failed", log[cut:], re.M))
    # pytest's header of each failure it printed (an error at a fixture's teardown is the test's)
    printed = set(re.findall(r"^_+ (?:ERROR at (?:setup|teardown) of )?(.+?) _+$", log[:cut], re.M))
    unprinted = [name for name in names if name not in printed]
    if listed > len(printed) or unprinted:
        lies.append(f"the scoreboard names {listed} failure(s), pytest printed {len(printed)}"
                    + (f"; not printed: {unprinted[:3]}" if unprinted else ""))
beyond = []
reached = 0
if args.reach:
    row_of = {r["test"]: r["row"] for r in rows}
    records = open(args.reach, encoding="utf-8").readlines() if os.path.exists(args.reach) else []  # none: none ran
    for line in records:
        test, exercise = json.loads(line)
        reached += 1
        node = test.rsplit(" (", 1)[0]  # pytest's PYTEST_CURRENT_TEST: "<node id> (<phase>)"
        if node not in row_of:
            beyond.append(f"Exercise {exercise}'s code ran outside every test of the run ({test or 'no test running'})")
        elif not row_of[node] or row_of[node] < exercise:
            where = f"Exercise {row_of[node]}'s row" if row_of[node] else "the provided code's row"
            beyond.append(f"{node} is counted under {where} but ran Exercise {exercise}'s code: mark it "
                          f"needs({exercise}) or reaches({exercise}) (or with a later exercise)")
passed = sum(r["outcome"] == "passed" for r in provided)
print(f"{module}: {len(rows)} tests, {len(failed)} red, all on stubs: {not bad and not late}; provided "
      f"{passed}/{len(provided)} whole: {whole}; exercises stubbed {stubbed}, red {sorted(red)}"
      + (f"; {reached} records of a test running an exercise's code, all within its row: {not beyond}"
         if args.reach else ""))
if bad:
    print(f"FAIL: these tests fail against {module}.py for a reason other than a stub:\n  " + "\n  ".join(bad))
if late:
    print("FAIL: these tests wait for a later exercise than the row they count under:\n  " + "\n  ".join(late))
if not whole:
    print("FAIL: the provided code's row is not whole: " + ", ".join(r["test"] for r in provided
                                                                     if r["outcome"] not in ("passed", "skipped")))
if free:
    print("FAIL: these tests pass while their exercise is a stub (they test provided code: mark them needs(N), "
          "not with the exercise):\n  " + "\n  ".join(free))
if missing:
    print(f"FAIL: no test is red against {module}.py for exercise(s) {missing}: their stubs are untested")
if lies:
    print("FAIL: " + "; ".join(lies))
if beyond:
    print("FAIL: a wrong answer would be blamed on the wrong row:\n  " + "\n  ".join(sorted(set(beyond))))
sys.exit(1 if bad or late or not whole or missing or free or lies or beyond else 0)
