"""Which exercises a module still stubs: `python lab.py status`, the scoreboard's to-do list, and
every command that names the stub it needs. Light on purpose (no server, no NumPy): the test
suite's conftest imports it at every run."""

from __future__ import annotations

import inspect
import os
import re
from types import ModuleType


def unsolved_exercises(lab: ModuleType) -> dict[int, list[str]]:
    """Exercise number -> the functions still stubbed in the module's source (empty when all are done)."""
    stubs: dict[int, list[str]] = {}
    for number, name in re.findall(r'raise NotImplementedError\("Exercise (\d+): ([\w.]+)"\)', inspect.getsource(lab)):
        stubs.setdefault(int(number), []).append(name)
    return stubs


def status_report(lab: ModuleType) -> str:
    """Which exercises the module still stubs (`python lab.py status`)."""
    stubs = unsolved_exercises(lab)
    lines = [f"{os.path.basename(lab.__file__)}: the inference-serving lab"]
    for number, title in lab.EXERCISES.items():
        lines.append(f"  Exercise {number}  {title}")
        lines.append("      to do: " + ", ".join(stubs[number]) if number in stubs else "      done")
    prog = os.path.basename(lab.__file__)
    lines.append(f"Stuck? `python {prog} hint N` shows the next of three hints for exercise N; "
                 f"`python {prog} quiz N` asks the numbers it computes (docs/hints.md, docs/deliverables.md).")
    return "\n".join(lines)
