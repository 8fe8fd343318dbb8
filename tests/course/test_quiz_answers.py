"""The quiz on your module: its answers are your code's, and they must agree with each question's
reasoning. Each case is marked with its exercise, so it runs (and counts) with that exercise's
tests; this file imports the quiz alone, keeping `pytest -m exerciseN` light."""

from __future__ import annotations

import math

import pytest

from conftest import lab
from course import quiz


@pytest.mark.parametrize("exercise", [pytest.param(n, marks=getattr(pytest.mark, f"exercise{n}"))
                                      for n in sorted(lab.EXERCISES)])
def test_quiz_n_computes_its_answers_from_your_module_and_they_agree_with_its_reasoning(exercise):
    for seed in range(4):
        for number, question in enumerate(quiz.make_questions(lab, exercise, seed), 1):
            assert math.isfinite(question.answer)
            if question.expected is not None:
                assert math.isclose(question.answer, question.expected, rel_tol=1e-6, abs_tol=1e-9), (
                    f"quiz {exercise} --seed {seed}, Q{number}: your module computes {question.answer}, the "
                    f"question's reasoning {question.expected}:\n{question.text}\n{question.explanation}")
