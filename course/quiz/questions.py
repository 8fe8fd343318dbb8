"""What every quiz is made of: a Question (the module's answer, the value its explanation
derives by hand), the QuizError the module's own failures become, and how numbers are written."""

from __future__ import annotations

import dataclasses
import math

import numpy as np


class QuizError(Exception):
    """The module's code failed (not a stub) while the quiz computed its answers."""


@dataclasses.dataclass
class Question:
    text: str
    answer: float               # computed by the module under quiz
    expected: float | None      # what the explanation derives by hand (None: nothing to compare)
    explanation: str
    whole: bool = True          # a whole number, checked exactly
    tolerance: float = 0.0      # absolute, for the other answers
    within: str = ""            # the tolerance as the question states it: "0.01", "1%"


def question(text: str, answer, expected, explanation: str, tolerance: float = 0.0, relative: bool = False):
    """A Question with the answer as a Python number; `relative`: tolerance is a fraction of it."""
    whole = tolerance == 0.0
    if isinstance(answer, (np.integer, np.floating)):
        answer = answer.item()
    if not (isinstance(answer, (int, float)) and not isinstance(answer, bool) and math.isfinite(answer)):
        raise QuizError(f"the module computed {answer!r} for a question that needs a finite number")
    if whole and answer != int(answer):
        raise QuizError(f"the module computed {answer!r} where a whole number is expected")
    answer = int(answer) if whole else float(answer)
    within = "" if whole else f"{tolerance:.0%}" if relative else f"{tolerance:g}"
    if relative:
        tolerance *= abs(answer)
    return Question(text, answer, expected, explanation, whole, tolerance, within)


def fmt(x: float) -> str:
    if float(x).is_integer():
        return f"{int(x)}"
    return f"{x:.4g}" if abs(x) >= 1e-3 else f"{x:.3g}"


def fmt_list(values) -> str:
    return "[" + ", ".join(fmt(float(v)) for v in values) + "]"


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def plural(count: int, word: str) -> str:
    """'1 block', '3 blocks'."""
    return f"{count} {word}{'' if count == 1 else 's'}"
