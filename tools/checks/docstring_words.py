#!/usr/bin/env python3
"""Words in the docstrings a student reads to write each exercise: every function holding an
exercise's solution region, and the classes around them.

    python -m tools.checks.docstring_words [solution.py]
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def exercise_docstrings(source: str) -> dict[int, dict[str, str]]:
    """Exercise number -> {qualified name: docstring} of the functions it writes and their classes."""
    lines = source.split("\n")
    marks = {i + 1: int(m.group(1)) for i, line in enumerate(lines)
             if (m := re.match(r"\s*# BEGIN SOLUTION: Exercise (\d+)", line))}
    found: dict[int, dict[str, str]] = {}

    def visit(node: ast.AST, owners: list) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                if isinstance(child, ast.FunctionDef):
                    for line, number in marks.items():
                        if child.lineno <= line <= child.end_lineno:
                            for owner in [*owners, child]:
                                name = ".".join(o.name for o in owners[:owners.index(owner) + 1]
                                                ) if owner is not child else ".".join(o.name for o in [*owners, child])
                                found.setdefault(number, {})[name] = ast.get_docstring(owner) or ""
                visit(child, [*owners, child])

    visit(ast.parse(source), [])
    return found


def total_words(source: str) -> int:
    """Words in every exercise's docstrings, a class shared by two exercises counted once."""
    every: dict[str, str] = {}
    for docs in exercise_docstrings(source).values():
        every |= docs
    return sum(len(text.split()) for text in every.values())


def main(argv: list[str]) -> int:
    source = (Path(argv[0]) if argv else ROOT / "solution.py").read_text()
    for number, docs in sorted(exercise_docstrings(source).items()):
        words = sum(len(text.split()) for text in docs.values())
        print(f"Exercise {number}: {words:5d} words  ({', '.join(docs)})")
    print(f"total: {total_words(source)} words (a class shared by two exercises once)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
