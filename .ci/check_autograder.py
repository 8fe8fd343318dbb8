"""The autograder on the submissions that are not a half-way state: each scores 0, with one
sentence that says why and no traceback.

    python .ci/check_autograder.py ROOT      # ROOT/source: the zip, unpacked and set up

The half-way states (a stub lab, a half-written one, a finished one, ...) are graded by
`tools/handout/half_way.py check DIR --graded ROOT`, which checks their scores.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

graders = Path(sys.argv[1]).resolve()
lab = (graders / "source" / "lab" / "lab.py").read_text()
SUBMISSIONS = {  # name -> (files submitted, words the message must hold)
    "broken (does not import)": ({"lab.py": lab + "\ndef unfinished(:\n    pass\n"},
                                 ["does not import", "SyntaxError"]),
    "no lab.py": ({"notes.txt": "my answers are in the other file\n"}, ["no lab.py"]),
    "not the lab": ({"lab.py": "print('hello')\n"}, ["not the lab"]),
}
failed = []
for name, (files, words) in SUBMISSIONS.items():
    root = graders.parent / f"{graders.name}-{name.split()[0]}"
    shutil.rmtree(root, ignore_errors=True)
    (root / "submission").mkdir(parents=True)
    (root / "source").symlink_to(graders / "source", target_is_directory=True)
    for path, text in files.items():
        (root / "submission" / path).write_text(text)
    run = subprocess.run(["bash", str(root / "source" / "run_autograder")], capture_output=True, text=True,
                         env=dict(os.environ, AUTOGRADER_ROOT=str(root)))
    graded = json.loads((root / "results" / "results.json").read_text())
    ok = run.returncode == 0 and graded["score"] == 0 and all(w in graded["output"] for w in words) \
        and "Traceback" not in graded["output"] and "\n" not in graded["output"]
    print(f"{'ok' if ok else 'FAIL'} {name}: {graded['score']:g}: {graded['output']}")
    if ok:
        shutil.rmtree(root)
    else:
        failed.append(name)
sys.exit(1 if failed else 0)
