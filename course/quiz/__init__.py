"""`python lab.py quiz N`: questions with numeric answers about Exercise N, with figures drawn
fresh each run (`--seed` repeats them).

Every right answer is computed by the module the quiz was handed, at the moment it asks: a
student's quiz is answered by the student's own `blocks_needed`, `BlockTable`, scheduler,
`plan_deployment`... (and by the provided code around them). So the quiz checks the student's
understanding against the student's code; it is not the test suite, and a wrong function gives a
wrong "right answer". To make that visible, each question also carries the value its explanation
derives by hand, and the quiz says so when the module disagrees with it.

All answers are computed before the first question is asked: a stub the quiz needs stops it at
once (NotImplementedError, which the command line turns into "write it first", exit 1), and any
other exception from the module is a QuizError (exit 1). EOF on stdin ends the quiz cleanly.

One module per exercise (blocks.py 1, block_table.py 2, prefix_cache.py 3, paged_attention.py 4,
batching.py 5, speculative_sampling.py 6, speculative_generation.py 7, capacity.py 8), each a
`quiz_...(lab, rng)` that returns its questions; QUIZZES below is the registry, questions.py what a
question is.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import sys
import textwrap
import threading
from collections.abc import Callable
from fractions import Fraction
from types import ModuleType

import numpy as np

from .batching import quiz_batching
from .block_table import quiz_block_table
from .blocks import quiz_blocks
from .capacity import quiz_capacity
from .paged_attention import quiz_paged_attention
from .prefix_cache import quiz_prefix_cache
from .questions import Question, QuizError, fmt
from .speculative_generation import quiz_speculative_generation
from .speculative_sampling import quiz_speculative_sampling

# The registry: each exercise's quiz, in its own module.
QUIZZES: dict[int, Callable[[ModuleType, np.random.Generator], list[Question]]] = {
    1: quiz_blocks,
    2: quiz_block_table,
    3: quiz_prefix_cache,
    4: quiz_paged_attention,
    5: quiz_batching,
    6: quiz_speculative_sampling,
    7: quiz_speculative_generation,
    8: quiz_capacity,
}

STUB = re.compile(r"^Exercise \d+: \S+$")
# Every quiz computes its answers in well under a second on a correct module; an endless loop in
# the module's code must not hang the quiz.
TIME_LIMIT_S = 30


@contextlib.contextmanager
def _time_limit(seconds: float):
    """A QuizError after `seconds` (POSIX main thread only: elsewhere no limit)."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise QuizError(f"computing the answers took more than {seconds:g} s: is there an endless loop?")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def make_questions(lab: ModuleType, exercise: int, seed: int) -> list[Question]:
    """The questions of quiz `exercise`, every answer computed now by `lab`. A stub's
    NotImplementedError goes up as it is; any other failure of the module is a QuizError."""
    try:
        with _time_limit(TIME_LIMIT_S):
            return QUIZZES[exercise](lab, np.random.default_rng(seed))
    except NotImplementedError as exc:
        if STUB.match(str(exc)):
            raise
        raise QuizError(f"NotImplementedError: {exc}") from exc
    except QuizError:
        raise
    except Exception as exc:  # the module's own code failed: say so, as the quiz cannot go on
        raise QuizError(f"{type(exc).__name__}: {exc}") from exc


def parse_answer(text: str) -> float | None:
    """A number as typed: 3, 0.25, 2/3, 1e-3, 12,345; None if it is not one."""
    text = text.strip().replace(",", "").replace("_", "")
    try:
        if "/" in text:
            return float(Fraction(text.replace(" ", "")))
        value = float(text)
    except (ValueError, ZeroDivisionError):
        return None
    return value if math.isfinite(value) else None


def is_right(question: Question, value: float) -> bool:
    if question.whole:
        return value == question.answer
    return abs(value - question.answer) <= question.tolerance + 1e-12


WIDTH = 100


def _wrap(text: str, first: str = "", rest: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first, subsequent_indent=rest, break_long_words=False,
                         break_on_hyphens=False)


def run_quiz(lab: ModuleType, exercise: int, seed: int, prog: str, stdin=None, stdout=None) -> int:
    """Ask the questions on `stdout`, read the answers from `stdin`; returns the exit status (0)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    questions = make_questions(lab, exercise, seed)
    filename = os.path.basename(lab.__file__)
    title = lab.EXERCISES[exercise].split(":")[0]

    def say(text: str = "", end: str = "\n") -> None:
        stdout.write(text + end)
        stdout.flush()

    say(_wrap(f"Quiz {exercise}: {title}. {len(questions)} questions, seed {seed} (`python {prog} quiz {exercise} "
              f"--seed {seed}` asks them again). The right answers are computed by {filename} itself: they are as "
              f"right as its code. Type a number (2/3 is fine); Ctrl-D ends."))
    right = answered = 0
    echo = not (hasattr(stdin, "isatty") and stdin.isatty())
    for number, question in enumerate(questions, 1):
        kind = "a whole number" if question.whole else f"a number, within {question.within}"
        say("\n" + _wrap(f"Q{number} of {len(questions)}. {question.text} ({kind})", rest="  "))
        while True:
            say("answer> ", end="")
            line = stdin.readline()
            if not line:  # EOF
                say()
                say(f"Quiz ended before Q{number}: {right} right of {answered} answered.")
                return 0
            if echo:
                say(line.rstrip("\n"))
            value = parse_answer(line)
            if value is not None:
                break
            say(f"  {line.strip()!r} is not a number: answer with one, such as 3, 0.25 or 2/3.")
        answered += 1
        ok = is_right(question, value)
        right += ok
        say(f"  {'right' if ok else 'wrong'}: the answer is {fmt(question.answer)}.")
        say(_wrap(question.explanation, "  Why: ", "       "))
        if question.expected is not None and not math.isclose(question.answer, question.expected,
                                                                rel_tol=1e-6, abs_tol=1e-9):
            say(_wrap(f"the reasoning above gives {fmt(question.expected)}, but {filename} computes "
                      f"{fmt(question.answer)}: check your code with `python -m pytest -m exercise{exercise}`.",
                      "  Note: ", "        "))
    say(f"\nScore: {right} of {len(questions)} right.")
    return 0
