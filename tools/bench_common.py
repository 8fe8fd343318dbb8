"""Shared by the benchmarks of tools/ (benchmarks/, server/): the module under test, the clock,
side-by-side timing, the report's lines, and solution.py (or the whole tree) as another git
revision had it.

Run through tools/bench.py, which sets `lab` (the module measured) and `clock` here."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

# What a benchmark measures by default: the reference, or the lab in the student's copy (no solution.py).
DEFAULT_MODULE = "solution" if (ROOT / "solution.py").exists() else "lab"
lab = None  # the module under test (solution or lab): tools/bench.py sets it before any benchmark runs
clock = time.perf_counter  # or time.process_time with --cpu-time (tools/bench.py sets it)


class Report:
    """A benchmark's lines: each kept for the report it returns, and handed to `log` (None:
    silent) as soon as it is measured (progress, on a slow machine)."""

    def __init__(self, log=print):
        self.lines: list[str] = []
        self.log = log

    def __call__(self, line: str) -> None:
        self.lines.append(line)
        if self.log is not None:
            self.log(line)

    def text(self) -> str:
        return "\n".join(self.lines)


def _best_side_by_side(fns: dict, repeats: int = 5) -> dict:
    """Best wall times of several functions measured in turns, so drift hits them all alike."""
    for fn in fns.values():
        fn()
    best = {name: math.inf for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = clock()
            fn()
            best[name] = min(best[name], clock() - start)
    return best


def _timeit(fn, repeats: int = 5) -> float:
    """Best wall time of `fn()` over `repeats` runs, after a warm-up run."""
    return _best_side_by_side({"fn": fn}, repeats)["fn"]


def _blas_env(blas_threads: int | None) -> dict[str, str]:
    """This process's environment, with OPENBLAS_NUM_THREADS set for a child (None: as it is).
    OpenBLAS reads it once, when NumPy is imported: it must be set before the child starts."""
    env = dict(os.environ)
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    return env


def load_module(path: Path, name: str):
    """The Python file at `path`, imported as the module `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def solution_at(rev: str, name: str = "solution_before"):
    """solution.py as it was at git revision `rev`, imported as the module `name` (the chapter's
    engine imports nothing of the packages beside it, so this checkout's serve any revision's)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:solution.py"],
                            check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    return load_module(path, name)


def tree_at(rev: str) -> Path:
    """The repository at git revision `rev`, unpacked into a scratch folder."""
    where = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where
