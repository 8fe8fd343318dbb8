"""The course around the chapter: the command line, and what it runs for a student and a reviewer.
Each entry point is handed the chapter module (`solution` or `lab`), never imports it by name.

    file           what it holds
    cli.py         `main(lab, argv)`: every command of `python lab.py ...` / `python solution.py ...`
    status.py      which functions the module still stubs (`status`, the scoreboard)
    scenarios.py   the four design reviews `python solution.py` prints
    sizing.py      the capacity plan's printout and KV waste (`size`)
    stacks.py      vLLM vs TensorRT-LLM vs SGLang, as data (`stack`)
    fleet.py       `fleet`: the cheapest deployment meeting p99 targets, searched in the simulator
    fleet_page.py  `fleet --html`: goodput against offered rate, the pick and the runner-up
    attack.py      `attack prefix-cache`: the prefix cache's timing channel, and what a salt costs
    hints.py       `hint N`: the hints of docs/hints.md, one level at a time
    quiz.py        `quiz N`: numeric questions the module's own code answers
    trace.py       `trace`: one recorded engine run as a page, step by step
    report.py      `report`: one HTML page of figures drawn from real runs
    svg.py         the pages' drawing: SVG elements, axes, legends, one self-contained page
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
