"""What the command line's arguments may be: argparse types that refuse a bad value with one line
(`solution.py size: error: argument --tp: must be a finite number > 0, got 0`, exit status 2)
before any exercise runs."""

from __future__ import annotations

import argparse
import math
from types import ModuleType

from .hints import LEVELS


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `solution.py size: error: ...`, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind, allow_zero: bool = False):
    """An argparse type: a finite number > 0 (>= 0 with allow_zero); inf and nan are refused."""
    def parse(text: str):
        value = kind(text)
        if not (0 <= value if allow_zero else 0 < value) or not value < math.inf:
            raise argparse.ArgumentTypeError(f"must be a finite number {'>=' if allow_zero else '>'} 0, got {text}")
        return value
    parse.__name__ = kind.__name__
    return parse


def exercise_number(lab: ModuleType):
    """An argparse type: the number of one of the module's exercises."""
    known = sorted(lab.EXERCISES)
    span = f"{known[0]} to {known[-1]}" if known == list(range(known[0], known[-1] + 1)) else ", ".join(map(str, known))

    def parse(text: str) -> int:
        try:
            number = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an exercise number (the exercises are {span})") from None
        if number not in lab.EXERCISES:
            raise argparse.ArgumentTypeError(f"there is no exercise {number} (the exercises are {span})")
        return number
    parse.__name__ = "exercise"
    return parse


def hint_level(text: str) -> int:
    """An argparse type: a hint level, 1 to LEVELS."""
    if not (text.strip().isdigit() and 1 <= int(text) <= LEVELS):
        raise argparse.ArgumentTypeError(f"the levels are 1 to {LEVELS}, got {text!r}")
    return int(text)


def rates(text: str) -> list[float]:
    """`--qps 1,2,4` (inf: all at once)."""
    values = [float(r) for r in text.split(",")]
    if not all(r > 0 for r in values):
        raise argparse.ArgumentTypeError(f"every rate must be > 0, got {text}")
    return values


def preset_names(presets: dict, what: str):
    """An argparse type: one preset name or several, comma-separated; an unknown one lists the known."""
    def parse(text: str) -> tuple[str, ...]:
        given = tuple(n.strip() for n in text.split(","))
        for name in given:
            if name not in presets:
                raise argparse.ArgumentTypeError(f"unknown {what} {name!r}; known: {', '.join(presets)}")
        return given
    parse.__name__ = what
    return parse


def prices(text: str) -> tuple[float, ...]:
    """`--usd-per-gpu-hour 2` or `2,4`: finite prices > 0."""
    return tuple(positive(float)(p) for p in text.split(","))
