"""Shared by the benchmarks of tools/ (benchmarks/, server/, fleet/): the module measured by
default, the report's lines, a child's OpenBLAS threads, and solution.py (or the whole tree) as
another git revision had it. Timing itself is measure/timing.py's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from importlib.machinery import PathFinder
from importlib.util import module_from_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# What a benchmark measures by default: the reference, or the lab in the student's copy (no solution.py).
DEFAULT_MODULE = "solution" if (ROOT / "solution.py").exists() else "lab"


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


def blas_env(blas_threads: int | None) -> dict[str, str]:
    """This process's environment, with OPENBLAS_NUM_THREADS set for a child (None: as it is).
    OpenBLAS reads it once, when NumPy is imported: it must be set before the child starts."""
    env = dict(os.environ)
    if blas_threads is not None:
        env["OPENBLAS_NUM_THREADS"] = str(blas_threads)
    return env


def description(doc: str) -> str:
    """A command's --help description: its module docstring's first paragraph, on one line."""
    return doc.split("\n\n")[0].replace("\n", " ")


def with_one_blas_thread() -> None:
    """Run this command again with OPENBLAS_NUM_THREADS=1 (as `serve` runs the lab) unless it is set:
    OpenBLAS reads it once, when NumPy loads, which is before any command's code runs."""
    if "OPENBLAS_NUM_THREADS" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], blas_env(1))


def solution_at(rev: str, name: str = "solution_before"):
    """solution.py as it was at git revision `rev`, imported as the module `name` (the chapter's
    engine imports nothing of the packages beside it, so this checkout's serve any revision's).
    This is the tools' one import of a file by its path: that file is in no folder Python searches."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:solution.py"],
                            check=True, capture_output=True, text=True, timeout=60).stdout
    folder = tempfile.mkdtemp()
    (Path(folder) / f"{name}.py").write_text(source)
    spec = PathFinder.find_spec(name, [folder])
    module = module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name while the class is made
    spec.loader.exec_module(module)
    return module


def tree_at(rev: str) -> Path:
    """The repository at git revision `rev`, unpacked into a scratch folder."""
    where = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where
