"""`python lab.py hint N [--level K]`: the exercises' hints, three levels each, read from
docs/hints.md (their one home: a `## Exercise N` section per exercise, with `### 1. Nudge`,
`### 2. Idea` and `### 3. Method` under it).

"Next hint" is remembered per module file and exercise in `.hints.json` beside the module (not
committed): the number of levels `hint N` has shown. `--level K` shows level K and neither reads
nor moves that count.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import ModuleType

LEVELS = 3
HINTS_FILE = Path(__file__).resolve().parent.parent / "docs" / "hints.md"
STATE_FILE = ".hints.json"

_EXERCISE = re.compile(r"^## Exercise (\d+)\b")
_LEVEL = re.compile(r"^### (\d+)\.\s+(.+?)\s*$")


class HintsError(Exception):
    """The hints file is missing or malformed: the command line reports it and exits 1."""


def parse_hints(text: str) -> dict[int, dict[int, tuple[str, str]]]:
    """exercise -> level -> (level name, text) from the Markdown of docs/hints.md. Any `## `
    heading other than `## Exercise N` ends the current exercise; text outside `### K.` sections
    (the introduction) is ignored."""
    hints: dict[int, dict[int, tuple[str, str]]] = {}
    exercise = level = None
    lines: list[str] = []

    def close() -> None:
        if exercise is not None and level is not None:
            name = hints[exercise][level][0]
            hints[exercise][level] = (name, "\n".join(lines).strip())

    for line in text.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            close()
            lines = []
            if line.startswith("## "):
                found = _EXERCISE.match(line)
                exercise = int(found.group(1)) if found else None
                level = None
                if exercise is not None:
                    hints.setdefault(exercise, {})
            else:
                found = _LEVEL.match(line)
                level = int(found.group(1)) if found and exercise is not None else None
                if level is not None:
                    hints[exercise][level] = (found.group(2), "")
        else:
            lines.append(line)
    close()
    return hints


def load_hints(path: Path = HINTS_FILE) -> dict[int, dict[int, tuple[str, str]]]:
    try:
        return parse_hints(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise HintsError(f"cannot read the hints file {path}: {exc.strerror or exc}") from None


def state_path(lab: ModuleType) -> Path:
    return Path(os.path.abspath(lab.__file__)).with_name(STATE_FILE)


def _read_state(path: Path) -> dict:
    """The whole state file; a missing or unreadable one is an empty state (hints start over)."""
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def levels_seen(lab: ModuleType, exercise: int) -> int:
    levels = _read_state(state_path(lab)).get(os.path.basename(lab.__file__), {})
    seen = levels.get(str(exercise), 0) if isinstance(levels, dict) else 0
    return seen if isinstance(seen, int) and 0 <= seen <= LEVELS else 0


def _remember(lab: ModuleType, exercise: int, seen: int) -> str | None:
    """Record that `seen` levels of `exercise` were shown; the reason it could not, or None."""
    path = state_path(lab)
    state = _read_state(path)
    levels = state.get(os.path.basename(lab.__file__))  # exercise -> levels seen, for this module's file
    if not isinstance(levels, dict):
        levels = state[os.path.basename(lab.__file__)] = {}
    levels[str(exercise)] = seen
    try:
        path.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return None


def _hint_text(lab: ModuleType, exercise: int, level: int, hints: dict) -> str:
    levels = hints.get(exercise, {})
    if level not in levels or not levels[level][1]:
        raise HintsError(f"{HINTS_FILE} has no level {level} for Exercise {exercise}")
    name, text = levels[level]
    title = lab.EXERCISES[exercise].split(":")[0]
    return f"Exercise {exercise} ({title}), hint {level} of {LEVELS}: {name}\n\n{text}\n"


def show_hint(lab: ModuleType, exercise: int, level: int | None = None, hints: dict | None = None) -> str:
    """The text `hint N [--level K]` prints. Without `level`, the next level not yet seen (and
    remember it); past the last, a message that points to --level."""
    hints = load_hints() if hints is None else hints
    prog = os.path.basename(lab.__file__)
    if level is not None:
        return _hint_text(lab, exercise, level, hints)
    seen = levels_seen(lab, exercise)
    if seen >= LEVELS:
        return (f"No more hints for Exercise {exercise}: you have seen all {LEVELS} levels.\n"
                f"Show one again with `python {prog} hint {exercise} --level K` (K = 1 to {LEVELS}); "
                f"the tests say what is still wrong: `python -m pytest -m exercise{exercise}`.\n")
    text = _hint_text(lab, exercise, seen + 1, hints)
    problem = _remember(lab, exercise, seen + 1)
    if seen + 1 < LEVELS:
        text += f"\n(More: `python {prog} hint {exercise}` shows hint {seen + 2} of {LEVELS}.)\n"
    else:
        text += (f"\n(That was the last level. `python {prog} hint {exercise} --level K` shows any "
                 f"level again.)\n")
    if problem:
        text += f"(Could not remember that you saw it: {problem}.)\n"
    return text
