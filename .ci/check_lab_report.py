"""Fail unless a run of the lab was honest: every failure a stub's, the provided code whole.

    python .ci/check_lab_report.py REPORT.json [RUN.log]

REPORT.json is what the suite writes with LAB_REPORT=...; the module checked is LAB_MODULE's
(default lab), imported from the current folder. It checks that
- every failed test failed on a stub, in a test marked with an exercise or with the exercise it
  needs (`needs(N)`), and on the stub of that exercise or an earlier one: a test of Exercise 3
  that waits for Exercise 5, with 1-3 written, would tell a student who is done that they are not;
- every test of provided code (neither mark) passed or skipped;
- every exercise still stubbed has a red test (else its stub is untested), and none of its tests
  passes: a test that passes while every function of its exercise is a stub tests provided code
  (mark it `needs(N)`), and would hand a stub points in the grade;
- with RUN.log (the run's output): the scoreboard lists no failure that pytest did not print.
"""

import importlib
import json
import os
import re
import sys

sys.path.insert(0, ".")
from course.status import unsolved_exercises  # noqa: E402

module = os.environ.get("LAB_MODULE", "lab")
lab = importlib.import_module(module)
rows = json.load(open(sys.argv[1]))
failed = [r for r in rows if r["outcome"] == "failed"]
bad = [r["test"] for r in failed if not (r["stub"] and (r["exercise"] or r.get("needs")))]
late = [f"{r['test']} (marked {r['exercise'] or r.get('needs')}, waits for Exercise {r['stub_of']})" for r in failed
        if r["stub"] and r.get("stub_of") and r["stub_of"] > (r["exercise"] or r.get("needs") or 0)]
provided = [r for r in rows if not r["exercise"] and not r.get("needs")]
whole = all(r["outcome"] in ("passed", "skipped") for r in provided)
red = {r["exercise"] for r in failed if r["stub"] and r["exercise"]}
stubbed = sorted(unsolved_exercises(lab))
missing = [n for n in stubbed if n not in red]
free = [f"{r['test']} (Exercise {r['exercise']})" for r in rows
        if r["outcome"] == "passed" and r["exercise"] in stubbed]
lies = []
if len(sys.argv) > 2:
    log = open(sys.argv[2]).read()
    cut = log.rfind(" scoreboard (")
    names = re.findall(r"^  failed: (.+)$", log[cut:], re.M)
    listed = len(names) + sum(int(n) for n in re.findall(r"^  \.\.\. and (\d+) more failed", log[cut:], re.M))
    printed = set(re.findall(r"^_+ (.+?) _+$", log[:cut], re.M))  # pytest's header of each failure it printed
    unprinted = [name for name in names if name not in printed]
    if listed > len(printed) or unprinted:
        lies.append(f"the scoreboard names {listed} failure(s), pytest printed {len(printed)}"
                    + (f"; not printed: {unprinted[:3]}" if unprinted else ""))
passed = sum(r["outcome"] == "passed" for r in provided)
print(f"{module}: {len(rows)} tests, {len(failed)} red, all on stubs: {not bad and not late}; provided "
      f"{passed}/{len(provided)} whole: {whole}; exercises stubbed {stubbed}, red {sorted(red)}")
if bad:
    print(f"FAIL: these tests fail against {module}.py for a reason other than a stub:\n  " + "\n  ".join(bad))
if late:
    print("FAIL: these tests wait for a later exercise than they are marked with:\n  " + "\n  ".join(late))
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
sys.exit(1 if bad or late or not whole or missing or free or lies else 0)
