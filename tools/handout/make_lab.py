#!/usr/bin/env python3
"""Derive lab.py from solution.py.

Every region between a `# BEGIN SOLUTION: Exercise N` line and the next `# END SOLUTION`
line is replaced, at the same indentation, by
`raise NotImplementedError("Exercise N: <qualified name of the enclosing function>")`.
Everything else (signatures, docstrings, provided code) is kept as it is.

    python -m tools.handout.make_lab           # refresh solution.py's reading map, then write lab.py
    python -m tools.handout.make_lab --check   # exit 1 if lab.py or the reading map is out of date

The reading map is the table in the module docstring that gives each section's line range (a
section runs from its title line to the line before the next one). Each file's map gives its
own line numbers: solution.py's are refreshed in place, lab.py's are computed on the lab text.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = re.compile(r"^(\s*)# BEGIN SOLUTION: Exercise (\d+)\s*$")
END = re.compile(r"^\s*# END SOLUTION\s*$")
HEADER = (  # the student's copy ships lab.py, and none of the maintainers' tools: the header names none
    "# The lab: generated from solution.py. Students: write each exercise here, in place of its\n"
    "# `raise NotImplementedError`. Maintainers: edit solution.py, then generate this file again.\n"
)


def enclosing_functions(source: str) -> dict[int, str]:
    """Map every line number inside a function to the function's qualified name (innermost wins)."""
    names: dict[int, str] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                qualname = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    for line in range(child.lineno, child.end_lineno + 1):
                        names[line] = qualname
                visit(child, qualname + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return names


SECTION_TITLE = re.compile(r"^# (\d+)\. ")
MAP_ROW = re.compile(r"^(\s*(\d+)\. .+?\s)(\d+-\d+)( +)(\S.*)$")


def refresh_reading_map(source: str) -> str:
    """`source` with the reading map's line ranges recomputed from the section titles
    (`# N. ...`, the line after each section's opening bar), in `source`'s own numbering."""
    lines = source.split("\n")
    bars = {int(m.group(1)): i for i, line in enumerate(lines) if (m := SECTION_TITLE.match(line))}
    ends = sorted(bars.values())[1:] + [len(lines)]
    ranges = {n: f"{bar}-{end - 1}" for (n, bar), end in zip(sorted(bars.items()), ends)}
    docstring_end = source.index('"""', source.index('"""') + 3)
    for i, line in enumerate(lines):
        if sum(len(x) + 1 for x in lines[:i]) > docstring_end:
            break
        row = MAP_ROW.match(line)
        if row and int(row.group(2)) in ranges:
            width = len(row.group(3)) + len(row.group(4))
            lines[i] = row.group(1) + ranges[int(row.group(2))].ljust(width - 1) + " " + row.group(5)
    return "\n".join(lines)


def make_lab(source: str, only: set[str] | None = None) -> str:
    """The lab text for a solution text; raises ValueError on unbalanced or misplaced markers.
    With `only` (exercise numbers as strings), the other exercises keep their solutions
    (tools/checks/check_stubs.py stubs one exercise at a time)."""
    owners = enclosing_functions(source)
    out: list[str] = [HEADER]
    lines = source.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        begin = BEGIN.match(lines[i])
        if END.match(lines[i]):
            raise ValueError(f"solution.py:{i + 1}: END SOLUTION without BEGIN")
        if not begin:
            out.append(lines[i])
            i += 1
            continue
        indent, exercise = begin.group(1), begin.group(2)
        owner = owners.get(i + 1)
        if owner is None:
            raise ValueError(f"solution.py:{i + 1}: a solution region must sit inside a function")
        j = i + 1
        while j < len(lines) and not END.match(lines[j]):
            if BEGIN.match(lines[j]):
                raise ValueError(f"solution.py:{j + 1}: nested BEGIN SOLUTION")
            j += 1
        if j == len(lines):
            raise ValueError(f"solution.py:{i + 1}: BEGIN SOLUTION without END")
        if only is not None and exercise not in only:
            out += lines[i:j + 1]
        else:
            out.append(f'{indent}raise NotImplementedError("Exercise {exercise}: {owner}")\n')
        i = j + 1
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if lab.py is out of date")
    args = parser.parse_args(argv)
    solution = ROOT / "solution.py"
    source = solution.read_text()
    refreshed = refresh_reading_map(source)
    try:
        lab = refresh_reading_map(make_lab(refreshed))
    except ValueError as exc:
        print(f"make_lab: {exc}", file=sys.stderr)
        return 1
    target = ROOT / "lab.py"
    if args.check:
        if refreshed != source:
            print("make_lab: the reading map in solution.py's docstring is stale; run python -m tools.handout.make_lab",
                  file=sys.stderr)
            return 1
        if not target.exists() or target.read_text() != lab:
            print("make_lab: lab.py is not what solution.py generates; run python -m tools.handout.make_lab",
                  file=sys.stderr)
            return 1
        print("make_lab: lab.py is in sync with solution.py")
        return 0
    if refreshed != source:
        solution.write_text(refreshed)
        print("make_lab: refreshed the reading map in solution.py")
    target.write_text(lab)
    stubs = len(re.findall(r'raise NotImplementedError\("Exercise \d+: ', lab))
    print(f"make_lab: wrote {target.name} ({stubs} stubs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
