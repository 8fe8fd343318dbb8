"""The course around the chapter: the command line, and what it runs for a student and a reviewer.
Each entry point is handed the chapter module (`solution` or `lab`), never imports it by name.

    file / folder   what it holds
    cli.py          `main(lab, argv)`: parse `python lab.py ...` / `python solution.py ...`, run the command
    commands.py     every command: its arguments beside what it runs (`COMMANDS`)
    arguments.py    the argparse types: one-line errors, exit status 2
    status.py       which functions the module still stubs (`status`, the scoreboard)
    hints.py        `hint N`: the hints of docs/hints.md, one level at a time
    reviews/        the design reviews: `size`, `batching`, `speculate`, `stack` (the four scenarios
                    `python solution.py` prints), `fleet` (its search and its table), `attack`
    pages/          the pages: `trace` (a recorded engine run, its workloads, its HTML, CSS and
                    script as package data), `report` (one module per figure), `fleet --html`, and
                    the SVG drawing they share
    quiz/           `quiz N`: numeric questions the module's own code answers, one module per exercise
"""

from __future__ import annotations

from types import ModuleType

__all__ = ["main"]


def main(lab: ModuleType, argv: list[str] | None = None) -> int:
    """The command line for the module `lab` (`cli.main`): `python solution.py ARGS` and
    `python lab.py ARGS` are `course.main(<that module>, ARGS)`."""
    # Imported here, not above: the scoreboard (conftest) imports course.status alone, without the
    # server, the load generator and every command that cli.py brings in.
    from .cli import main as run

    return run(lab, argv)
