"""Fail unless every failing test of the lab run failed on a stub, and every stubbed exercise has one."""

import json
import sys

sys.path.insert(0, ".")
import lab  # noqa: E402
from course.status import unsolved_exercises  # noqa: E402

rows = json.load(open(sys.argv[1]))
# A failure must be a stub's, in a test marked with an exercise or with the exercise it needs
# (`needs(N)`: the server and the command line run the exercises' code); a `provided` test must pass.
bad = [r["test"] for r in rows if r["outcome"] == "failed" and not (r["stub"] and (r["exercise"] or r.get("needs")))]
red = {r["exercise"] for r in rows if r["outcome"] == "failed" and r["stub"] and r["exercise"]}
stubbed = sorted(unsolved_exercises(lab))
missing = [n for n in stubbed if n not in red]
failed = sum(r["outcome"] == "failed" for r in rows)
print(f"lab: {len(rows)} tests, {failed} red, all on stubs: {not bad}; exercises stubbed {stubbed}, red {sorted(red)}")
if bad:
    print("FAIL: these tests fail against lab.py for a reason other than a stub:\n  " + "\n  ".join(bad))
if missing:
    print(f"FAIL: no test is red against lab.py for exercise(s) {missing}: their stubs are untested")
sys.exit(1 if bad or missing else 0)
