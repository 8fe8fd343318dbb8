"""Best-of-N timing, several functions in turns.

The best of N runs is the time a run takes when nothing else got in its way; timing the
contestants in turns (A, B, A, B, ...) makes drift in the machine's load hit them alike, so their
ratio holds even when the absolute times do not."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable


def best_side_by_side(fns: dict[Hashable, Callable[[], object]], repeats: int = 5, *,
                      clock: Callable[[], float] = time.perf_counter, warm_up: bool = True,
                      budget: float = math.inf) -> dict[Hashable, float]:
    """The best time of each of `fns` (name -> function of no arguments) over `repeats` rounds,
    each round calling every function once in turn. `warm_up` calls each once, untimed, first.
    `budget` (seconds of `clock`) ends the rounds early once it is spent, after at least one."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warm_up:
        for fn in fns.values():
            fn()
    best = dict.fromkeys(fns, math.inf)
    deadline = clock() + budget
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
        if clock() > deadline:
            break
    return best


def best_time(fn: Callable[[], object], repeats: int = 5, *, clock: Callable[[], float] = time.perf_counter) -> float:
    """The best time of `fn()` over `repeats` runs, after an untimed warm-up run."""
    return best_side_by_side({"fn": fn}, repeats, clock=clock)["fn"]
