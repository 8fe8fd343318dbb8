"""Quiz 6: speculative sampling (Exercise 6), every answer computed by the module under quiz."""

from __future__ import annotations

from types import ModuleType

import numpy as np

from .questions import Question, fmt, fmt_list, question


class _FixedDraws(np.random.Generator):
    """A Generator whose `random()` is always `u` and whose `choice` always returns token 0: it
    finds out whether accept_or_resample keeps a draft at a given uniform."""

    def __init__(self, u: float):
        super().__init__(np.random.PCG64(0))
        self.u = u

    def random(self, *args, **kwargs):
        return self.u

    def choice(self, *args, **kwargs):
        return np.int64(0)


def _acceptance_probability(lab: ModuleType, x: int, p: np.ndarray, q: np.ndarray) -> float:
    """The u below which the module's accept_or_resample keeps draft x (k = 1), by bisection."""
    target = np.stack([p, p])

    def kept(u: float) -> bool:
        return len(lab.accept_or_resample([x], q[None, :], target, _FixedDraws(u))) == 2

    low, high = 0.0, 1.0 - 2.0 ** -53
    if not kept(low):
        return 0.0
    if kept(high):
        return 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if kept(mid) else (low, mid)
    return low


def _twentieths(rng: np.random.Generator, n: int) -> np.ndarray:
    cuts = np.sort(rng.choice(np.arange(1, 20), n - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [20]])) / 20


def quiz_speculative_sampling(lab: ModuleType, rng: np.random.Generator) -> list[Question]:
    p = q = _twentieths(rng, 4)
    while np.allclose(p, q):
        q = _twentieths(rng, 4)
    x = int(rng.choice(np.flatnonzero(q > p)))
    y = int(rng.choice(np.flatnonzero(p > q)))
    z = int(rng.integers(0, 4))
    rows = f"The target's distribution is p = {fmt_list(p)} and the draft's q = {fmt_list(q)}, over tokens 0-3."
    residual = np.maximum(p - q, 0)
    q1 = question(
        f"{rows} The draft proposed token {x}: with what probability is it accepted?",
        _acceptance_probability(lab, x, p, q), min(1.0, p[x] / q[x]),
        f"min(1, p({x}) / q({x})) = min(1, {fmt(p[x])} / {fmt(q[x])}) = {fmt(min(1.0, p[x] / q[x]))}: the "
        f"draft proposes {x} more often than the target would emit it, so only that fraction of its proposals "
        f"is kept, and {x} comes out q({x}) x {fmt(p[x] / q[x])} = p({x}) of the time from accepts.",
        tolerance=0.01)
    alpha = float(np.minimum(p, q).sum())
    q2 = question(
        "With what probability is the draft's token accepted, whatever it is (alpha)?",
        lab.acceptance_rate(p, q), alpha,
        f"alpha = sum over x of q(x) min(1, p(x)/q(x)) = sum min(p, q) = {fmt(alpha)}: one minus the total "
        f"variation distance between p and q.", tolerance=0.01)
    q3 = question(
        f"A draft token was rejected. With what probability is token {y} the one drawn in its place?",
        lab.residual_distribution(p, q)[y], residual[y] / residual.sum(),
        f"The residual is max(0, p - q) normalised: {fmt_list(residual)} / {fmt(residual.sum())}, so token {y} "
        f"gets {fmt(residual[y])} / {fmt(residual.sum())} = {fmt(residual[y] / residual.sum())}. Its total "
        f"{fmt(residual.sum())} = 1 - alpha is exactly the probability of a rejection.", tolerance=0.01)
    q4 = question(
        f"Over every draw (draft from q, then accept or resample), with what probability is the step's first "
        f"token {z}?", lab.speculative_output_distribution(p, q)[z], p[z],
        f"p({z}) = {fmt(p[z])}, whatever q: accepts give min(p, q) and rejections (1 - alpha) x residual = "
        f"max(0, p - q); min(p, q) + max(0, p - q) = p. That is why speculative decoding changes the speed, "
        f"never the distribution.", tolerance=0.01)
    return [q1, q2, q3, q4]
